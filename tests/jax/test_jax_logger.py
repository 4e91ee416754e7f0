"""DistributedLogger on Keras's JAX backend (`DataParallel` over 2 host
devices): the TensorBoard layout, JSONL schema and console line it writes
on TensorFlow, the run's counters for a plain and an accumulating model,
and input wait timed on the host."""

import json
import os

import keras
import numpy as np
import pytest

from keras_mgpu import GradientAccumulationModel
from keras_mgpu.callbacks import DistributedLogger
from keras_mgpu.mixed_precision import LossScaleMonitor
from keras_mgpu.runtime import RuntimeCallback, training_runtime
from tests.logger_checks import (check_reference_records, metrics_only,
                                 check_tensorboard_layout, read_scalars)

FEATURES = 6


def regression_data(num_samples, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(num_samples, FEATURES).astype("float32")
    w = rng.randn(FEATURES, 1).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.randn(num_samples, 1)).astype("float32")
    return x, y


def mlp():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((FEATURES,)),
                             keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(1)])


def read_jsonl(log_dir):
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return metrics_only(map(json.loads, f))


class EpochCounters(RuntimeCallback):
    """The runtime's counters at each epoch end (read mid-fit: the JAX
    train state is synced for the read)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        counters = self.runtime.counters()
        self.seen.append((counters.global_step, counters.samples_seen,
                          counters.updates_applied))


class BatchLogs(keras.callbacks.Callback):
    """The logs Keras gives every batch end (forces a sync: tests only)."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append({k: float(v) for k, v in logs.items()})


def test_records_events_and_history_agree(data_parallel, tmp_path, capsys):
    log_dir = str(tmp_path / "run")
    # 100 samples in batches of 16: six full batches and a short one of 4.
    x, y = regression_data(100)
    model = mlp()
    model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    batch_logs = BatchLogs()
    history = model.fit(
        x, y, batch_size=16, epochs=2, verbose=0, shuffle=False,
        validation_data=(x[:32], y[:32]),
        callbacks=[DistributedLogger(log_dir, update_freq=3), batch_logs])
    records = read_jsonl(log_dir)

    windows, epochs = check_reference_records(records)
    for r in records:
        assert r["input_wait"] is not None and r["input_wait"] >= 0
        assert r["input_bound"] in ("no", "moderately", "highly")
    # Window metrics are the values Keras logs at that batch; epoch metrics
    # are History's (validation included).
    for window in windows:
        logs = batch_logs.logs[window["step"] - 1]
        for key in ("loss", "mae"):
            assert window["metrics"][key] == pytest.approx(logs[key],
                                                           rel=1e-6)
    for key in ("loss", "mae", "val_loss", "val_mae"):
        np.testing.assert_allclose([r["metrics"][key] for r in epochs],
                                   history.history[key], rtol=1e-6)

    # TensorBoard, read back from the event files: Keras TensorBoard's
    # layout, the telemetry in its groups, as on TensorFlow.
    scalars = check_tensorboard_layout(log_dir, history, windows, epochs)
    assert scalars["input/epoch_wait"] == [
        (r["epoch"], pytest.approx(r["input_wait"])) for r in epochs]

    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("DistributedLogger")]
    assert len(lines) == 2
    assert "examples/s" in lines[0] and "input wait" in lines[0]


