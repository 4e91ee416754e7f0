"""DistributedLogger: records, sinks, chief-only output, profiling, errors."""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mgpu import GradientAccumulationModel, data
from keras_mgpu.callbacks import input_wait_summary
from keras_mgpu.callbacks.distributed_logger import DistributedLogger
from keras_mgpu.mixed_precision import LossScaleMonitor
from keras_mgpu.runtime import training_runtime
from tests import logger_workers, workers
from tests.logger_checks import (check_reference_records, metrics_only,
                                 check_tensorboard_layout, read_scalars)
from tests.conftest import mirrored
from tests.test_sinks import TORN, open_handles, torn_log_dir, writer_threads


def read_lines(log_dir):
    """The JSONL file's lines, local or at a URL."""
    path = tf.io.gfile.join(log_dir, "metrics.jsonl")
    with tf.io.gfile.GFile(path) as f:
        return f.read().splitlines()


def read_jsonl(log_dir):
    return metrics_only(json.loads(line) for line in read_lines(log_dir))


class BatchLogs(keras.callbacks.Callback):
    """Records the logs Keras gives every batch end (forces a sync: tests only)."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append(dict(logs))


def small_fit(strategy, log_dir, epochs=2, callbacks=(), validation=True,
              **logger_kwargs):
    # 100 samples in batches of 16: six full batches and a short one of 4.
    x, y = workers.regression_data(100)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    with strategy.scope():
        model = workers.build_mlp()
        model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    logger = DistributedLogger(log_dir, **logger_kwargs)
    batch_logs = BatchLogs()
    history = model.fit(
        dataset, epochs=epochs, verbose=0, shuffle=False,
        validation_data=dataset.take(2) if validation else None,
        callbacks=[logger, batch_logs, *callbacks])
    return history, batch_logs.logs, logger


def test_records_events_and_history_agree(tmp_path, capsys):
    log_dir = str(tmp_path / "run")
    history, batch_logs, _ = small_fit(mirrored(2), log_dir, update_freq=3)
    records = read_jsonl(log_dir)

    windows, epochs = check_reference_records(records)
    for r in records:
        assert r["step_time_mean"] == pytest.approx(r["seconds"] / r["steps"])
        assert 0 < r["step_time_max"] <= r["seconds"]
        assert r["worker_step_time"]["max"] == pytest.approx(
            r["step_time_mean"])
    # The windows lie inside the epoch, whose wall time also holds the
    # logger's own writes between windows (how much is load, not a test).
    assert 0 < sum(r["seconds"] for r in windows[:3]) <= epochs[0]["seconds"]

    # Window metrics are the values Keras logs at that batch; epoch metrics
    # are History's (validation included).
    for window in windows:
        logs = batch_logs[window["step"] - 1]
        assert window["metrics"]["loss"] == pytest.approx(logs["loss"],
                                                          rel=1e-6)
        assert window["metrics"]["mae"] == pytest.approx(logs["mae"],
                                                         rel=1e-6)
    for key in ("loss", "mae", "val_loss", "val_mae"):
        np.testing.assert_allclose([r["metrics"][key] for r in epochs],
                                   history.history[key], rtol=1e-6)

    scalars = check_tensorboard_layout(log_dir, history, windows, epochs)
    assert scalars["epoch_learning_rate"] == [
        (i, pytest.approx(0.01)) for i in range(2)]
    assert scalars["throughput/batch_examples_per_sec"] == [
        (r["step"], pytest.approx(r["examples_per_sec"], rel=1e-6))
        for r in windows]
    assert scalars["epoch_steps_per_second"] == [
        (i, pytest.approx(r["steps"] / r["seconds"], rel=1e-6))
        for i, r in enumerate(epochs)]

    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("DistributedLogger")]
    assert len(lines) == 2 and "examples/s" in lines[0]


def test_epoch_records_only_and_explicit_batch_size(tmp_path):
    log_dir = str(tmp_path / "run")
    small_fit(mirrored(1), log_dir, epochs=1, validation=False,
              update_freq="epoch", batch_size=16, console=False)
    [record] = read_jsonl(log_dir)
    # batch_size * steps: the short last batch is counted whole.
    assert (record["kind"], record["steps"], record["examples"]) == (
        "epoch", 7, 112.0)
    assert record["replicas"] == 1


def overflowing_run(model, log_dir, epochs=2):
    """Float32 model, LossScaleOptimizer started at a scale that overflows."""
    x, y = workers.regression_data(64)
    y = 10 * y  # a loss near 100: scaled by 2**127, the gradients overflow
    model.compile(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(
            0.1, decay_steps=1, decay_rate=0.5)),
        initial_scale=2.0 ** 127), "mse")
    monitor = LossScaleMonitor()
    model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, shuffle=False,
              callbacks=[monitor, DistributedLogger(log_dir, update_freq=3,
                                                    console=False)])
    return monitor, read_jsonl(log_dir)


@pytest.mark.filterwarnings("ignore:LossScaleMonitor")
@pytest.mark.parametrize("accumulate", [False, True])
def test_loss_scale_skipped_steps_and_schedule(tmp_path, accumulate):
    model = workers.build_mlp()
    if accumulate:
        model = GradientAccumulationModel(model, accum_steps=2)
    monitor, records = overflowing_run(model, str(tmp_path / "run"))
    windows = [r for r in records if r["kind"] == "window"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    epoch = epochs[-1]
    # Agrees with LossScaleMonitor, which checks every batch.
    assert 0 < monitor.skipped_steps_total < len(records) * 8
    assert sum(r["skipped_steps"] for r in windows) == \
        sum(r["skipped_steps"] for r in epochs) == monitor.skipped_steps_total
    assert epoch["skipped_steps"] == monitor.skipped_steps
    assert epoch["loss_scale"] == monitor.loss_scale
    # Skipped steps still count as work.
    assert epoch["examples"] == 64.0
    iterations = int(model.optimizer.iterations.numpy())
    assert epoch["learning_rate"] == pytest.approx(0.1 * 0.5 ** iterations)
    if accumulate:
        assert [r["accum_step"] for r in windows] == [1, 0, 0] * 2
        assert epoch["grad_norm"] > 0
    else:
        assert epoch["grad_norm"] is None and epoch["accum_step"] is None
    # TensorBoard: the groups that apply, nothing else.
    scalars = read_scalars(str(tmp_path / "run"))
    assert scalars["mixed_precision/epoch_loss_scale"] == [
        (r["epoch"], r["loss_scale"]) for r in epochs]
    assert scalars["mixed_precision/batch_skipped_steps"] == [
        (r["step"], r["skipped_steps"]) for r in windows]
    assert {tag.split("/")[0] for tag in scalars if "/" in tag} == (
        {"throughput", "input", "mixed_precision", "goodput"}
        | ({"accumulation"} if accumulate else set()))
    if accumulate:
        assert scalars["accumulation/epoch_grad_norm"] == [
            (r["epoch"], pytest.approx(r["grad_norm"])) for r in epochs]


def test_profile_steps_write_a_trace_with_step_markers(tmp_path):
    from xprof.convert import raw_to_tool_data

    log_dir = str(tmp_path / "run")
    small_fit(mirrored(1), log_dir, epochs=1, validation=False,
              update_freq=4, profile_steps=(2, 5), console=False)
    traces = glob.glob(os.path.join(log_dir, "train", "plugins", "profile",
                                    "*", "*.xplane.pb"))
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 0
    # xprof's overview finds the steps: a step time, not "No step marker
    # observed" and 0.0 ms.
    overview, _ = raw_to_tool_data.xspace_to_tool_data(
        traces, "overview_page", {})
    overview = overview if isinstance(overview, str) else overview.decode()
    assert "No step marker" not in overview
    [average] = re.findall(r'"steptime_ms_average":"([0-9.]+)"', overview)
    assert float(average) > 0


class SummaryLayer(keras.layers.Layer):
    """Writes the mean of its input with `tf.summary`: the model's own
    summaries."""

    def call(self, x):
        tf.summary.scalar("input_mean", tf.reduce_mean(x))
        return x


@pytest.mark.parametrize("update_freq, jit_compile, run_eagerly", [
    (3, False, False), ("epoch", False, False), (3, True, False),
    (3, False, True)], ids=["windows", "epoch", "xla", "eager"])
def test_the_models_own_summaries_are_recorded(tmp_path, update_freq,
                                               jit_compile, run_eagerly):
    log_dir = str(tmp_path / "run")
    x, y = workers.regression_data(100)
    # XLA with MirroredStrategy is not supported on CPUs: XLA on one device.
    with (mirrored(1) if jit_compile else mirrored(2)).scope():
        model = keras.Sequential([keras.Input((8,)), SummaryLayer(),
                                  keras.layers.Dense(1)])
        model.compile("sgd", "mse", jit_compile=jit_compile,
                      run_eagerly=run_eagerly)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False,
              validation_data=(x[:48], y[:48]),
              callbacks=[DistributedLogger(log_dir, update_freq=update_freq,
                                           console=False)])
    train = read_scalars(log_dir)
    validation = read_scalars(log_dir, "validation")
    # Keras names the tag after the model and the layer, numbered per process.
    tags = {t for t in (*train, *validation) if t.endswith("/input_mean")}
    if update_freq == "epoch" or jit_compile:
        # As Keras's TensorBoard: no default writer without batch records;
        # XLA cannot compile summary ops (the step would fail).
        assert not tags and ("batch_loss" in train) == jit_compile
    else:
        [tag] = tags
        # Once per window (replica 0 only), at the window record's step,
        # from the train step only.
        assert [s for s, _ in train[tag]] == [
            s for s, _ in train["batch_loss"]] == [3, 6, 7, 10, 13, 14]
        assert tag not in validation
        # The third batch, replica 0's half (8 of 16 samples, unshuffled).
        assert train[tag][0][1] == pytest.approx(
            float(np.mean(x[32:40])), rel=1e-5)
    # After fit, no writer is left as the default.
    assert tf.summary.experimental.get_step() is None
    with tf.summary.record_if(True):
        assert not tf.summary.scalar("after_fit", 1.0)


def test_wandb_offline_run_lives_under_log_dir(tmp_path, monkeypatch):
    import wandb  # noqa: F401  (the test extra installs it: never skipped)

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log_dir = str(tmp_path / "run")
    small_fit(mirrored(1), log_dir, epochs=1, validation=False,
              update_freq=4, console=False,
              wandb={"project": "keras-mgpu-test"})
    runs = glob.glob(os.path.join(log_dir, "wandb", "offline-run-*"))
    assert len(runs) == 1
    assert glob.glob(os.path.join(runs[0], "*.wandb"))


def test_chief_only_output_with_two_workers(run_workers, tmp_path):
    results = run_workers(logger_workers.chief_only_logging,
                          kwargs={"base_dir": str(tmp_path)})
    chief, other = (r.result for r in results)
    assert (chief["is_chief"], other["is_chief"]) == (True, False)
    assert chief["exists"] and not other["exists"]
    assert not os.path.exists(other["log_dir"])
    assert glob.glob(os.path.join(chief["log_dir"], "train",
                                  "events.out.tfevents.*"))
    records = read_jsonl(chief["log_dir"])
    # 128 samples / 32: four steps per epoch, windows of 2, two epochs.
    assert [r["kind"] for r in records] == ["window", "window", "epoch"] * 2
    for r in records:
        assert (r["workers"], r["replicas"]) == (2, 2)
        assert r["slowest_worker"] in (0, 1)
        spread = r["worker_step_time"]
        assert spread["min"] <= spread["mean"] <= spread["max"]
        assert r["worker_examples_per_sec"]["max"] > 0
        waits = r["worker_input_wait"]
        assert 0 <= waits["min"] <= waits["mean"] <= waits["max"] < 1
        assert r["input_wait"] == pytest.approx(waits["mean"])
        assert r["input_bound"] in ("no", "moderately", "highly")
    assert [r["examples"] for r in records if r["kind"] == "epoch"] == [
        128.0, 128.0]
    np.testing.assert_allclose(
        [r["metrics"]["loss"] for r in records if r["kind"] == "epoch"],
        chief["loss"], rtol=1e-6)
    # With two workers, the spread across them is a TensorBoard group.
    scalars = read_scalars(chief["log_dir"])
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert scalars["distribution/epoch_step_time_max"] == [
        (r["epoch"], pytest.approx(r["worker_step_time"]["max"]))
        for r in epochs]
    assert scalars["distribution/batch_slowest_worker"] == [
        (r["step"], r["slowest_worker"]) for r in records
        if r["kind"] == "window"]
    assert sorted(t for t in scalars if t.startswith("distribution/epoch")) == \
        sorted(f"distribution/epoch_{name}" for name in [
            *(f"{figure}_{stat}" for figure in
              ("step_time", "examples_per_sec", "input_wait")
              for stat in ("min", "mean", "max")), "slowest_worker"])


@pytest.mark.parametrize("kwargs, message", [
    ({"update_freq": 0}, "update_freq must be a positive integer"),
    ({"update_freq": "batch"}, "got 'batch'"),
    ({"update_freq": True}, "got True"),
    ({"profile_steps": (5, 2)}, "got (5, 2)"),
    ({"profile_steps": 10}, "got 10"),
    ({"profile_steps": (0, 2)}, "1 <= start <= stop"),
    ({"batch_size": -8}, "batch_size must be a positive integer"),
])
def test_bad_arguments_are_named(tmp_path, kwargs, message):
    with pytest.raises(ValueError) as info:
        DistributedLogger(str(tmp_path), **kwargs)
    assert message in str(info.value)


def test_bad_wandb_argument_and_missing_wandb(tmp_path, monkeypatch):
    with pytest.raises(TypeError, match="wandb must be None, a bool or a "
                                        "dict.*got 'demo'"):
        DistributedLogger(str(tmp_path), wandb="demo")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb"
                        else real(name, *a))
    with pytest.raises(ImportError, match=r'pip install "keras-mgpu\[wandb\]"'):
        DistributedLogger(str(tmp_path), wandb={"project": "demo"})
    # Not asked for: no wandb needed.
    DistributedLogger(str(tmp_path), wandb=False)
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_import_does_not_load_wandb():
    code = ("import sys; import keras_mgpu.callbacks.distributed_logger; "
            "print('LOADED', 'wandb' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED False" in proc.stdout


# --- Input wait ---------------------------------------------------------------

# A decode delay that dominates everything else in a step by far: sleeping
# takes at least this long on any machine, and the fed pipeline's fetch from
# memory is a small fraction of it even on a loaded one.
SLEEP_PER_EXAMPLE = 0.01
EXAMPLES = 128


def _sleepy(image, label):
    # A decode that takes SLEEP_PER_EXAMPLE of host time per example.
    image = tf.numpy_function(
        lambda a: (time.sleep(SLEEP_PER_EXAMPLE), a)[1], [image], tf.float32,
        stateful=False)
    return tf.ensure_shape(image, (8,)), label


def pipeline_fit(strategy, tmp_path, name, **pipeline):
    """Two epochs over EXAMPLES TFRecord examples; returns the epoch records."""
    records = tmp_path / "records"
    if not records.exists():
        x, y = workers.regression_data(EXAMPLES)
        data.write_tfrecords((x, y), str(records), num_shards=4)
    dataset = data.tfrecord_dataset(
        str(records / "*.tfrecord"), per_replica_batch_size=16,
        strategy=strategy, map_fn=_sleepy, **pipeline)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)),
                                  keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    log_dir = str(tmp_path / name)
    model.fit(dataset, epochs=2, verbose=0, callbacks=[
        DistributedLogger(log_dir, update_freq="epoch", console=False)])
    # The logger's stand-in is gone once fit returns.
    assert not hasattr(model.train_function, "keras_train_function")
    return read_jsonl(log_dir), read_scalars(log_dir)


@pytest.mark.parametrize("replicas", [1, 2])
def test_input_wait_tells_a_starved_pipeline_from_a_fed_one(
        tmp_path, replicas):
    strategy = mirrored(replicas)
    starved, events = pipeline_fit(strategy, tmp_path, "starved",
                                   num_parallel_calls=1)
    fed, _ = pipeline_fit(strategy, tmp_path, "fed", cache=True)
    starved, fed = starved[-1], fed[-1]  # second epoch: the cache is full

    # Decoding one example at a time sleeps at least EXAMPLES * 10 ms per
    # epoch, and a step's compute (a few ms) hides little of it: most of it
    # is waited, on any machine. Seconds waited, not shares of wall time:
    # load stretches compute and waits alike.
    decode_seconds = EXAMPLES * SLEEP_PER_EXAMPLE
    waited = starved["input_wait"] * starved["seconds"]
    assert waited > 0.7 * decode_seconds
    # The label is a share of wall time, which load changes: only that it is
    # the one the logged share gives (the thresholds have their own test).
    label = "not" if starved["input_bound"] == "no" else starved["input_bound"]
    assert input_wait_summary(starved["input_wait"]).endswith(
        f"({label} input-bound)")
    # Cached in memory: the wait is the fetch itself, no decode.
    assert fed["input_wait"] * fed["seconds"] < decode_seconds / 4
    assert events["input/epoch_wait"][-1] == (
        1, pytest.approx(starved["input_wait"]))
    assert starved["worker_input_wait"]["max"] == pytest.approx(
        starved["input_wait"])


class StandIn(keras.callbacks.Callback):
    """Runs the first two batches through its own train function and then
    puts Keras's back, as BackupAndRestore does to skip batches."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            self.saved = self.model.train_function
            self.model.train_function = self.skip
        elif batch == 2:
            self.model.train_function = self.saved

    def skip(self, iterator):
        next(iterator)
        return self.model.get_metrics_result()


