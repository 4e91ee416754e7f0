"""`TimedBackup`: keras-mgpu's `BackupAndRestore`, timing each of its saves.

Shared by `checkpoint.py` (the save cost against Keras's own callback) and
the GPU suite's `overheads` part (the stall per save beside its ratios).
Imports keras-mgpu's callbacks: a script imports it after it has set up
its backend and devices.
"""

import time

from keras_mgpu.callbacks import BackupAndRestore


class TimedBackup(BackupAndRestore):
    """keras-mgpu's callback, timing each save's stall of the training
    thread (`save_seconds`) and its background write (`write_seconds`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.save_seconds = []
        self.write_seconds = []

    def _save(self, epoch, step_in_epoch):
        start = time.perf_counter()
        try:
            return super()._save(epoch, step_in_epoch)
        finally:
            self.save_seconds.append(time.perf_counter() - start)

    def _write_generation(self, *args):
        start = time.perf_counter()
        try:
            return super()._write_generation(*args)
        finally:
            self.write_seconds.append(time.perf_counter() - start)
