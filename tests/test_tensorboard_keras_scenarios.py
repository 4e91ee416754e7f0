"""Keras's own `TensorBoard` test scenarios, re-run against `DistributedLogger`.

The scenarios of Keras 3's `keras/src/callbacks/tensorboard_test.py`
(`TestTensorBoardV2`: the same model, `Input((10, 10, 1))`, `Flatten`,
`Dense(1)` compiled with SGD and MSE, on 10 samples of ones in batches of 2,
so 5 batches an epoch), each run with `keras.callbacks.TensorBoard` ("stock")
and with `keras_mgpu.callbacks.DistributedLogger` ("ours"). Both event trees
are read back from their files and compared per (run, tag): the steps
exactly, the values where they are deterministic (losses, metrics, learning
rate; `*_steps_per_second` is timing, so only its steps). Our telemetry tags
(every one has a `/`: `throughput/...`, `input/...`) are left out of the
comparison, and asserted where the scenario is about them.

Each comparison runs two fits with the same seed and the same data, one per
callback (the losses agree to the last bit); `test_alongside_stock_tensorboard`
shows the two in one fit each write what they write alone.

| scenario                  | stock Keras result          | keras-mgpu result          |
|---------------------------|-----------------------------|----------------------------|
| 1 basic                   | train: epoch_loss,          | same tags, steps, values;  |
|                           | epoch_<metric>,             | plus batch_loss,           |
|                           | epoch_learning_rate;        | batch_<metric>,            |
|                           | validation: epoch_*,        | batch/epoch_steps_per_     |
|                           | evaluation_*_vs_iterations  | second and telemetry       |
| 2 across invocations      | both fits write; batch step | both fits write; batch     |
|                           | restarts (1..10 twice)      | step continues (1..20);    |
|                           |                             | epoch steps 0,1 twice like |
|                           |                             | stock; same values         |
| 3 no spurious event files | only train/ has events, no  | same (metrics.jsonl beside |
|                           | validation/ folder          | the runs)                  |
| 4 batch metrics (freq 1)  | batch_loss at every global  | identical steps and values |
|                           | batch, 1..10                |                            |
| 5 lr schedule             | epoch_learning_rate is the  | equal                      |
|                           | schedule at the iterations  |                            |
| 6 global step / steps/s   | needs write_steps_per_      | always written; same steps |
|                           | second=True                 |                            |
| 7 custom tf.summary       | every batch, all at step 1  | train: at each window's    |
|                           | (the step is frozen when    | global step, one event a   |
|                           | the train function is       | step on 2 replicas;        |
|                           | traced), train & validation | validation: not recorded   |
| 8 non-blocking logs       | no `.numpy()`; writes       | no `.numpy()`, no error;   |
|                           | epoch_* and evaluation_*    | writes epoch_* (floats);   |
|                           | for hand-driven test hooks  | no validation run outside  |
|                           |                             | `fit`                      |
| 9 profiling               | profile_batch: 1 xplane,    | profile_steps: 1 xplane,   |
|                           | xprof: "No step marker"     | xprof: step time average   |
| 10 histograms, images,    | supported                   | no such arguments          |
| projector, graph          |                             | (TypeError)                |
| 10 stock alongside ours   | writes what it writes alone | writes what it writes      |
|   in one fit              | (scalars, histograms)       | alone                      |
"""

import glob
import json
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mgpu.callbacks import DistributedLogger
from tests.conftest import mirrored
from tests.logger_checks import metrics_only

SEED = 1234
X, Y = np.ones((10, 10, 10, 1), "float32"), np.ones((10, 1), "float32")
BATCHES = 5  # per epoch: 10 samples in batches of 2


# --- Helpers -----------------------------------------------------------------