def test_input_wait_survives_a_swapped_train_function(tmp_path):
    log_dir = str(tmp_path / "run")
    x, y = workers.regression_data(128)
    model = workers.build_mlp()
    model.compile("sgd", "mse")
    logger = DistributedLogger(log_dir, update_freq=2, console=False)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False,
              callbacks=[StandIn(), logger])
    waits = [r["input_wait"] for r in read_jsonl(log_dir)
             if r["kind"] == "window"]
    # Batches the stand-in ran cannot be timed; the others are, with one
    # timed function reused across the swaps (no retrace per swap).
    assert waits[0] is None and waits[4] is None
    assert all(w is not None and 0 <= w < 1 for w in waits[1:4] + waits[5:])
    timed = [f for _, f in training_runtime(model)._twins.values()
             if f is not None]
    assert len(timed) == 1


def test_input_wait_is_null_when_run_eagerly(tmp_path, capsys):
    log_dir = str(tmp_path / "run")
    x, y = workers.regression_data(64)
    model = workers.build_mlp()
    model.compile("sgd", "mse", run_eagerly=True)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0,
              callbacks=[DistributedLogger(log_dir, update_freq=2)])
    records = read_jsonl(log_dir)
    assert all(r["input_wait"] is None and r["input_bound"] is None
               for r in records)
    assert "input wait n/a" in capsys.readouterr().out


