"""Argument checks shared by the public modules (each keeps its own message)."""


def is_positive_int(value) -> bool:
    """Whether `value` is an int >= 1 (a bool is not an int here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
