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
        start = time.perf_counter()
        try:
            return super()._save(*args, **kwargs)
        finally:
            self.save_seconds.append(time.perf_counter() - start)

    def _write_generation(self, *args):
        start = time.perf_counter()
        try:
            return super()._write_generation(*args)
        finally:
            self.write_seconds.append(time.perf_counter() - start)

    def _write_tiers(self, *args):
        # With a local tier: its write (the durable one, when due, runs on
        # a thread of its own and is not timed here).
        start = time.perf_counter()
        try:
            return super()._write_tiers(*args)
        finally:
            self.write_seconds.append(time.perf_counter() - start)
