"""The training runtime: BackupAndRestore and DistributedLogger composed.

Real processes, real SIGKILLs: in every cell of {default strategy,
MirroredStrategy over 2 logical CPUs, 2-worker MultiWorkerMirroredStrategy}
x {plain model, GradientAccumulationModel}, both with compiled metrics, a
run killed mid accumulation window, resumed, killed again mid-epoch on a
window boundary and resumed again ends with the uninterrupted run's weights
and optimizer steps, and its logger's records continue at the run's global
step across both resumes.
"""

import glob
import json
import os
import signal

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mgpu import launcher
from keras_mgpu.callbacks import DistributedLogger
from keras_mgpu.goodput import read_job
from keras_mgpu.runtime import RunCounters, training_runtime
from tests import runtime_workers as rw
from tests import workers
from tests.logger_checks import metrics_only, read_as_tensorboard_shows

# name: (worker processes, replicas per process)
STRATEGIES = {"default": (1, 1), "mirrored": (1, 2), "multi_worker": (2, 1)}
LAST_STEP = rw.STEPS_PER_EPOCH * rw.EPOCHS  # 16
# Epoch 1 holds steps 9-16; GradientAccumulationModel(accum_steps=3) closes
# its windows there at steps 11 and 14, the logger its windows at 11 and 14.
# Both kills follow a save (every 2 steps): at 10 mid-window for both, at 14
# on a window boundary for both, mid-epoch.
KILLS = {"mid_window": 10, "mid_epoch": 14}
TIMEOUT = 240


def max_diff(a, b):
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
               for x, y in zip(a, b))


def read_jsonl(log_dir):
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return metrics_only(map(json.loads, f))


def read_events(log_dir):
    """{tag: [(step, value), ...]} over every events file in `log_dir/train`
    (one per process); text summaries come back as strings."""
    events = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "train",
                                              "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                array = tf.make_ndarray(value.tensor)
                item = (array.item().decode() if array.dtype == object
                        else float(array))
                events.setdefault(value.tag, []).append((event.step, item))
    return events