def test_timed_train_function_recognises_only_keras_train_function():
    from keras_mgpu import compat

    waited = tf.Variable(0.0, dtype=tf.float64)
    model = workers.build_mlp()
    model.compile("sgd", "mse")
    model.make_train_function()
    # Recognised by its structure (the closure over Keras's compiled step),
    # not by a version range.
    timed = compat.timed_train_function(model.train_function, waited)
    assert timed is not None
    assert timed.keras_train_function is model.train_function
    assert compat.timed_train_function(lambda iterator: None, waited) is None
    assert compat.timed_train_function(timed, waited) is None


_FULL_DISK = r"""
import resource, signal, sys
import numpy as np, keras
from keras_mgpu.callbacks import DistributedLogger

model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
# A disk that is full after 4 KiB: writes past it fail with EFBIG instead
# of killing the process.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
model.fit(np.ones((256, 2)), np.ones((256, 1)), batch_size=8, epochs=2,
          verbose=0, callbacks=[DistributedLogger(sys.argv[1], update_freq=1,
                                                  console=False)])
"""


def test_a_failed_write_names_its_cause(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="-1")
    proc = subprocess.run([sys.executable, "-c", _FULL_DISK,
                           str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    message = [line for line in proc.stderr.splitlines()
               if "DistributedLogger could not write its records" in line]
    assert message, proc.stderr[-3000:]
    assert "File too large" in message[-1], message[-1]


# --- Durability ---------------------------------------------------------------

@pytest.mark.parametrize("where", ["local", "url"])
def test_local_or_url_log_dir_appends_after_a_torn_line(tmp_path, monkeypatch,
                                                        where):
    monkeypatch.chdir(tmp_path)
    log_dir = torn_log_dir(tmp_path, where)
    _, batch_logs, _ = small_fit(mirrored(1), log_dir, epochs=1,
                                 validation=False, update_freq=4,
                                 console=False, profile_steps=(2, 3))

    lines = read_lines(log_dir)
    # The torn line is closed off: only it is unreadable.
    assert lines[:2] == TORN.splitlines()
    records = [json.loads(line) for line in lines[2:]]
    # The time ledger as training begins; 7 batches: windows of 4 and 3,
    # then the epoch record.
    assert [(r["kind"], r["step"]) for r in records] == [
        ("goodput", 0), ("window", 4), ("window", 7), ("epoch", 7)]
    scalars = read_scalars(log_dir)
    assert scalars["batch_loss"] == [
        (s, pytest.approx(batch_logs[s - 1]["loss"], rel=1e-6))
        for s in (4, 7)]
    assert scalars["epoch_loss"] == [
        (0, pytest.approx(records[-1]["metrics"]["loss"]))]
    traces = tf.io.gfile.glob(tf.io.gfile.join(
        log_dir, "train", "plugins", "profile", "*", "*.xplane.pb"))
    assert len(traces) == 1
    # A URL is written through tf.io.gfile: no local `ram:` folder.
    assert os.listdir(tmp_path) == ([] if where == "url" else ["run"])


class RaiseAt(keras.callbacks.Callback):
    """Raises at the end of train batch `batch` of `epoch`: a crashed fit."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise ValueError(f"crashed at epoch {self.epoch} batch {batch}")


def test_a_crashed_fit_flushes_stops_the_writer_and_can_fit_again(tmp_path):
    log_dir = str(tmp_path / "run")
    x, y = workers.regression_data(128)
    model = workers.build_mlp()
    model.compile("sgd", "mse")
    logger = DistributedLogger(log_dir, update_freq=2, console=False)
    batch_logs = BatchLogs()
    # 8 batches per epoch; the 7th of epoch 1 raises after training: 15
    # batches trained, the window of steps 15-16 never closes.
    with pytest.raises(ValueError, match="crashed at epoch 1 batch 6"):
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False,
                  callbacks=[logger, batch_logs, RaiseAt(1, 6)])
    # Keras skipped on_train_end: the writer stops by itself (the timeout
    # only bounds a failure), having written and flushed everything.
    for thread in writer_threads():
        thread.join(timeout=60)
    assert not writer_threads()
    crashed = [("window", s) for s in (2, 4, 6, 8)] + [("epoch", 8)] + [
        ("window", s) for s in (10, 12, 14)]
    assert [(r["kind"], r["step"]) for r in read_jsonl(log_dir)] == crashed
    scalars = read_scalars(log_dir)
    windows = [2, 4, 6, 8, 10, 12, 14]
    assert scalars["batch_loss"] == [
        (s, pytest.approx(batch_logs.logs[s - 1]["loss"], rel=1e-6))
        for s in windows]
    assert [s for s, _ in scalars["epoch_loss"]] == [0]

    # Fitting again continues the same files at the run's global step.
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False,
              callbacks=[logger, batch_logs])
    again = [("window", s) for s in (17, 19, 21, 23)] + [("epoch", 23)]
    assert [(r["kind"], r["step"]) for r in read_jsonl(log_dir)] == (
        crashed + again)
    scalars = read_scalars(log_dir)
    assert scalars["batch_loss"] == [
        (s, pytest.approx(batch_logs.logs[s - 1]["loss"], rel=1e-6))
        for s in windows + [17, 19, 21, 23]]
    assert [s for s, _ in scalars["epoch_loss"]] == [0, 0]
    # The outputs stay open for the next fit; the writer thread, idle, ends.
    assert open_handles(os.path.join(log_dir, "metrics.jsonl")) == 1
    for thread in writer_threads():
        thread.join(timeout=60)
    assert not writer_threads()


def test_a_sigkilled_run_loses_at_most_the_record_in_flight(run_workers,
                                                             tmp_path):
    log_dir = str(tmp_path / "logs")
    # The child logs every batch and announces each record once written;
    # it is killed mid-run, on its announcement of step 40.
    [result] = run_workers(logger_workers.announced_writes, num_workers=1,
                           kwargs={"log_dir": log_dir, "epochs": 100},
                           kill_when_printed="WROTE window 40;")
    assert result.killed and result.returncode == -signal.SIGKILL, (
        result.returncode, result.stderr[-3000:])
    announced = [(kind, int(step)) for kind, step in
                 re.findall(r"WROTE (\w+) (\d+);", result.stdout)]
    assert ("window", 40) in announced, result.stderr[-3000:]

    lines = read_lines(log_dir)
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            # Only the record being written when the kill came.
            assert i == len(lines) - 1, (i, len(lines), line)
    written = [(r["kind"], r["step"]) for r in records]
    # The time ledger as training begins, then 8 batches per epoch, a
    # window per batch, then the epoch record.
    expected = [("goodput", 0)] + [
        (kind, 8 * epoch + step) for epoch in range(100)
        for kind, step in [("window", s) for s in range(1, 9)]
        + [("epoch", 8)]]
    assert written == expected[:len(written)]
    assert written[:len(announced)] == announced


def test_a_raising_wandb_log_stops_training_naming_it(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.chdir(tmp_path)

    def log(self, *args, **kwargs):
        raise ValueError("wandb is down")

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", log)
    log_dir = f"ram://keras_mgpu_test/{tmp_path.name}/logs"
    with pytest.raises(RuntimeError, match="could not write its records: "
                                           "ValueError: wandb is down"):
        small_fit(mirrored(1), log_dir, epochs=1, validation=False,
                  update_freq=1, console=False,
                  wandb={"project": "keras-mgpu-test"})
    # The logger finished the run on the way out, not left it open.
    assert wandb.run is None
    # JSONL and TensorBoard come before wandb: the first record (the time
    # ledger's, as training begins) is there.
    first = json.loads(read_lines(log_dir)[0])
    assert (first["kind"], first["step"]) == ("goodput", 0)
    # wandb writes locally: for a URL log_dir, in the working directory
    # (not wandb's, fixed at the process's first run); nothing else is
    # local (no `ram:` folder).
    assert len(glob.glob(str(tmp_path / "wandb" / "offline-run-*"))) == 1
    assert os.listdir(tmp_path) == ["wandb"]


def test_outputs_and_compiled_reads_are_kept_across_fits(tmp_path):
    """Short fits in a loop: one events file, one JSONL file, one compiled
    read for the same model; a recompiled model gets a new read; dropping
    the logger closes its files."""
    import copy
    import gc

    log_dir = str(tmp_path / "run")
    x, y = workers.regression_data(32)
    model = workers.build_mlp()
    model.compile("sgd", "mse")
    logger = DistributedLogger(log_dir, update_freq=2, console=False)
    readers = []
    for _ in range(3):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[logger])
        readers.append(logger._reader[1])
    assert readers[0] is readers[1] is readers[2]
    assert len(tf.io.gfile.glob(os.path.join(
        log_dir, "train", "events.out.tfevents.*"))) == 1
    # Everything is on disk when each fit returns.
    assert [r["step"] for r in read_jsonl(log_dir)] == [
        2, 4, 4, 6, 8, 8, 10, 12, 12]
    assert [s for s, _ in read_scalars(log_dir)["batch_loss"]] == [
        2, 4, 6, 8, 10, 12]

    model.compile("sgd", "mse", metrics=["mae"])  # new metrics: a new read
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[logger])
    assert logger._reader[1] is not readers[0]
    assert "mae" in read_jsonl(log_dir)[-1]["metrics"]

    # A copy (KerasTuner copies callbacks per trial) is a fresh logger.
    twin = copy.deepcopy(logger)
    assert (twin.log_dir, twin.update_freq, twin._sinks) == (
        log_dir, 2, None)
    jsonl = os.path.join(log_dir, "metrics.jsonl")
    assert open_handles(jsonl) == 1
    del logger, readers
    gc.collect()
    assert open_handles(jsonl) == 0


def test_the_models_summaries_follow_the_logger_the_step_was_traced_with(
        tmp_path):
    """A second fit with the same logger records its windows too; a new
    logger for an already-traced model records none (the compiled step
    holds the first logger's writer, as with Keras's TensorBoard) until
    the model is compiled again."""
    x, y = workers.regression_data(32)
    model = keras.Sequential([keras.Input((8,)), SummaryLayer(),
                              keras.layers.Dense(1)])
    model.compile("sgd", "mse")

    def fit(logger):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
                  callbacks=[logger])

    def summary_steps(log_dir):
        return [s for tag, points in read_scalars(log_dir).items()
                if tag.endswith("/input_mean") for s, _ in points]

    first = DistributedLogger(str(tmp_path / "a"), update_freq=2,
                              console=False)
    fit(first)
    fit(first)
    assert summary_steps(str(tmp_path / "a")) == [2, 4, 6, 8]
    fit(DistributedLogger(str(tmp_path / "b"), update_freq=2, console=False))
    assert summary_steps(str(tmp_path / "b")) == []
    model.compile("sgd", "mse")  # a new train function, traced anew
    fit(DistributedLogger(str(tmp_path / "c"), update_freq=2, console=False))
    # The run's global step goes on across fits and loggers.
    assert summary_steps(str(tmp_path / "c")) == [14, 16]


def test_the_input_bound_label_comes_from_the_number_shown_beside_it():
    from keras_mgpu.callbacks.telemetry import workers as telemetry_workers

    # Two workers waiting 6.2% and 25% of their steps: 15.6% on average
    # (ready batches would cost them nothing).
    rows = np.array([[0.010, 100.0, 0.062, 0.0], [0.012, 90.0, 0.25, 0.0]])
    record = telemetry_workers._across_workers(rows)
    assert record["input_wait"] == pytest.approx(0.156)
    # Not "highly" (above 20%), which only the second worker is.
    assert record["input_bound"] == "moderately"
    assert record["worker_input_wait"]["max"] == pytest.approx(0.25)
    assert input_wait_summary(record["input_wait"]) == (
        "15.6% of step time (moderately input-bound)")
    assert input_wait_summary(0.01) == "1.0% of step time (not input-bound)"
    assert input_wait_summary(0.2001) == "20.0% of step time (highly input-bound)"


class CrashAfter(keras.callbacks.Callback):
    """Raises at the end of global batch `step` (a Ctrl-C, a crash)."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if training_runtime(self.model).global_step == self.step:
            raise RuntimeError("crash")


def test_an_epoch_resumed_inside_reports_the_batches_it_trained(tmp_path,
                                                                 capsys):
    """7 batches an epoch, backups every 3: crashed after global batch 11,
    the rerun resumes after batch 9, i.e. epoch 2 (1-based) after its
    batch 2. Its epoch line and record say so and count the 5 batches (68
    samples) trained here, not the epoch's 7; an epoch run whole says
    nothing of a resume."""
    from keras_mgpu.callbacks import BackupAndRestore

    log_dir, backup_dir = str(tmp_path / "logs"), str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="crash"):
        small_fit(mirrored(1), log_dir, validation=False,
                  callbacks=[BackupAndRestore(backup_dir, save_freq=3),
                             CrashAfter(11)])
    first = capsys.readouterr().out
    assert "DistributedLogger epoch 1: loss" in first, first
    small_fit(mirrored(1), log_dir, validation=False,
              callbacks=[BackupAndRestore(backup_dir, save_freq=3)])
    out = capsys.readouterr().out
    epochs = [r for r in read_jsonl(log_dir) if r["kind"] == "epoch"]
    assert [(r["epoch"], r["resumed_after"], r["steps"], r["examples"])
            for r in epochs] == [(0, None, 7, 100.0), (1, 2, 5, 68.0)]
    assert epochs[1]["examples_per_sec"] == pytest.approx(
        68.0 / epochs[1]["seconds"])
    assert re.search(r"^DistributedLogger epoch 2 \(resumed after batch 2: "
                     r"5 batches trained here\): loss ", out, re.M), out


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_an_epoch_of_unknown_length_counts_the_batches_it_trained(
        tmp_path, steps_per_execution):
    """Data of unknown length (filtered): 7 batches an epoch, and one more
    call that finds the end of the data and trains none. Windows of 3 and
    the epoch count the 7, as on data of known length."""
    x, y = workers.regression_data(100)
    dataset = (tf.data.Dataset.from_tensor_slices((x, y))
               .filter(lambda *_: True).batch(16))
    assert dataset.cardinality() == tf.data.UNKNOWN_CARDINALITY
    with mirrored(1).scope():
        model = workers.build_mlp()
        model.compile(keras.optimizers.Adam(0.01), "mse",
                      steps_per_execution=steps_per_execution)
    log_dir = str(tmp_path / "run")
    model.fit(dataset, epochs=2, verbose=0, shuffle=False, callbacks=[
        DistributedLogger(log_dir, update_freq=3, console=False)])
    records = read_jsonl(log_dir)
    assert [(r["kind"], r["steps"], r["examples"]) for r in records] == [
        ("window", 3, 48.0), ("window", 3, 48.0), ("window", 1, 4.0),
        ("epoch", 7, 100.0)] * 2
    for r in records:
        assert r["step_time_mean"] == pytest.approx(r["seconds"] / r["steps"])


def test_a_sigkilled_run_keeps_every_closed_record_and_the_rerun_continues(
        run_workers, tmp_path):
    """Killed after 13 batches (8 per epoch, windows of 2) on a machine
    whose two cores run busy loops (from batch 2 on, the first batch a
    record closes in), with TensorBoard's writes held: the
    JSONL has all 7 records closed by then (windows 2 to 12 and epoch 0's);
    the resumed run goes on from step 13. While the killed run held the
    log_dir (after its first batch), a logger of this process there was
    refused; once that run was dead, the rerun and this process write
    there (the system dropped the dead process's lock)."""
    import select

    from keras_mgpu.callbacks import LogDirInUse

    log_dir, backup_dir = str(tmp_path / "logs"), str(tmp_path / "backup")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="-1",
               PYTHONPATH=os.pathsep.join(
                   [repo, os.environ.get("PYTHONPATH", "")]))
    stderr_path = tmp_path / "killed.stderr"
    busy, child = [], None
    try:
        with open(stderr_path, "w") as stderr:
            child = subprocess.Popen(
                [sys.executable, "-c",
                 "import sys; from tests import logger_workers; "
                 "logger_workers.killed_and_resumed(sys.argv[1], sys.argv[2], "
                 "kill_after=13, hold_after_first=True)",
                 log_dir, backup_dir],
                env=env, cwd=repo, text=True, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=stderr)
        ready, _, _ = select.select([child.stdout], [], [], 240)
        line = child.stdout.readline() if ready else ""
        assert line == "HOLDING\n", (line, child.poll(),
                                      stderr_path.read_text()[-3000:])
        with pytest.raises(LogDirInUse, match="written by another process"):
            _tiny_fit(DistributedLogger(log_dir, console=False))
        # The busy loops from the first record to be kept on.
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(2)]
        child.communicate(input="go\n", timeout=240)
        assert child.returncode == -signal.SIGKILL, (
            child.returncode, stderr_path.read_text()[-3000:])
        closed = [("window", s) for s in (2, 4, 6, 8)] + [("epoch", 8)] + [
            ("window", 10), ("window", 12)]
        # The refused logger wrote nothing.
        assert [(r["kind"], r["step"]) for r in read_jsonl(log_dir)] == closed
    finally:
        for process in busy + ([child] if child is not None else []):
            if process.poll() is None:
                process.kill()
            process.wait(timeout=60)

    [resumed] = run_workers(
        logger_workers.killed_and_resumed, num_workers=1,
        kwargs={"log_dir": log_dir, "backup_dir": backup_dir})
    assert resumed.result["iterations"] == 16
    records = read_jsonl(log_dir)
    assert [(r["kind"], r["step"]) for r in records] == closed + [
        ("resume", 13), ("window", 14), ("window", 16), ("epoch", 16)]
    # Every step once: each window starts where the previous record (or
    # the resume) left off.
    windows = [r for r in records if r["kind"] in ("window", "resume")]
    for before, record in zip(windows, windows[1:]):
        if record["kind"] == "window":
            assert record["step"] - record["steps"] == before["step"], (
                before, record)
    # This process, refused while the killed run lived, writes there now.
    _tiny_fit(DistributedLogger(log_dir, update_freq=1, console=False))
    assert [(r["kind"], r["step"])
            for r in read_jsonl(log_dir)[len(records):]] == [
        ("window", 1), ("window", 2), ("epoch", 2)]