@pytest.mark.parametrize("kind", ["plain", "window", "in_step"])
def test_counters_of_a_plain_and_an_accumulating_model(data_parallel,
                                                       tmp_path, kind):
    # plain: 100 samples in batches of 16 (7 batches, the last of 4), one
    # update each; window: 128 in batches of 16, an update every 2; in-step:
    # 128 in batches of 32, each a window of 4 micro-batches (4 rows per
    # device), one update each.
    samples, batch, steps, updates = {
        "plain": (100, 16, 7, 7), "window": (128, 16, 8, 4),
        "in_step": (128, 32, 4, 4)}[kind]
    x, y = regression_data(samples)
    model = mlp()
    if kind != "plain":
        model = GradientAccumulationModel(
            model, accum_steps=2 if kind == "window" else 4, mode=kind)
    model.compile(keras.optimizers.SGD(0.05), "mse")
    log_dir = str(tmp_path / kind)
    counters = EpochCounters()
    model.fit(x, y, batch_size=batch, epochs=2, verbose=0, shuffle=False,
              callbacks=[DistributedLogger(log_dir, update_freq=2,
                                           console=False), counters])

    assert counters.seen == [
        (steps, float(samples), updates),
        (2 * steps, 2.0 * samples, 2 * updates)]
    final = training_runtime(model).counters()
    assert (final.global_step, final.samples_seen, final.updates_applied,
            final.updates_skipped) == (2 * steps, 2.0 * samples,
                                       2 * updates, 0)
    assert int(model.optimizer.iterations.numpy()) == 2 * updates

    records = read_jsonl(log_dir)
    windows = [r for r in records if r["kind"] == "window"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [r["step"] for r in epochs] == [steps, 2 * steps]
    assert [r["steps"] for r in epochs] == [steps, steps]
    assert [r["examples"] for r in epochs] == [samples, samples]
    assert windows[-1]["step"] == 2 * steps
    assert sum(r["examples"] for r in windows) == 2 * samples
    if kind == "plain":
        assert all(r["accum_step"] is None and r["grad_norm"] is None
                   for r in records)
    else:
        # Windows of 2 batches end where a window of the model closes.
        assert {r["accum_step"] for r in windows} == {0}
        assert all(r["grad_norm"] > 0 for r in epochs)
        scalars = read_scalars(log_dir)
        assert scalars["accumulation/epoch_grad_norm"] == [
            (r["epoch"], pytest.approx(r["grad_norm"])) for r in epochs]
    # The seconds the host spent fetching batches, over the run.
    assert final.input_wait_seconds > 0
    assert sum(r["input_wait"] * r["seconds"] for r in epochs) > 0


def test_a_last_call_of_several_steps_counts_the_batches_it_held(
        data_parallel, tmp_path):
    # 7 batches in calls of 3: the epoch's last call holds 1.
    x, y = regression_data(100)
    model = mlp()
    model.compile("sgd", "mse", steps_per_execution=3)
    counters = EpochCounters()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False,
              callbacks=[DistributedLogger(str(tmp_path), update_freq=3,
                                           console=False), counters])
    assert counters.seen == [(7, 100.0, 7), (14, 200.0, 14)]
    records = read_jsonl(str(tmp_path))
    assert [(r["kind"], r["step"], r["steps"]) for r in records] == [
        ("window", 3, 3), ("window", 6, 3), ("window", 7, 1), ("epoch", 7, 7),
        ("window", 10, 3), ("window", 13, 3), ("window", 14, 1),
        ("epoch", 14, 7)]


@pytest.mark.filterwarnings("ignore:LossScaleMonitor")
def test_skipped_steps_agree_with_the_loss_scale_monitor(data_parallel,
                                                         tmp_path):
    x, y = regression_data(64)
    model = mlp()
    # A loss near 100 scaled by 2**127: the first steps overflow.
    model.compile(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2.0 ** 127), "mse")
    monitor = LossScaleMonitor()
    model.fit(x, 10 * y, batch_size=8, epochs=2, verbose=0, shuffle=False,
              callbacks=[monitor, DistributedLogger(
                  str(tmp_path), update_freq=3, console=False)])
    records = read_jsonl(str(tmp_path))
    windows = [r for r in records if r["kind"] == "window"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert 0 < monitor.skipped_steps_total < 16
    assert sum(r["skipped_steps"] for r in windows) == \
        sum(r["skipped_steps"] for r in epochs) == monitor.skipped_steps_total
    assert epochs[-1]["loss_scale"] == monitor.loss_scale
    assert int(model.optimizer.iterations.numpy()) == (
        16 - monitor.skipped_steps_total)


class SyncedAtBatchBegin(keras.callbacks.Callback):
    """Whether the model's variables held the train state at each batch
    begin (read without `Callback.model`, which would sync it)."""

    def __init__(self):
        super().__init__()
        self.synced = []

    def on_train_batch_begin(self, batch, logs=None):
        self.synced.append(self.__dict__["_model"]._jax_state_synced)


def test_batches_between_records_leave_the_train_state_on_the_devices(
        data_parallel, tmp_path):
    # Keras's JAX fit keeps the train state out of the model's variables
    # during an epoch; the logger syncs it only to read a record (the
    # batch begins that close a window), not at every batch.
    x, y = regression_data(100)
    model = mlp()
    model.compile("sgd", "mse")
    synced = SyncedAtBatchBegin()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False,
              callbacks=[DistributedLogger(str(tmp_path), update_freq=3,
                                           console=False), synced])
    # Batch 0: the epoch's start; 3 and 6: a window closed there.
    assert synced.synced == [True, False, False, True, False, False, True]


def test_input_wait_is_timed_when_run_eagerly(data_parallel, tmp_path):
    # JAX's fit fetches on the host either way: each fetch is timed.
    x, y = regression_data(64)
    model = mlp()
    model.compile("sgd", "mse", run_eagerly=True)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0,
              callbacks=[DistributedLogger(str(tmp_path), update_freq=2,
                                           console=False)])
    records = read_jsonl(str(tmp_path))
    assert [(r["kind"], r["step"]) for r in records] == [
        ("window", 2), ("window", 4), ("epoch", 4)]
    assert all(r["input_wait"] is not None and 0 <= r["input_wait"] < 1
               for r in records)
    assert training_runtime(model).counters().input_wait_seconds > 0
