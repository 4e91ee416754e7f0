"""keras-mgpu's callbacks with Keras's own `gradient_accumulation_steps`
on the active backend: every callback together, the run's counters, the
records and an exact resume. (Keras's own accumulation runs on one device
on TensorFlow, where it fails under `MirroredStrategy`:
keras-team/keras#20582; on JAX under `DataParallel` over 2 devices.)"""

import json
import os

import keras
import numpy as np
import pytest

from keras_mgpu.callbacks import BackupAndRestore, DistributedLogger
from keras_mgpu.mixed_precision import LossScaleMonitor
from keras_mgpu.runtime import training_runtime
from tests.logger_checks import metrics_only

FEATURES = 6
ACCUM = 4


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1))).astype("float32")
    return x, y


def run(scope, tmp_path, callbacks, epochs=2):
    x, y = data()
    with scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((FEATURES,)),
                                  keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(
            0.01, gradient_accumulation_steps=ACCUM), "mse")
        model.fit(x, y, batch_size=8, epochs=epochs, verbose=0,
                  shuffle=False, callbacks=callbacks)
    return model


@pytest.fixture
def scope(two_replicas):
    if keras.backend.backend() == "jax":
        return two_replicas
    # One device: Keras's accumulation fails under MirroredStrategy.
    import contextlib
    return contextlib.nullcontext


def test_every_callback_counts_keras_accumulation_updates(scope, tmp_path):
    """12 batches an epoch, an update every 4: 3 updates an epoch, none
    counted as skipped; the weights are those of the run without the
    callbacks."""
    log_dir = str(tmp_path / "logs")
    monitor = LossScaleMonitor()
    model = run(scope, tmp_path, [
        DistributedLogger(log_dir, update_freq=4, console=False),
        BackupAndRestore(str(tmp_path / "backup"), save_freq=5),
        monitor])
    plain = run(scope, tmp_path, [])
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 6
    counters = training_runtime(model).counters()
    assert (counters.global_step, counters.updates_applied,
            counters.updates_skipped) == (24, 6, 0)
    assert monitor.skipped_steps_total == 0
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        records = metrics_only(map(json.loads, f))
    assert [(r["kind"], r["step"]) for r in records] == [
        ("window", 4), ("window", 8), ("window", 12), ("epoch", 12),
        ("window", 16), ("window", 20), ("window", 24), ("epoch", 24)]


class _StopAt(keras.callbacks.Callback):
    """Raises after the given global batch (a crash mid-window)."""

    def __init__(self, step):
        super().__init__()
        self.step, self.seen = step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            raise RuntimeError("crash")


def test_a_crash_mid_window_resumes_exactly(scope, tmp_path):
    """Saved every 3 batches (mid-window: Keras's accumulators are optimizer
    variables), crashed after batch 14, rerun: the uninterrupted weights
    and iterations."""
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="crash"):
        run(scope, tmp_path, [BackupAndRestore(backup, save_freq=3),
                              _StopAt(14)])
    resumed = run(scope, tmp_path, [BackupAndRestore(backup, save_freq=3)])
    plain = run(scope, tmp_path, [])
    assert int(keras.ops.convert_to_numpy(resumed.optimizer.iterations)) == 6
    for a, b in zip(resumed.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