def build_model(optimizer="sgd", metrics=None):
    """Keras's test model (`_get_model`)."""
    model = keras.Sequential([
        keras.Input((10, 10, 1)),
        keras.layers.Flatten(),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer, "mse", metrics=metrics)
    return model


def stock(**kwargs):
    return lambda log_dir: keras.callbacks.TensorBoard(log_dir, **kwargs)


def ours(**kwargs):
    return lambda log_dir: DistributedLogger(log_dir, console=False, **kwargs)


def train(log_dir, make_callback, *, build=build_model, data=(X, Y),
          validation=True, fits=1, strategy=None):
    """Fits a freshly seeded model `fits` times with one callback object.

    The same seed and data for both callbacks: the two fits train the same
    weights on the same batches, so their losses agree to the last bit.
    """
    keras.utils.set_random_seed(SEED)
    with (strategy or tf.distribute.get_strategy()).scope():
        model = build()
    callback = make_callback(str(log_dir))
    for _ in range(fits):
        model.fit(*data, batch_size=2, epochs=2, verbose=0,
                  validation_data=data if validation else None,
                  callbacks=[callback])
    return str(log_dir)


def train_both(tmp_path, stock_kwargs=None, ours_kwargs=None, **fit_kwargs):
    """Stock's and our event trees (scalars) from two identical fits."""
    a = train(tmp_path / "stock", stock(**(stock_kwargs or {})), **fit_kwargs)
    b = train(tmp_path / "ours", ours(**(ours_kwargs or {})), **fit_kwargs)
    return scalars(a), scalars(b)


def event_files(log_dir):
    return glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"),
                     recursive=True)


def read_events(log_dir):
    """{(run, tag): [(step, plugin, value)]} from every events file.

    The run is the folder of the file relative to `log_dir`. A `fit` opens
    new files: they are read in the order of their first summary's time
    (the file-version event's time is in whole seconds), so a run's events
    come in the order they were written.
    Scalars (plugin "scalars", a tensor summary: how both callbacks write)
    come as floats, anything else as None.
    """
    files = []
    for path in event_files(log_dir):
        events = list(tf.compat.v1.train.summary_iterator(path))
        first = min([e.wall_time for e in events if e.summary.value],
                    default=events[0].wall_time)
        files.append((first, path, events))
    out = {}
    for _, path, events in sorted(files):
        run = os.path.relpath(os.path.dirname(path), log_dir)
        for event in events:
            for value in event.summary.value:
                plugin = value.metadata.plugin_data.plugin_name
                number = (float(tf.make_ndarray(value.tensor))
                          if plugin == "scalars" else None)
                out.setdefault((run, value.tag), []).append(
                    (event.step, plugin, number))
    return out


def scalars(log_dir):
    """{(run, tag): [(step, value)]} of the scalar summaries only."""
    return {key: [(step, value) for step, plugin, value in series]
            for key, series in read_events(log_dir).items()
            if all(plugin == "scalars" for _, plugin, _ in series)}


def keras_named(series):
    """The series with Keras's own names: our telemetry tags all have a `/`
    (the model's own summaries too, which tests pick out by name)."""
    return {key: v for key, v in series.items() if "/" not in key[1]}


def steps(points):
    return [step for step, _ in points]


def values(points):
    return [value for _, value in points]


def assert_same_as_stock(stock_series, our_series, keys=None):
    """Our series of `keys` (default: all stock's) have stock's steps and,
    but for timing, stock's values."""
    for key in (sorted(stock_series) if keys is None else keys):
        assert key in our_series, f"{key} missing, have {sorted(our_series)}"
        assert steps(our_series[key]) == steps(stock_series[key]), key
        if not key[1].endswith("steps_per_second"):
            assert values(our_series[key]) == pytest.approx(
                values(stock_series[key]), rel=1e-6), key


def runs_with_events(log_dir):
    return {os.path.relpath(os.path.dirname(p), log_dir)
            for p in event_files(log_dir)}


def xplane_files(log_dir):
    return glob.glob(os.path.join(log_dir, "train", "plugins", "profile",
                                  "*", "*.xplane.pb"))


def overview_page(xplane):
    """xprof's overview page (a JSON string) of one profile."""
    from xprof.convert import raw_to_tool_data

    data, _ = raw_to_tool_data.xspace_to_tool_data(
        [xplane], "overview_page", {})
    return data.decode() if isinstance(data, bytes) else data


