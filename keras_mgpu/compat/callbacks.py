"""Keras's `fit` and callback internals the backup resumes through
(keras/src/trainers/trainer.py, keras/src/callbacks/callback_list.py): the
initial epoch and the check that runs as a backed-up `fit` begins.
"""

from __future__ import annotations

from keras_mgpu.compat._core import _require
from keras_mgpu.compat.registry import _BACKUP
from keras_mgpu.compat.saving import (
    _h5_store, _load_state, _save_state, _saveable_walk)


# --- Backup and restore (keras_mgpu.callbacks.BackupAndRestore) --------------
# Keras's `fit` starts at `model._initial_epoch` when set (its own
# BackupAndRestore uses this), and calls `model.train_function(iterator)`
# once per batch (or `steps_per_execution` batches).


def set_initial_epoch(model, epoch) -> None:
    """Makes the running `fit` start at `epoch` (None: as the caller asked)."""
    _require(model, "_initial_epoch", _BACKUP)
    model._initial_epoch = epoch


def check_backup_support(model) -> None:
    """Raises `KerasInternalsError` unless this Keras has everything
    `BackupAndRestore` uses (called as a `fit` begins, before any step)."""
    _require(model, "_initial_epoch", _BACKUP)
    _save_state()
    _saveable_walk()
    _load_state()
    _h5_store()
