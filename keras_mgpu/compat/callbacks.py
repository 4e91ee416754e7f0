"""Keras's `fit` and callback internals the backup resumes through
(keras/src/trainers/trainer.py, keras/src/callbacks/callback_list.py): the
initial epoch, the sibling callbacks, and the check that runs as a backed-up
`fit` begins.
"""

from __future__ import annotations

import keras

from keras_mgpu.compat._core import _require
from keras_mgpu.compat.registry import _BACKUP
from keras_mgpu.compat.saving import _h5_store, _load_state, _save_state


# --- Backup and restore (keras_mgpu.callbacks.BackupAndRestore) --------------
# Keras's `fit` starts at `model._initial_epoch` when set (its own
# BackupAndRestore uses this), and calls `model.train_function(iterator)`
# once per batch (or `steps_per_execution` batches).


def set_initial_epoch(model, epoch) -> None:
    """Makes the running `fit` start at `epoch` (None: as the caller asked)."""
    _require(model, "_initial_epoch", _BACKUP)
    model._initial_epoch = epoch


def callback_siblings(callback):
    """The callbacks of the `CallbackList` driving `callback` (itself included).

    Callbacks have no reference to their list. The list is found among the
    objects referring to `callback` (Python's `gc.get_referrers`, one scan
    of the heap per call: call it once per `fit`); when several lists hold it
    (a failed `fit`'s list kept alive by its traceback), the one whose
    `params` were given to `callback` is the current one. None when no
    `CallbackList` holds it (a hand-driven callback).
    """
    import gc

    callback_list = _require(keras.callbacks, "CallbackList", _BACKUP)
    found = []
    for container in gc.get_referrers(callback):
        if not isinstance(container, list):
            continue
        for owner in gc.get_referrers(container):
            if isinstance(owner, dict):
                # An instance dict Python has materialized: its owner.
                owners = [o for o in gc.get_referrers(owner)
                          if isinstance(o, callback_list)
                          and getattr(o, "__dict__", None) is owner]
            else:
                owners = [owner]
            found.extend(o for o in owners if isinstance(o, callback_list)
                         and getattr(o, "callbacks", None) is container)
    if not found:
        return None
    current = [o for o in found if o.params is callback.params]
    return list((current or found)[-1].callbacks)


def check_backup_support(model) -> None:
    """Raises `KerasInternalsError` unless this Keras has everything
    `BackupAndRestore` uses (called as a `fit` begins, before any step)."""
    _require(model, "_initial_epoch", _BACKUP)
    _save_state()
    _load_state()
    _h5_store()