def steptime_ms_average(page):
    found = re.findall(r'"steptime_ms_average":"([0-9.]+)"', page)
    assert len(found) == 1, page[:500]
    return float(found[0])


# The Keras-named series of a 2-epoch fit with validation and update_freq
# larger than an epoch: one window per epoch, closed at its last batch.
EPOCHS = [0, 1]
EPOCH_ENDS = [BATCHES, 2 * BATCHES]  # global step of each epoch's last batch
TELEMETRY = {  # always written on CPU, one device, one worker
    "throughput/batch_examples_per_sec", "throughput/epoch_examples_per_sec",
    "throughput/batch_step_time_mean", "throughput/epoch_step_time_mean",
    "throughput/batch_step_time_max", "throughput/epoch_step_time_max",
    "input/batch_wait", "input/epoch_wait",
}


# --- 1. basic ----------------------------------------------------------------


def test_basic(tmp_path):
    """Stock: train epoch_loss, epoch_mae, epoch_learning_rate; validation
    epoch_loss, epoch_mae, evaluation_*_vs_iterations. Ours: the same tags,
    steps and values, plus batch_* of its window (here one per epoch, at the
    epoch's last global batch), both *_steps_per_second and telemetry."""
    build = lambda: build_model(metrics=["mae"])  # noqa: E731
    stock_series, our_series = train_both(tmp_path, build=build)

    assert set(keras_named(stock_series)) == {
        ("train", "epoch_loss"), ("train", "epoch_mae"),
        ("train", "epoch_learning_rate"),
        ("validation", "epoch_loss"), ("validation", "epoch_mae"),
        ("validation", "evaluation_loss_vs_iterations"),
        ("validation", "evaluation_mae_vs_iterations"),
    }
    assert steps(stock_series["train", "epoch_loss"]) == EPOCHS
    assert steps(stock_series["validation",
                              "evaluation_loss_vs_iterations"]) == EPOCH_ENDS
    assert_same_as_stock(stock_series, our_series)

    extra = set(keras_named(our_series)) - set(stock_series)
    assert extra == {("train", "batch_loss"), ("train", "batch_mae"),
                     ("train", "batch_steps_per_second"),
                     ("train", "epoch_steps_per_second")}
    assert steps(our_series["train", "batch_loss"]) == EPOCH_ENDS
    assert values(our_series["train", "batch_loss"]) == pytest.approx(
        values(our_series["train", "epoch_loss"]), rel=1e-6)
    telemetry = {tag for run, tag in our_series if "/" in tag}
    assert TELEMETRY <= telemetry
    assert all(run == "train" for run, tag in our_series if "/" in tag)


# --- 2. across invocations ---------------------------------------------------


def test_across_invocations(tmp_path):
    """Keras's use-after-free regression: one callback object in two `fit`
    calls. Stock: both fits write; its batch step restarts every fit
    (batch_loss at 1..10, twice) while evaluation_* continues with the
    optimizer's iterations (5..20); epoch steps are 0, 1 twice. Ours: both
    fits write; the global step continues across fits (batch_loss at 1..20),
    epoch steps 0, 1 twice as stock's, the same values throughout."""
    stock_series, our_series = train_both(
        tmp_path, {"update_freq": 1}, {"update_freq": 1}, fits=2)

    assert steps(stock_series["train", "batch_loss"]) == [
        *range(1, 11), *range(1, 11)]
    assert steps(our_series["train", "batch_loss"]) == list(range(1, 21))
    assert steps(our_series["train", "batch_steps_per_second"]) == list(
        range(1, 21))
    assert values(our_series["train", "batch_loss"]) == pytest.approx(
        values(stock_series["train", "batch_loss"]), rel=1e-6)
    # The second fit trains on: its losses are not the first fit's.
    first, second = np.split(
        np.array(values(our_series["train", "batch_loss"])), 2)
    assert not np.allclose(first, second)

    assert steps(stock_series["train", "epoch_loss"]) == EPOCHS * 2
    assert steps(stock_series["validation",
                              "evaluation_loss_vs_iterations"]) == [
        5, 10, 15, 20]
    assert_same_as_stock(stock_series, our_series, [
        key for key in stock_series if key[1] != "batch_loss"])
    assert steps(our_series["train", "epoch_steps_per_second"]) == EPOCHS * 2