# --- Hand-written loops -------------------------------------------------------


def test_a_gradient_tape_loop_logs_the_losses_it_gives_as_tensorboard_does(
        tmp_path):
    """A `GradientTape` loop driving its callbacks through `CallbackList`
    (the pattern docs/telemetry.md shows), with a compiled model whose
    metrics the loop never feeds: the logger writes the losses the loop
    gives, as Keras's `TensorBoard` in the same loop does."""
    ours, stock = str(tmp_path / "ours"), str(tmp_path / "stock")
    keras.utils.set_random_seed(0)
    x, y = workers.regression_data(32)
    model = workers.build_mlp()
    optimizer = keras.optimizers.SGD(0.1)
    model.compile(optimizer, "mse")
    callbacks = keras.callbacks.CallbackList(
        [DistributedLogger(ours, update_freq=2, console=False),
         keras.callbacks.TensorBoard(stock, update_freq=2,
                                     write_graph=False)], model=model)
    given = []
    callbacks.on_train_begin()
    for epoch in range(2):
        callbacks.on_epoch_begin(epoch)
        for batch in range(4):
            callbacks.on_train_batch_begin(batch)
            xb, yb = x[8 * batch:8 * (batch + 1)], y[8 * batch:8 * (batch + 1)]
            with tf.GradientTape() as tape:
                loss = keras.ops.mean((model(xb) - yb) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            given.append(float(loss))
            callbacks.on_train_batch_end(batch, {"loss": float(loss)})
        callbacks.on_epoch_end(epoch, {"loss": float(loss)})
    callbacks.on_train_end()

    windows = [r for r in read_jsonl(ours) if r["kind"] == "window"]
    assert [(r["step"], r["metrics"]) for r in windows] == [
        (s, {"loss": pytest.approx(given[s - 1])}) for s in (2, 4, 6, 8)]
    ours_loss = read_scalars(ours)["batch_loss"]
    # Keras 3.15's TensorBoard writes every second batch here, 3.10's
    # every batch: ours equals it at the steps ours writes.
    stock_loss = dict(read_scalars(stock)["batch_loss"])
    assert [s for s, _ in ours_loss] == [2, 4, 6, 8]
    assert ours_loss == [(s, pytest.approx(stock_loss[s], rel=1e-6))
                         for s in (2, 4, 6, 8)]


# --- One writer per log_dir -------------------------------------------------


def test_console_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match=r"console must be True .* or False, "
                                        r"got 'no'"):
        DistributedLogger(str(tmp_path), console="no")


