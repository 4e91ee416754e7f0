"""Argument checks shared by the public modules (each keeps its own message)."""

import numbers
import os
import stat

import numpy as np


def is_positive_int(value) -> bool:
    """Whether `value` is an int >= 1 (a bool is not an int here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def is_integer(value) -> bool:
    """Whether `value` is an int or a NumPy integer (a bool is not one here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_positive_integer(value) -> bool:
    """Like `is_positive_int`, but a NumPy integer counts too.

    For arguments that are only counted with (convert them with `int()`);
    `is_positive_int` stays strict where the value is stored or serialised.
    """
    return is_integer(value) and value >= 1


def is_flag(value) -> bool:
    """Whether `value` is `True` or `False` (also NumPy's), not 0/1 or "no"."""
    return isinstance(value, (bool, np.bool_))


def is_nonempty_path(value) -> bool:
    """Whether `value` is a `str` or `os.PathLike` naming something."""
    return isinstance(value, (str, os.PathLike)) and bool(os.fspath(value))


def file_kind(mode: int) -> str:
    """What a file of `st_mode` `mode` is, for a message: "a directory", ..."""
    for test, kind in ((stat.S_ISREG, "a regular file"),
                       (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return f"a special file (mode {mode:o})"