# --- 3. no spurious event files ----------------------------------------------


def test_no_spurious_event_files(tmp_path):
    """Without validation data. Stock: only `train` has events files, and
    there is no `validation` folder. Ours: the same."""
    a = train(tmp_path / "stock", stock(), validation=False)
    b = train(tmp_path / "ours", ours(), validation=False)

    for log_dir in (a, b):
        assert runs_with_events(log_dir) == {"train"}
        assert not os.path.exists(os.path.join(log_dir, "validation"))
    # Ours keeps its JSONL records beside the runs, not in them.
    assert sorted(os.listdir(b)) == ["metrics.jsonl", "train"]


# --- 4. batch metrics --------------------------------------------------------


def test_batch_metrics(tmp_path):
    """update_freq=1. Stock: batch_loss at every global batch, 1..10. Ours:
    identical steps and values, and the other Keras tags as stock's."""
    stock_series, our_series = train_both(
        tmp_path, {"update_freq": 1}, {"update_freq": 1})

    assert steps(stock_series["train", "batch_loss"]) == list(range(1, 11))
    assert_same_as_stock(stock_series, our_series)
    assert set(keras_named(our_series)) - set(stock_series) == {
        ("train", "batch_steps_per_second"),
        ("train", "epoch_steps_per_second")}


# --- 5. learning-rate schedules ----------------------------------------------


def schedule_model():
    return build_model(keras.optimizers.SGD(
        keras.optimizers.schedules.CosineDecay(0.01, 1)))


def test_learning_rate_schedules(tmp_path):
    """SGD(CosineDecay(0.01, 1)), no validation. Stock: epoch_learning_rate
    is the schedule at the optimizer's iterations at each epoch end. Ours:
    equal."""
    stock_series, our_series = train_both(
        tmp_path, build=schedule_model, validation=False)

    schedule = keras.optimizers.schedules.CosineDecay(0.01, 1)
    expected = [float(schedule(step)) for step in EPOCH_ENDS]
    assert values(stock_series["train", "epoch_learning_rate"]) == (
        pytest.approx(expected))
    assert set(keras_named(stock_series)) == {
        ("train", "epoch_loss"), ("train", "epoch_learning_rate")}
    assert_same_as_stock(stock_series, our_series)


# --- 6. global step / steps per second ---------------------------------------


def test_global_step(tmp_path):
    """update_freq=1 with the schedule. Stock writes epoch_ and
    batch_steps_per_second only with write_steps_per_second=True; ours
    always does: the same steps (epochs 0, 1; batches 1..10), positive
    values; the other Keras tags as stock's."""
    stock_series, our_series = train_both(
        tmp_path,
        {"update_freq": 1, "profile_batch": 0, "write_steps_per_second": True},
        {"update_freq": 1}, build=schedule_model, validation=False)

    assert set(keras_named(stock_series)) == {
        ("train", "batch_loss"), ("train", "epoch_loss"),
        ("train", "epoch_learning_rate"),
        ("train", "epoch_steps_per_second"),
        ("train", "batch_steps_per_second")}
    assert steps(stock_series["train", "epoch_steps_per_second"]) == EPOCHS
    assert steps(stock_series["train", "batch_steps_per_second"]) == list(
        range(1, 11))
    assert_same_as_stock(stock_series, our_series)
    assert set(keras_named(our_series)) == set(stock_series)
    for tag in ("epoch_steps_per_second", "batch_steps_per_second"):
        assert min(values(our_series["train", tag])) > 0


# --- 7. the model's own summaries --------------------------------------------


