"""A job with injected faults, for `keras-mgpu launch`, that records the
ground truth of where its time went (tests/test_goodput_harness.py).

Run by the launcher as `python tests/goodput_job.py OUT_DIR`. Each batch
takes `goodput_workers.PAUSE` seconds to load, each validation batch too,
each backup save stalls the training thread `SAVE_PAUSE` seconds more;
attempt 1
SIGKILLs itself after global step `KILLS[1]`, attempt 2 after `KILLS[2]`.
The job logs to `OUT_DIR/logs` (`DistributedLogger`) and backs up to
`OUT_DIR/backup`. Apart from the ledger, every attempt appends what it
timed itself (`time.time()`, unix seconds) to `OUT_DIR/truth.jsonl`, one
line per event: `load` (a batch's load, start and end), `batch` (a train
batch's `on_train_batch_begin` to `_end`, its global step, and whether it
trained or a resume skipped it), `test` (validation), `save` (the training
thread in a backup save, or waiting for a write), `restore`, `train_end`,
`killed` (just before its SIGKILL).
"""

import json
import os
import signal
import sys
import threading
import time

# The repository root, not this script's folder.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SAVE_PAUSE = 0.3
TRAIN_BATCHES = 10
VAL_BATCHES = 4
EPOCHS = 4
SAVE_FREQ = 6
# Global step after which each attempt kills itself.
KILLS = {1: 15, 2: 28}

_lock = threading.Lock()
# The attempt (KERAS_MGPU_ATTEMPT) and OUT_DIR, set by main().
_run: dict = {}


def truth(event: str, **fields) -> None:
    line = json.dumps({"attempt": _run["attempt"], "event": event, **fields})
    # Flushed to the OS, which keeps it through a SIGKILL.
    with _lock, open(os.path.join(_run["out"], "truth.jsonl"), "a") as f:
        f.write(line + "\n")


import keras  # noqa: E402

from keras_mgpu.callbacks import BackupAndRestore, DistributedLogger  # noqa: E402
from keras_mgpu.callbacks.backup import callback as backup_callback  # noqa: E402
from keras_mgpu.runtime import training_runtime  # noqa: E402
from tests import goodput_workers  # noqa: E402


class TimedBatches(goodput_workers.SlowBatches):
    """Batches that take `PAUSE` seconds each to load, each load timed
    (`kind`: "train" or "validation")."""

    kind = "train"

    def __getitem__(self, index):
        start = time.time()
        try:
            return super().__getitem__(index)
        finally:
            truth("load", kind=self.kind, start=start, end=time.time())


class SlowSaves(BackupAndRestore):
    """Saves that stall the training thread `SAVE_PAUSE` seconds more; the
    training thread's time in a save, or waiting for a write outside one,
    is a `save` event."""

    _saving = False

    def _snapshot(self, *args):
        time.sleep(SAVE_PAUSE)
        return super()._snapshot(*args)

    def _save(self, *args, **kwargs):
        start, self._saving = time.time(), True
        try:
            return super()._save(*args, **kwargs)
        finally:
            self._saving = False
            truth("save", start=start, end=time.time())

    def _finish_write(self, *args, **kwargs):
        if self._saving:
            return super()._finish_write(*args, **kwargs)
        start = time.time()
        try:
            return super()._finish_write(*args, **kwargs)
        finally:
            truth("save", start=start, end=time.time())


_restore = backup_callback.restore_latest


def timed_restore(*args, **kwargs):
    start = time.time()
    try:
        return _restore(*args, **kwargs)
    finally:
        truth("restore", start=start, end=time.time())


class Truth(keras.callbacks.Callback):
    """Times batches and validation; kills the attempt at its step."""

    def on_train_batch_begin(self, batch, logs=None):
        self._begun = time.time()
        self._step = training_runtime(self.model).global_step

    def on_train_batch_end(self, batch, logs=None):
        # A batch a resumed run skips leaves the step where it was.
        step = training_runtime(self.model).global_step
        truth("batch", step=step, trained=step > self._step,
              start=self._begun, end=time.time())
        if KILLS.get(_run["attempt"]) == step:
            truth("killed", t=time.time())
            os.kill(os.getpid(), signal.SIGKILL)

    def on_test_begin(self, logs=None):
        self._testing = time.time()

    def on_test_end(self, logs=None):
        truth("test", start=self._testing, end=time.time())

    def on_train_end(self, logs=None):
        truth("train_end", t=time.time())


def main(out: str) -> None:
    _run.update(out=out, attempt=int(os.environ["KERAS_MGPU_ATTEMPT"]))
    backup_callback.restore_latest = timed_restore
    model, train, validation = goodput_workers.model_and_data(
        TRAIN_BATCHES, VAL_BATCHES, TimedBatches)
    validation.kind = "validation"
    model.fit(train, validation_data=validation,
              epochs=EPOCHS, verbose=0, callbacks=[
                  Truth(),
                  DistributedLogger(os.path.join(out, "logs"), update_freq=2,
                                    console=False),
                  SlowSaves(os.path.join(out, "backup"), save_freq=SAVE_FREQ),
              ])


if __name__ == "__main__":
    main(sys.argv[1])