def _tiny_fit(logger, callbacks=()):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(np.ones((16, 2)), np.ones((16, 1)), batch_size=8, epochs=1,
              verbose=0, callbacks=[logger, *callbacks])


def test_a_second_logger_on_a_log_dir_in_use_in_this_process_is_refused(
        tmp_path):
    """A fit on another thread holds the log_dir: a second logger's fit
    there is refused before training; once that fit ends, it may continue
    the file."""
    import threading

    log_dir = str(tmp_path / "logs")
    held, go = threading.Event(), threading.Event()

    def hold(batch, logs):
        held.set()
        go.wait(timeout=120)

    first = threading.Thread(target=_tiny_fit, args=(
        DistributedLogger(log_dir, update_freq=1, console=False),
        [keras.callbacks.LambdaCallback(on_train_batch_end=hold)]))
    first.start()
    try:
        assert held.wait(timeout=120)
        from keras_mgpu.callbacks import LogDirInUse
        with pytest.raises(LogDirInUse, match="another DistributedLogger's "
                                              "fit in this process"):
            _tiny_fit(DistributedLogger(log_dir, console=False))
    finally:
        go.set()
        first.join(timeout=120)
    assert not first.is_alive()
    _tiny_fit(DistributedLogger(log_dir, update_freq=1, console=False))
    assert [(r["kind"], r["step"]) for r in read_jsonl(log_dir)] == [
        ("window", 1), ("window", 2), ("epoch", 2)] * 2