class LayerWithSummary(keras.layers.Layer):
    """Keras's test layer: a scalar summary of its input's sum."""

    def call(self, x):
        tf.summary.scalar("custom_summary", tf.reduce_sum(x))
        return x


def summary_model():
    # Keras's test model is the summary layer alone. The Dense layer gives the
    # optimizer something to step, so that evaluation_*_vs_iterations (at
    # the optimizer's iterations in stock) is at the global step, not 0.
    # Named: the summary's tag has the model's and the layer's name scopes,
    # so both fits' models must have the same names.
    model = keras.Sequential([keras.Input((5,)), LayerWithSummary(name="sums"),
                              keras.layers.Dense(5)], name="summarized")
    model.compile("sgd", "mse", jit_compile=False)  # summaries are not XLA
    return model


def custom_summary(series, run):
    """The (steps, values) of the layer's summary in `run`. Its tag has the
    name scopes of the model and the layer (uniquified by TensorFlow, so
    `summarized_1/sums_1/...` after the first trace), the same for both
    callbacks."""
    keys = [key for key in series
            if key[0] == run and key[1].endswith("/custom_summary")]
    assert len(keys) == 1, sorted(series)
    assert re.fullmatch(r"summarized(_\d+)?/sums(_\d+)?/custom_summary",
                        keys[0][1]), keys
    return series[keys[0]]


