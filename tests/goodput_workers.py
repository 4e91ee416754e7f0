"""Worker functions of the goodput ledger's tests (tests/backends/
test_backend_goodput.py): each runs in a process of its own, so that its
first `fit` is the process's first, on the active Keras backend."""

import json
import os
import time

import keras
import numpy as np

from keras_mgpu.callbacks import BackupAndRestore, DistributedLogger

PAUSE = 0.05  # seconds each batch takes to load
BATCH = 8


class SlowBatches(keras.utils.PyDataset):
    """Batches of `x`, `y`, each loaded in `PAUSE` seconds (on the training
    thread: one worker, no queue)."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, index):
        time.sleep(PAUSE)
        rows = slice(index * BATCH, (index + 1) * BATCH)
        return self.x[rows], self.y[rows]


def records(log_dir):
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def model_and_data(train_batches, val_batches, batches=SlowBatches):
    """A compiled small model, and `batches` of `train_batches` and of
    `val_batches` of a regression."""
    rng = np.random.default_rng(0)
    n = (train_batches + val_batches) * BATCH
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    split = train_batches * BATCH
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                              keras.layers.Dense(1)])
    model.compile("adam", "mse")
    return (model, batches(x[:split], y[:split]),
            batches(x[split:], y[split:]))


def fit(log_dir, backup_dir=None, epochs=2, train_batches=6, val_batches=3):
    model, train, validation = model_and_data(train_batches, val_batches)
    callbacks = [DistributedLogger(log_dir, update_freq=2, console=False)]
    if backup_dir is not None:
        callbacks.append(BackupAndRestore(backup_dir, save_freq=2))
    model.fit(train, validation_data=validation, epochs=epochs, verbose=0,
              callbacks=callbacks)
    return records(log_dir)


def fit_once(log_dir, backup_dir, epochs, train_batches, val_batches):
    return {"records": fit(log_dir, backup_dir, epochs, train_batches,
                           val_batches), "pid": os.getpid()}


def fit_twice(first_dir, second_dir):
    """Two fits, each with its own log; the time between them."""
    first = fit(first_dir)
    between = time.time()
    return {"first": first, "between": between, "second": fit(second_dir),
            "pid": os.getpid()}
