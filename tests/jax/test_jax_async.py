"""Keras's asynchronous batch-end dispatch on JAX with keras-mgpu's
callbacks: `DistributedLogger` keeps it (its records unchanged), the
callbacks that need their batch ends in order turn it off."""

import json
import os
import threading

import keras
import pytest

from keras_mgpu.callbacks import BackupAndRestore, DistributedLogger
from keras_mgpu.mixed_precision import LossScaleMonitor
from tests.jax.test_jax_logger import mlp, regression_data
from tests.logger_checks import check_reference_records


class ThreadProbe(keras.callbacks.Callback):
    """Records which thread runs each batch end (async-safe itself)."""

    async_safe = True

    def __init__(self):
        super().__init__()
        self.threads = set()

    def on_train_batch_end(self, batch, logs=None):
        self.threads.add(threading.get_ident())


def fit(callbacks):
    # The reference records' run: 100 samples in batches of 16, 2 epochs.
    x, y = regression_data(100)
    model = mlp()
    model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False,
              callbacks=callbacks)


def test_the_logger_keeps_asynchronous_dispatch(data_parallel, tmp_path):
    probe = ThreadProbe()
    logger = DistributedLogger(str(tmp_path), update_freq=3, console=False)
    fit([logger, probe])
    # Keras ran batch ends on its executor's threads, not the training one.
    assert probe.threads and threading.get_ident() not in probe.threads
    with open(os.path.join(str(tmp_path), "metrics.jsonl")) as f:
        check_reference_records([json.loads(line) for line in f])
    # Outside `fit` (a hand-written loop's CallbackList) it is not.
    assert not logger.async_safe


@pytest.mark.parametrize("callback", ["backup", "loss_scale_monitor"])
def test_callbacks_that_need_ordered_batch_ends_turn_it_off(
        data_parallel, tmp_path, callback):
    probe = ThreadProbe()
    other = (BackupAndRestore(str(tmp_path / "backup"), save_freq=4)
             if callback == "backup" else LossScaleMonitor())
    fit([DistributedLogger(str(tmp_path / "logs"), update_freq=3,
                           console=False), other, probe])
    assert probe.threads == {threading.get_ident()}
