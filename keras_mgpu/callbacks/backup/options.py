"""The constructor arguments of `BackupAndRestore`, checked: a bad value
is refused with its name and what to pass instead."""

from __future__ import annotations

import os
from typing import Optional, Union

from keras_mgpu import _fs
from keras_mgpu._checks import is_nonempty_path, is_positive_int


def check_arguments(
    backup_dir, save_freq: Union[str, int, bool], double_checkpoint: bool,
    delete_checkpoint: bool, keep: Optional[int], save_on_sigterm: bool,
    exit_code: int, restart_if_unusable: bool,
) -> int:
    """Raises on a bad argument; returns `keep` resolved (`None`: 2 with
    `double_checkpoint`, else 1)."""
    if not is_nonempty_path(backup_dir):
        raise ValueError(
            f"backup_dir must be a non-empty path, got {backup_dir!r}."
        )
    _check_backup_dir(os.fspath(backup_dir))
    flags = {"double_checkpoint": double_checkpoint,
             "delete_checkpoint": delete_checkpoint,
             "save_on_sigterm": save_on_sigterm,
             "restart_if_unusable": restart_if_unusable}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(
                f"{name} must be True or False, got {value!r} (a "
                "non-empty string such as 'false' would count as True)."
            )
    if save_freq is False:
        if not save_on_sigterm:
            raise ValueError(
                "save_freq=False makes no periodic saves: only the "
                "SIGTERM save, which needs save_on_sigterm=True. Without "
                "it nothing would ever be saved (Keras documents "
                "save_freq=False for preemption checkpointing; "
                "keras.callbacks.BackupAndRestore in Keras 3 saves after "
                "every batch with it). Pass save_on_sigterm=True, or "
                "save_freq=1 to save after every batch, or "
                "save_freq='epoch'."
            )
    elif save_freq != "epoch" and not is_positive_int(save_freq):
        raise ValueError(
            f"Invalid value for save_freq: {save_freq!r}. Use 'epoch', a "
            "positive number of batches, or False (with "
            "save_on_sigterm=True: save only on SIGTERM). "
            "keras.callbacks.BackupAndRestore saves after every batch "
            "for 0, a negative number or True: that is save_freq=1."
        )
    if keep is None:
        keep = 2 if double_checkpoint else 1
    elif not is_positive_int(keep):
        raise ValueError(
            f"keep must be None or a positive integer, got {keep!r}: the "
            "newest generation is always kept."
        )
    elif double_checkpoint and keep < 2:
        raise ValueError(
            f"double_checkpoint=True keeps the previous generation as a "
            f"fallback, which needs keep >= 2, got keep={keep}. Pass "
            "keep=2 (or more, or leave keep=None), or "
            "double_checkpoint=False to keep one generation."
        )
    if (not isinstance(exit_code, int) or isinstance(exit_code, bool)
            or not 0 <= exit_code <= 255):
        raise ValueError(
            f"exit_code must be an integer from 0 to 255 (a process exit "
            f"status; 256 would exit 0), got {exit_code!r}."
        )
    return keep


def check_local_tier(local_dir, local_save_freq, backup_dir: str,
                     save_freq: Union[str, int, bool]) -> Optional[int]:
    """Raises on a bad `local_dir` or `local_save_freq`; returns the local
    tier's save frequency (None: no local tier). By default a tenth of an
    integer `save_freq`; `local_dir="auto"` has no local tier where none
    can be derived (`save_freq` of "epoch", False or 1)."""
    if local_dir is None:
        if local_save_freq is not None:
            raise ValueError(
                f"local_save_freq={local_save_freq!r} needs local_dir: the "
                "folder on each machine for the local tier, e.g. "
                "local_dir='/dev/shm/run1' or local_dir='auto'.")
        return None
    if not is_nonempty_path(local_dir):
        raise ValueError(
            f"local_dir must be None, 'auto' or a non-empty path, got "
            f"{local_dir!r}.")
    path = os.fspath(local_dir)
    if _fs.is_url(path):
        raise ValueError(
            f"local_dir={path!r} is a URL: the local tier is a folder on "
            "each worker's own machine, e.g. '/dev/shm/run1'. Durable "
            "storage such as gs:// goes in backup_dir.")
    auto = path == "auto"
    if not auto and os.path.abspath(path) == os.path.abspath(backup_dir):
        raise ValueError(
            f"local_dir={path!r} is backup_dir: give the local tier a "
            "folder of its own, e.g. under /dev/shm.")
    periodic = (save_freq if isinstance(save_freq, int)
                and is_positive_int(save_freq) else None)
    if local_save_freq is None:
        if periodic is not None and periodic >= 2:
            return max(1, periodic // 10)
        if auto:
            return None
        raise ValueError(
            f"local_dir needs local_save_freq with save_freq={save_freq!r}"
            ": pass the number of batches between local saves.")
    if not is_positive_int(local_save_freq):
        raise ValueError(
            f"local_save_freq must be None or a positive number of batches "
            f"between local saves, got {local_save_freq!r}.")
    if periodic is not None and local_save_freq >= periodic:
        raise ValueError(
            f"local_save_freq={local_save_freq} saves no more often than "
            f"save_freq={save_freq}: the local tier would add nothing. "
            "Pass a smaller local_save_freq (by default a tenth of "
            "save_freq), or local_dir=None.")
    return local_save_freq


def _check_backup_dir(path: str) -> None:
    """Refuses a `backup_dir` that names no directory of its own."""
    if _fs.is_url(path):
        scheme, location = path.split("://", 1)
        if not location.strip("/"):
            raise ValueError(
                f"backup_dir={path!r} names a filesystem but no bucket or "
                "directory in it (the path would be a local folder named "
                f"{scheme + ':'!r}). Give the directory for this run's "
                f"backups, e.g. '{scheme}://bucket/run1/backup'."
            )
    elif not path.strip("/"):
        raise ValueError(
            f"backup_dir={path!r} is the filesystem root: BackupAndRestore "
            "creates and deletes its generations in backup_dir, and the "
            "directory itself after a finished run. Give a directory of "
            "its own, e.g. '/tmp/run1/backup'."
        )


def check_writable(store) -> None:
    try:
        store.check_writable()
    except _fs.ERRORS as e:
        raise PermissionError(
            f"BackupAndRestore cannot write to backup_dir={store.directory!r} "
            f"({type(e).__name__}: {e}). Choose a writable directory; any "
            "backup already there was left untouched."
        ) from None
