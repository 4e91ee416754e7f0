"""Argument checks shared by the public modules (each keeps its own message)."""

import os


def is_positive_int(value) -> bool:
    """Whether `value` is an int >= 1 (a bool is not an int here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def is_nonempty_path(value) -> bool:
    """Whether `value` is a `str` or `os.PathLike` naming something."""
    return isinstance(value, (str, os.PathLike)) and bool(os.fspath(value))
