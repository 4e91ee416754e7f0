"""`DistributedLogger`'s arguments, checked before anything is created."""

from __future__ import annotations

import importlib.util

from keras_mgpu._checks import is_nonempty_path, is_positive_int

_INSTALL_HINT = 'pip install "keras-mgpu[wandb]"'


def _validate(log_dir, update_freq, batch_size, wandb, profile_steps,
              console) -> None:
    if not isinstance(console, bool):
        raise TypeError(
            f"console must be True (print a line per epoch) or False, got "
            f"{console!r} (a non-empty string such as 'no' would count as "
            f"True)."
        )
    if not is_nonempty_path(log_dir):
        raise TypeError(
            f"log_dir must be a non-empty path, got {log_dir!r}."
        )
    if update_freq != "epoch" and not is_positive_int(update_freq):
        raise ValueError(
            f"update_freq must be a positive integer (train batches per "
            f"record) or 'epoch', got {update_freq!r}."
        )
    if batch_size is not None and not is_positive_int(batch_size):
        raise ValueError(
            f"batch_size must be a positive integer (the global batch size) "
            f"or None, got {batch_size!r}."
        )
    if wandb is not None and not isinstance(wandb, (bool, dict)):
        raise TypeError(
            f"wandb must be None, a bool or a dict of wandb.init arguments, "
            f"got {wandb!r}."
        )
    if wandb not in (None, False) and importlib.util.find_spec("wandb") is None:
        raise ImportError(
            f"DistributedLogger(wandb={wandb!r}) needs the wandb package, "
            f"which is not installed. Install it with: {_INSTALL_HINT}"
        )
    if profile_steps is not None:
        ok = (
            isinstance(profile_steps, (tuple, list))
            and len(profile_steps) == 2
            and all(
                isinstance(s, int) and not isinstance(s, bool)
                for s in profile_steps
            )
            and 1 <= profile_steps[0] <= profile_steps[1]
        )
        if not ok:
            raise ValueError(
                f"profile_steps must be a pair (start, stop) of batch numbers "
                f"with 1 <= start <= stop, got {profile_steps!r}."
            )