def run(tmp_path, name, strategy, accumulate, kill_at=None, replicas=None,
        hold_generation=None):
    num_workers, default_replicas = STRATEGIES[strategy]
    options = {}
    if kill_at is not None:
        options["kill_when_printed"] = f"STEP {kill_at};"
    results = launcher.run_local_workers(
        rw.train, num_workers, timeout=TIMEOUT,
        env={"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "-1"},
        kwargs={"backup_dir": str(tmp_path / name / "backup"),
                "log_dir": str(tmp_path / name / "logs"),
                "replicas": replicas or default_replicas,
                "accumulate": accumulate, "kill_at": kill_at,
                "hold_generation": hold_generation},
        **options)
    if kill_at is not None:
        assert all(r.killed and r.returncode == -signal.SIGKILL
                   for r in results), [(r.killed, r.returncode)
                                       for r in results]
        return None
    return results[0].result


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted run's result and records, per (strategy, model)."""
    cache = {}

    def get(strategy, accumulate):
        key = (strategy, accumulate)
        if key not in cache:
            base = tmp_path_factory.mktemp(f"full-{strategy}-{accumulate}")
            result = run(base, "full", strategy, accumulate)
            cache[key] = result, read_jsonl(str(base / "full" / "logs"))
        return cache[key]

    return get


def check_records(records, full_records, saved_steps):
    """The logger's file after resumes at `saved_steps`: each killed run's
    records, a marker per resume, then records that continue the run."""
    kinds = [r["kind"] for r in records]
    cuts = [i for i, kind in enumerate(kinds) if kind == "resume"]
    assert [records[i]["step"] for i in cuts] == saved_steps, kinds
    segments = [records[a + 1:b] for a, b in
                zip([-1] + cuts, cuts + [len(records)])]
    full = {(r["kind"], r["step"]) for r in full_records}
    for i in cuts:
        assert records[i]["resume"]["step"] == records[i]["step"]
        assert records[i]["resume"]["text"].startswith(
            "resumed from generation ")
    # A killed run's records lie past the previous save and up to its own:
    # killed right after a save, records still queued may be lost, none
    # past the save can exist.
    for segment, low, high in zip(segments, [0] + saved_steps, saved_steps):
        assert all(low < r["step"] <= high for r in segment), segment
        assert {(r["kind"], r["step"]) for r in segment} <= full
    # The last run's records lie past the last save, at the steps the
    # uninterrupted run wrote them, and end where it ended.
    last = segments[-1]
    windows = [r["step"] for r in last if r["kind"] == "window"]
    assert windows == sorted(
        r["step"] for r in full_records
        if r["kind"] == "window" and r["step"] > saved_steps[-1])
    assert windows[-1] == LAST_STEP
    assert [r["step"] for r in last if r["kind"] == "epoch"] == [LAST_STEP]
    # No empty records: each trained whole global batches.
    for record in sum(segments, []):
        assert record["steps"] > 0
        assert record["examples"] == record["steps"] * rw.GLOBAL_BATCH


@pytest.mark.parametrize("strategy, accumulate", [
    # One device plain and two workers accumulated (one device accumulated:
    # tests/test_backup_and_restore.py's
    # test_sigkill_at_several_steps_resumes_exactly).
    # Two workers plain (their resume is the accumulated one's, without the
    # window) and one process's two replicas accumulated (the two workers'
    # resume, in one process): `make test-all`.
    ("default", False),
    pytest.param("mirrored", True, marks=pytest.mark.exhaustive),
    pytest.param("multi_worker", False, marks=pytest.mark.exhaustive),
    ("multi_worker", True),
], ids=["default-plain", "mirrored-accumulated", "multi_worker-plain",
        "multi_worker-accumulated"])
def test_killed_run_resumes_exactly_with_continuous_logs(
        uninterrupted, tmp_path, strategy, accumulate):
    full, full_records = uninterrupted(strategy, accumulate)
    kills = [KILLS["mid_window"], KILLS["mid_epoch"]]
    for kill_at in kills:
        run(tmp_path, "run", strategy, accumulate, kill_at=kill_at)
    resumed = run(tmp_path, "run", strategy, accumulate)

    assert resumed["iterations"] == full["iterations"]
    assert max_diff(resumed["weights"], full["weights"]) <= 1e-6
    # The runtime's counters continue across the resume.
    assert resumed["global_step"] == full["global_step"] == LAST_STEP
    assert resumed["updates_applied"] == full["iterations"]
    assert resumed["samples_seen"] == LAST_STEP * rw.GLOBAL_BATCH

    logs = str(tmp_path / "run" / "logs")
    check_records(read_jsonl(logs), full_records, kills)
    events = read_events(logs)
    assert [step for step, _ in events["resume"]] == kills
    for (step, text) in events["resume"]:
        assert f"at step {step}" in text
    loss_steps = [step for step, _ in events["batch_loss"]]
    assert len(loss_steps) == len(set(loss_steps)), "a step written twice"
    assert max(loss_steps) == LAST_STEP


def test_steps_trained_again_after_a_resume_are_recorded_once(
        uninterrupted, tmp_path):
    """Killed at step 13 while the save of step 12 had not committed: the
    resume continues from step 10, and the window recorded at step 11 is
    trained and recorded again."""
    full, full_records = uninterrupted("default", False)
    run(tmp_path, "run", "default", False, kill_at=13,
        hold_generation=12 // rw.SAVE_FREQ)
    resumed = run(tmp_path, "run", "default", False)
    assert resumed["iterations"] == full["iterations"]
    assert max_diff(resumed["weights"], full["weights"]) <= 1e-6

    logs = str(tmp_path / "run" / "logs")
    records = read_jsonl(logs)
    resume, = [r for r in records if r["kind"] == "resume"]
    assert resume["step"] == 10
    assert [(r["kind"], r["step"]) for r in records if r["superseded"]] == [
        ("window", 11)]
    live = [(r["kind"], r["step"]) for r in records
            if r["kind"] != "resume" and not r["superseded"]]
    assert live == [(r["kind"], r["step"]) for r in full_records]
    # TensorBoard (its loader that honours the restart marker): each step
    # once, with the value of the attempt that trained it last. The epoch's
    # mean loss restarts with the attempt, so the two values of step 11
    # differ. The killed attempt's last second of events may be lost (as a
    # SIGKILL loses them), the rerun's are all there.
    superseded, = [r for r in records if r["superseded"]]
    again, = [r for r in records if r["step"] == 11 and not r["superseded"]]
    assert superseded["metrics"]["loss"] != again["metrics"]["loss"]
    loss = read_as_tensorboard_shows(logs, "batch_loss")
    expected = {r["step"]: r["metrics"]["loss"] for r in records
                if r["kind"] == "window" and not r["superseded"]}
    steps = [step for step, _ in loss]
    assert steps == sorted(set(steps))
    assert {11, 14, 16} <= set(steps) <= set(expected)
    assert np.allclose([v for _, v in loss],
                       [expected[step] for step in steps], atol=1e-6)
    # The job's time: two attempts; the killed one's window at step 11,
    # trained again by the rerun, is work redone; every second of the job
    # is in one category.
    job = read_job(logs)
    first, second = job.attempts
    assert (first.steps, second.steps) == (11, full_records[-1]["step"])
    assert first.seconds["redone"] == pytest.approx(
        superseded["seconds"], abs=1e-3)
    assert second.seconds["redone"] == 0
    assert second.seconds["restore"] > 0
    assert job.seconds["between_attempts"] == pytest.approx(
        second.started - first.ended)
    assert sum(job.seconds.values()) == pytest.approx(job.wall_seconds)
    assert job.wall_seconds == pytest.approx(second.ended - first.started)
    assert job.goodput == pytest.approx(
        job.seconds["productive"] / job.wall_seconds)


def test_multi_worker_matches_single_process(uninterrupted):
    for accumulate in (False, True):
        single, _ = uninterrupted("default", accumulate)
        multi, _ = uninterrupted("multi_worker", accumulate)
        assert multi["iterations"] == single["iterations"]
        assert max_diff(multi["weights"], single["weights"]) <= 1e-5


# Both directions rescale the same global sums: 1 to 2 in `make test-all`.
@pytest.mark.parametrize("saved_on, resumed_on", [
    (2, 1), pytest.param(1, 2, marks=pytest.mark.exhaustive)])
def test_resume_on_another_replica_count_is_exact(
        uninterrupted, tmp_path, saved_on, resumed_on):
    """Saved mid-window on one replica count, resumed on the other, with the
    same global batch: the accumulators carry global sums."""
    full, _ = uninterrupted("mirrored" if saved_on == 2 else "default", True)
    kill_at = KILLS["mid_window"]
    run(tmp_path, "run", "default", True, kill_at=kill_at, replicas=saved_on)
    resumed = run(tmp_path, "run", "default", True, replicas=resumed_on)
    assert resumed["replicas"] == resumed_on
    assert resumed["iterations"] == full["iterations"]
    assert max_diff(resumed["weights"], full["weights"]) <= 1e-5
    marker, = [r for r in read_jsonl(str(tmp_path / "run" / "logs"))
               if r["kind"] == "resume"]
    assert (marker["resume"]["saved_replicas"],
            marker["resume"]["replicas"]) == (saved_on, resumed_on)
    assert f"({saved_on} -> {resumed_on} replicas)" in marker["resume"]["text"]


def hand_written_loop(model, optimizer, log_dir, epochs=2, steps=4):
    """Trains with a GradientTape, driving the logger through a CallbackList."""
    x, y = workers.regression_data(8 * steps)
    callbacks = keras.callbacks.CallbackList(
        [DistributedLogger(log_dir, update_freq=2, console=False)],
        model=model)
    callbacks.on_train_begin()
    for epoch in range(epochs):
        callbacks.on_epoch_begin(epoch)
        for batch in range(steps):
            callbacks.on_train_batch_begin(batch)
            xb, yb = x[8 * batch:8 * (batch + 1)], y[8 * batch:8 * (batch + 1)]
            with tf.GradientTape() as tape:
                loss = keras.ops.mean((model(xb) - yb) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            callbacks.on_train_batch_end(batch, {"loss": float(loss)})
        callbacks.on_epoch_end(epoch, {"loss": float(loss)})
    callbacks.on_train_end()
    return read_jsonl(log_dir)


@pytest.mark.parametrize("compiled", [False, True],
                         ids=["uncompiled", "compiled"])
def test_logger_in_a_hand_written_loop(tmp_path, compiled):
    model = workers.build_mlp()
    optimizer = keras.optimizers.SGD(0.1)
    if compiled:
        # Compiled, but trained by hand: Keras's loss tracker never sees a
        # batch, so the sample count is unknown rather than 0.
        model.compile(optimizer, "mse", metrics=["mae"])
    records = hand_written_loop(model, optimizer, str(tmp_path / "logs"))
    assert [(r["kind"], r["step"], r["steps"]) for r in records] == [
        ("window", 2, 2), ("window", 4, 2), ("epoch", 4, 4),
        ("window", 6, 2), ("window", 8, 2), ("epoch", 8, 4)]
    assert all(r["examples"] is None and r["input_wait"] is None
               for r in records)
    epoch_losses = [r["metrics"]["loss"] for r in records
                    if r["kind"] == "epoch"]
    assert epoch_losses[1] < epoch_losses[0]
    counters = training_runtime(model).counters()
    assert isinstance(counters, RunCounters)
    assert counters.global_step == 8
    assert counters.updates_applied == (8 if compiled else None)


@pytest.mark.parametrize("run_eagerly", [False, True],
                         ids=["compiled_step", "run_eagerly"])
def test_compiled_metrics_resume_on_the_default_strategy(tmp_path, run_eagerly):
    """The failure this runtime fixed: resuming a model with compiled metrics
    on the default strategy raised 'Cannot get result() since the metric has
    not yet been built' while skipping the trained batches."""
    from keras_mgpu.callbacks import BackupAndRestore

    x, y = rw.classification_data()

    def fit(callbacks):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)),
                                  keras.layers.Dense(3, activation="softmax")])
        model.set_weights(workers.initial_weights(model))
        model.compile(keras.optimizers.Adam(0.01),
                      "sparse_categorical_crossentropy", metrics=["accuracy"],
                      run_eagerly=run_eagerly)
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                            shuffle=False, callbacks=callbacks)
        return model, history

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if training_runtime(self.model).global_step == 11:
                raise RuntimeError("crash")

    full, _ = fit([])
    backup = BackupAndRestore(str(tmp_path / "backup"), save_freq=1)
    with pytest.raises(RuntimeError, match="crash"):
        fit([backup, Crash()])
    resumed, history = fit([backup])
    assert int(resumed.optimizer.iterations.numpy()) == 16
    assert max_diff(resumed.get_weights(), full.get_weights()) <= 1e-6
    assert 0.0 <= history.history["accuracy"][-1] <= 1.0


@pytest.mark.parametrize("value", [None, "model", keras.layers.Dense(1)],
                         ids=["None", "str", "layer"])
def test_training_runtime_of_a_non_model_is_refused(value):
    with pytest.raises(TypeError) as error:
        training_runtime(value)
    assert f"got {value!r}" in str(error.value)
    assert "keras.Model" in str(error.value)