@pytest.mark.parametrize("replicas", [1, 2], ids=["default", "mirrored2"])
def test_custom_summary(tmp_path, replicas):
    """A layer calling tf.summary.scalar, update_freq=1, validation data.
    Stock: every train and every validation batch, all at step 1 (Keras
    passes the step to the writer as a number, frozen into the compiled
    functions at their first batch). Ours: train at each window's last
    batch at its global step (1..10 here; 2, 4, 5, 7, 9, 10 with
    update_freq=2, as batch_loss), the same values; validation's are not
    recorded (ours is the default writer only inside train steps, so that
    no other callback's summaries meet it). Under MirroredStrategy, replica
    0 only: one event per recorded step."""
    strategy = mirrored(replicas)
    x = np.arange(50, dtype="float32").reshape(10, 5)
    fit = {"build": summary_model, "data": (x, x), "strategy": strategy}
    stock_series, our_series = train_both(
        tmp_path, {"update_freq": 1}, {"update_freq": 1}, **fit)

    # The same tag in the train run; none in validation for ours.
    assert {k for k in stock_series if k[1].endswith("/custom_summary")} == {
        k for k in our_series if k[1].endswith("/custom_summary")} | {
        ("validation", k[1]) for k in our_series
        if k[1].endswith("/custom_summary")}
    assert not [k for k in our_series
                if k[0] == "validation" and "custom_summary" in k[1]]
    stock_train = custom_summary(stock_series, "train")
    stock_validation = custom_summary(stock_series, "validation")
    assert steps(stock_train) == [1] * 10
    assert steps(stock_validation) == [1] * 10

    our_train = custom_summary(our_series, "train")
    assert steps(our_train) == list(range(1, 11))  # one event per step
    # The same batches (same seed): the same sums, batch by batch.
    assert values(our_train) == values(stock_train)
    # Validation is not shuffled: its first batch, or on 2 replicas the
    # half of it replica 0 sums (replica 0's event only, not the total).
    first = x[:2 // replicas].sum()
    assert values(stock_validation)[0] == first

    # Keras's own tags agree as in the other scenarios.
    assert_same_as_stock(keras_named(stock_series), our_series)

    if replicas > 1:
        return  # the windows below do not depend on the strategy
    # Windows of 2: recorded at each window's last batch, as batch_loss.
    windows = scalars(train(tmp_path / "ours2", ours(update_freq=2), **fit))
    assert steps(custom_summary(windows, "train")) == [2, 4, 5, 7, 9, 10]
    assert steps(windows["train", "batch_loss"]) == [2, 4, 5, 7, 9, 10]


# --- 8. non-blocking ---------------------------------------------------------


def drive_callback_list(callback):
    """Keras's `test_TensorBoard_non_blocking`: every hook of a
    `CallbackList` driven by hand, logs holding a tensor whose `.numpy`
    raises (a blocking NumPy conversion would show as that error)."""
    model = keras.Sequential([keras.layers.Dense(1)])
    model.optimizer = keras.optimizers.Adam()
    callbacks = keras.callbacks.CallbackList(
        [callback], model=model, epochs=1, steps=100, verbose=0)
    tensor = keras.ops.convert_to_tensor(1.0)

    def mock_numpy():
        raise RuntimeError("blocking NumPy conversion")

    tensor.numpy = mock_numpy
    logs = {"metric": tensor}
    callbacks.on_train_begin(logs)
    callbacks.on_epoch_begin(0, logs)
    callbacks.on_train_batch_begin(0, logs)
    callbacks.on_train_batch_end(0, logs)
    callbacks.on_epoch_end(0, logs)
    callbacks.on_train_end(logs)
    callbacks.on_test_begin(logs)
    callbacks.on_test_batch_begin(0, logs)
    callbacks.on_test_batch_end(0, logs)
    callbacks.on_test_end(logs)
    callbacks.on_predict_begin(logs)
    callbacks.on_predict_batch_begin(logs)
    callbacks.on_predict_batch_end(logs)
    callbacks.on_predict_end(logs)


def test_non_blocking(tmp_path):
    """Stock: no `.numpy()` call; writes epoch_metric and the learning rate
    at epoch 0, and evaluation_metric_vs_iterations for the hand-driven test
    hooks. Ours: no `.numpy()` call and no error either (it reads window
    metrics from the model, and converts the epoch logs to floats through
    NumPy's buffer protocol, not `.numpy`, once per epoch); it writes
    epoch_metric = 1.0 and the learning rate, its steps/s, the batch's
    logs (a hand-driven list: the logs it is given, batch_metric = 1.0),
    and no `validation` run: test hooks outside `fit` are not logged."""
    a, b = str(tmp_path / "stock"), str(tmp_path / "ours")
    drive_callback_list(keras.callbacks.TensorBoard(a))
    drive_callback_list(DistributedLogger(b, console=False))

    lr = pytest.approx(0.001)  # Adam's default
    assert keras_named(scalars(a)) == {
        ("train", "epoch_metric"): [(0, 1.0)],
        ("train", "epoch_learning_rate"): [(0, lr)],
        ("validation", "evaluation_metric_vs_iterations"): [(0, 1.0)],
    }
    our_series = keras_named(scalars(b))
    assert set(our_series) == {
        ("train", "epoch_metric"), ("train", "epoch_learning_rate"),
        ("train", "epoch_steps_per_second"),
        ("train", "batch_steps_per_second"), ("train", "batch_metric")}
    assert our_series["train", "epoch_metric"] == [(0, 1.0)]
    assert our_series["train", "epoch_learning_rate"] == [(0, lr)]
    assert steps(our_series["train", "batch_steps_per_second"]) == [1]
    assert not os.path.exists(os.path.join(b, "validation"))
    with open(os.path.join(b, "metrics.jsonl")) as f:
        records = metrics_only(map(json.loads, f))
    assert [(r["kind"], r["metrics"]) for r in records] == [
        ("window", {"metric": 1.0}), ("epoch", {"metric": 1.0})]


# --- 9. profiling ------------------------------------------------------------


def test_auto_trace(tmp_path):
    """Stock profile_batch=1: one xplane file under train/plugins/profile,
    and a `batch_1` trace summary. Ours profile_steps=(1, 1): one xplane
    file, no trace summary. (Two fits: two profilers cannot run at once.)"""
    a = train(tmp_path / "stock", stock(profile_batch=1), validation=False)
    b = train(tmp_path / "ours", ours(profile_steps=(1, 1)),
              validation=False)

    assert len(xplane_files(a)) == 1
    assert len(xplane_files(b)) == 1
    assert [plugin for _, plugin, _ in read_events(a)["train", "batch_1"]] == [
        "graph_run_metadata_graph"]
    assert {plugin for series in read_events(b).values()
            for _, plugin, _ in series} == {"scalars"}


def test_profile_step_markers(tmp_path):
    """Batches 2 to 4 profiled. Stock (profile_batch=(2, 4)): xprof's
    overview finds no steps ("No step marker", step time average 0). Ours
    (profile_steps=(2, 4)): each batch is a marked step, xprof averages a
    positive step time.

    The profile ends before the logger's first record (at the epoch's last
    batch) is written: a profile that also holds the writer thread's first
    compiled write has, in some runs (1 in 40 to 1 in 5 measured), no steps
    in xprof's overview although the step events are in the file."""
    a = train(tmp_path / "stock", stock(profile_batch=(2, 4)),
              validation=False)
    b = train(tmp_path / "ours", ours(profile_steps=(2, 4)),
              validation=False)
    (stock_xplane,), (our_xplane,) = xplane_files(a), xplane_files(b)

    stock_page = overview_page(stock_xplane)
    assert "No step marker" in stock_page
    assert steptime_ms_average(stock_page) == 0.0
    our_page = overview_page(our_xplane)
    assert "No step marker" not in our_page
    assert steptime_ms_average(our_page) > 0.0


# --- 10. not supported: histograms, images, projector, graph -----------------


@pytest.mark.parametrize("argument", [
    "histogram_freq", "write_images", "embeddings_freq",
    "embeddings_metadata", "write_graph"])
def test_unsupported_arguments(tmp_path, argument):
    """Stock: weight histograms, weight images, the embedding projector and
    the graph. Ours has none of these arguments: a TypeError naming it."""
    with pytest.raises(TypeError, match=argument):
        DistributedLogger(str(tmp_path), **{argument: 1})
    assert not os.path.exists(tmp_path / "train")


@pytest.mark.parametrize("stock_freq", ["epoch", 1])
def test_alongside_stock_tensorboard(tmp_path, stock_freq):
    """Stock TensorBoard(histogram_freq=1) and ours in one fit: each writes
    exactly what it writes alone, whatever stock's update_freq. Ours is the
    default writer only inside the model's train steps, so
    stock's scalars and histograms, written from its callbacks under its
    own writer, are untouched, and stock's `batch_*` writes (to the default
    writer, which it sets only with an integer update_freq) do not land in
    our files. (Two stock TensorBoards with an integer update_freq in one
    fit raise AttributeError at train end: Keras pops its default writer
    out of order.)"""
    a, b = str(tmp_path / "stock"), str(tmp_path / "ours")
    keras.utils.set_random_seed(SEED)
    model = build_model()
    model.fit(X, Y, batch_size=2, epochs=2, verbose=0, validation_data=(X, Y),
              callbacks=[keras.callbacks.TensorBoard(
                  a, histogram_freq=1, update_freq=stock_freq),
                  DistributedLogger(b, console=False)])
    stock_alone = read_events(train(
        tmp_path / "stock_alone",
        stock(histogram_freq=1, update_freq=stock_freq)))
    ours_alone = scalars(train(tmp_path / "ours_alone", ours()))

    assert runs_with_events(a) == {"train", "validation"}
    together = read_events(a)
    # Layer names are numbered per process: compare the last part.
    assert {(run, tag.split("/")[-1]) for run, tag in together} == {
        (run, tag.split("/")[-1]) for run, tag in stock_alone}
    assert {("train", "epoch_loss"), ("validation", "epoch_loss"),
            ("train", "epoch_learning_rate"),
            ("validation", "evaluation_loss_vs_iterations"),
            ("train", "keras")} <= set(together)
    if stock_freq == 1:
        assert steps(scalars(a)["train", "batch_loss"]) == list(range(1, 11))
    ours_together = scalars(b)
    assert set(ours_together) == set(ours_alone)
    assert steps(ours_together["train", "batch_loss"]) == [5, 10]
    assert_same_as_stock(ours_alone, ours_together,
                         list(keras_named(ours_alone)))
