"""`TimedBackup`: keras-mgpu's `BackupAndRestore`, timing each of its saves;
`TimedKerasBackup`: Keras's own, timing its save path.

Shared by `checkpoint.py` (the save cost against Keras's own callback),
`recovery.py` (the local tier's) and the GPU suite's `overheads` part (the
stall per save beside its ratios).
Imports keras-mgpu's callbacks: a script imports it after it has set up
its backend and devices.
"""

import time

import keras

from keras_mgpu.callbacks import BackupAndRestore


class TimedKerasBackup(keras.callbacks.BackupAndRestore):
    """Keras's callback, timing each call of its save path."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.save_seconds = []

    def _save_model(self):
        start = time.perf_counter()
        super()._save_model()
        self.save_seconds.append(time.perf_counter() - start)


class TimedBackup(BackupAndRestore):
    """keras-mgpu's callback, timing each save's stall of the training
    thread (`save_seconds`) and its background write (`write_seconds`: with
    a local tier, the local write)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.save_seconds = []
        self.write_seconds = []

    def _save(self, *args, **kwargs):
        return _timed(self.save_seconds, super()._save, *args, **kwargs)

    def _write_generation(self, *args):
        return _timed(self.write_seconds, super()._write_generation, *args)

    def _write_tiers(self, *args):
        # With a local tier: its write (the durable one, when due, runs on
        # a thread of its own and is not timed here).
        return _timed(self.write_seconds, super()._write_tiers, *args)


def _timed(seconds: list, call, *args, **kwargs):
    """`call(*args, **kwargs)`, its duration appended to `seconds`."""
    start = time.perf_counter()
    try:
        return call(*args, **kwargs)
    finally:
        seconds.append(time.perf_counter() - start)
