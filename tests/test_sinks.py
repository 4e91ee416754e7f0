"""The chief's outputs (telemetry.sinks) and the JSONL schema
(telemetry.records), without a `fit`: records written and read back.

A `Sinks` is what `DistributedLogger` creates on the chief only; which
process is the chief is the logger's decision, not the sinks' (see
tests/test_distributed_logger.py's multi-worker tests).
"""

import gc
import json
import os
import threading

import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

import keras_mgpu
from keras_mgpu.callbacks import distributed_logger, input_wait_summary
from keras_mgpu.callbacks.telemetry import records as records_lib
from keras_mgpu.callbacks.telemetry.records import JSONL_KEYS
from keras_mgpu.callbacks.telemetry.sinks import Sinks
from keras_mgpu.callbacks.telemetry.tensorboard import tensorboard_scalars
from tests.logger_checks import read_as_tensorboard_shows

# A killed earlier run's file: one whole record, then a torn line.
TORN = '{"kind": "window", "step": 0}\n{"kind": "win'


def make_record(kind="window", step=4, epoch=0, metrics=None, **values):
    """A record with every JSONL key, in `JSONL_KEYS` order, as the logger
    writes one: one replica, one worker, no loss scale, no GPU."""
    record = dict.fromkeys(JSONL_KEYS)
    record.update(
        kind=kind, epoch=epoch, step=step, steps=4, time=1.7e9,
        seconds=0.5, examples=32.0, examples_per_sec=64.0,
        examples_per_sec_per_replica=64.0, step_time_mean=0.125,
        step_time_max=0.25, input_wait=0.01, input_bound="no",
        learning_rate=0.01, memory={}, workers=1, replicas=1,
        metrics={"loss": 0.5} if metrics is None else metrics,
        superseded=False)
    record.update(values)
    assert tuple(record) == JSONL_KEYS
    return record


def read_back(log_dir) -> list:
    """metrics.jsonl's lines, local or at a URL (each still a string)."""
    with tf.io.gfile.GFile(tf.io.gfile.join(log_dir, "metrics.jsonl")) as f:
        return f.read().splitlines()


def event_tensors(log_dir, run="train") -> dict:
    """{tag: [(step, value)]} of one run's TensorBoard events, read back by
    TensorBoard's own `EventAccumulator` (every event kept)."""
    accumulator = event_accumulator.EventAccumulator(
        os.path.join(log_dir, run),
        size_guidance={event_accumulator.TENSORS: 0})
    accumulator.Reload()
    out = {}
    for tag in accumulator.Tags()[event_accumulator.TENSORS]:
        for event in accumulator.Tensors(tag):
            value = tf.make_ndarray(event.tensor_proto)
            value = value.item().decode() if value.dtype == object else (
                pytest.approx(float(value), rel=1e-6))
            out.setdefault(tag, []).append((event.step, value))
    return out


def open_handles(path) -> int:
    """How many of this process's file descriptors are open on `path`."""
    path, count = os.path.realpath(path), 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, gone by now
            continue
        count += target == path
    return count


def writer_threads() -> list:
    """The writer threads of this process's sinks still alive."""
    return [thread for thread in threading.enumerate()
            if thread.name == "DistributedLogger"]


@pytest.fixture
def log_dir(tmp_path):
    return str(tmp_path / "run")


# --- The JSONL schema ---------------------------------------------------------


def test_jsonl_keys_are_the_schema_in_its_order():
    # What readers of metrics.jsonl depend on: a change here is a change of
    # the file format, to be made on purpose.
    assert JSONL_KEYS == (
        "kind", "epoch", "step", "steps", "resumed_after", "time", "seconds",
        "examples", "examples_per_sec", "examples_per_sec_per_replica",
        "step_time_mean", "step_time_max", "input_wait", "input_bound",
        "learning_rate", "loss_scale", "skipped_steps", "grad_norm",
        "accum_step", "memory", "workers", "replicas", "worker_step_time",
        "worker_examples_per_sec", "worker_input_wait", "slowest_worker",
        "metrics", "resume", "goodput", "superseded")
    assert len(set(JSONL_KEYS)) == len(JSONL_KEYS)
    # One tuple, wherever it is imported from.
    assert keras_mgpu.callbacks.JSONL_KEYS is JSONL_KEYS
    assert distributed_logger.JSONL_KEYS is JSONL_KEYS
    assert records_lib.JSONL_KEYS is JSONL_KEYS


@pytest.mark.parametrize("fraction, text", [
    (None, "n/a"),
    (0.0, "0.0% of step time (not input-bound)"),
    (0.05, "5.0% of step time (not input-bound)"),  # "moderately" above 5%
    (0.0501, "5.0% of step time (moderately input-bound)"),
    (0.2, "20.0% of step time (moderately input-bound)"),  # "highly" above
    (0.2001, "20.0% of step time (highly input-bound)"),
    (1.0, "100.0% of step time (highly input-bound)"),
])
def test_input_wait_summary_thresholds(fraction, text):
    assert input_wait_summary(fraction) == text


# --- JSONL --------------------------------------------------------------------


def test_a_local_line_is_on_disk_when_submit_returns(log_dir):
    sinks = Sinks(log_dir, None)
    try:
        assert read_back(log_dir) == []
        first = make_record(step=4)
        sinks.submit(first)
        # Read through another handle: written and flushed, not buffered.
        assert read_back(log_dir) == [json.dumps(first)]
        second = make_record(kind="epoch", step=8, metrics={
            "loss": 0.25, "val_loss": 0.5})
        sinks.submit(second)
        lines = read_back(log_dir)
    finally:
        sinks.close()
    assert [json.loads(line) for line in lines] == [first, second]
    # The schema's order survives the round trip.
    assert all(tuple(json.loads(line)) == JSONL_KEYS for line in lines)
    assert read_back(log_dir) == lines


def torn_log_dir(tmp_path, where: str) -> str:
    """A local or `ram://` log_dir whose metrics.jsonl a killed run left
    with a torn last line (`TORN`)."""
    log_dir = (f"ram://keras_mgpu_test/{tmp_path.name}/logs" if where == "url"
               else str(tmp_path / "run"))
    tf.io.gfile.makedirs(log_dir)
    with tf.io.gfile.GFile(tf.io.gfile.join(log_dir, "metrics.jsonl"),
                           "w") as f:
        f.write(TORN)
    return log_dir


@pytest.mark.parametrize("where", ["local", "url"])
def test_reopening_after_a_torn_last_line_closes_it_off(tmp_path, where):
    log_dir = torn_log_dir(tmp_path, where)
    record = make_record(step=12)
    sinks = Sinks(log_dir, None)
    sinks.submit(record)
    sinks.close()
    lines = read_back(log_dir)
    # Only the torn line is unreadable; the next record has a line of its own.
    assert lines[:2] == TORN.splitlines()
    assert [json.loads(line) for line in lines[2:]] == [record]
    with pytest.raises(json.JSONDecodeError):
        json.loads(lines[1])

    # A file that ends cleanly is continued as it is: no blank line.
    again = Sinks(log_dir, None)
    again.submit(make_record(step=16))
    again.close()
    assert [json.loads(line)["step"] for line in read_back(log_dir)[2:]] == [
        12, 16]


def test_a_url_jsonl_is_written_by_drain(tmp_path):
    log_dir = f"ram://keras_mgpu_test/{tmp_path.name}/drained"
    sinks = Sinks(log_dir, None)
    try:
        records = [make_record(step=s) for s in (4, 8)]
        for record in records:
            sinks.submit(record)
        sinks.drain()
        assert [json.loads(line) for line in read_back(log_dir)] == records
    finally:
        sinks.close()
    # Through tf.io.gfile only: nothing local under a `ram:` folder.
    assert not os.path.exists("ram:")


def test_a_record_that_is_not_json_is_refused_naming_why(log_dir):
    sinks = Sinks(log_dir, None)
    try:
        with pytest.raises(RuntimeError, match=(
                r"DistributedLogger could not write its records: TypeError: "
                r"Object of type set is not JSON serializable")):
            sinks.submit(make_record(metrics={"loss": {0.5}}))
        # Nothing of it was written, and the next record goes on.
        assert read_back(log_dir) == []
        good = make_record(step=8)
        sinks.submit(good)
        assert read_back(log_dir) == [json.dumps(good)]
    finally:
        sinks.close()


def test_a_failed_background_write_is_raised_on_the_next_call(log_dir):
    sinks = Sinks(log_dir, None)
    # JSON can hold a list; a TensorBoard scalar cannot.
    sinks.submit(make_record(metrics={"loss": [0.5, 0.25]}))
    with pytest.raises(RuntimeError, match=(
            r"DistributedLogger could not write its records: TypeError: "
            r"float\(\) argument must be")):
        sinks.drain()
    # Raised once: the outputs are still usable, and close raises nothing.
    sinks.submit(make_record(step=8))
    sinks.close()
    assert [json.loads(line)["step"] for line in read_back(log_dir)] == [4, 8]


# --- TensorBoard --------------------------------------------------------------


def test_tensorboard_events_are_the_records_in_keras_layout(log_dir):
    windows = [make_record(step=s, metrics={"loss": 1.0 / s})
               for s in (4, 8)]
    epoch = make_record(kind="epoch", step=8, epoch=0, loss_scale=1024.0,
                        skipped_steps=1,
                        metrics={"loss": 0.2, "val_loss": 0.3})
    sinks = Sinks(log_dir, None)
    sinks.run_writer("validation")  # as the logger does at a validation
    for record in windows + [epoch]:
        sinks.submit(record)
    sinks.close()

    train, validation = event_tensors(log_dir), event_tensors(
        log_dir, "validation")
    # Exactly the series `tensorboard_scalars` gives, at their steps.
    expected = {}
    for record in windows + [epoch]:
        for run, step, values in tensorboard_scalars(record):
            for tag, value in values.items():
                expected.setdefault(run, {}).setdefault(tag, []).append(
                    (step, value))
    assert train == expected["train"]
    assert validation == expected["validation"]
    # Spot checks of that layout: Keras's names, then telemetry groups.
    assert train["batch_loss"] == [(4, 0.25), (8, 0.125)]
    assert train["epoch_loss"] == [(0, 0.2)]
    assert train["mixed_precision/epoch_loss_scale"] == [(0, 1024.0)]
    assert "mixed_precision/batch_loss_scale" not in train  # null: not written
    assert validation["epoch_loss"] == [(0, 0.3)]
    assert validation["evaluation_loss_vs_iterations"] == [(8, 0.3)]


def test_a_resume_marker_is_a_text_summary(log_dir):
    resume = make_record(kind="resume", step=40, resume={
        "generation": 3, "step": 40, "saved_replicas": 2, "replicas": 1,
        "text": "resumed at step 40"})
    sinks = Sinks(log_dir, None)
    sinks.submit(resume)
    sinks.close()
    assert event_tensors(log_dir) == {"resume": [(40, "resumed at step 40")]}
    [line] = read_back(log_dir)
    assert json.loads(line)["resume"]["generation"] == 3


def test_runs_are_created_on_first_use(log_dir):
    sinks = Sinks(log_dir, None)
    try:
        train = sinks.run_writer("train")
        assert sinks.run_writer("train") is train
        assert sinks.run_writers() == [train]
        sinks.submit(make_record())
        sinks.drain()
        # No validation record, no `validation` folder (as Keras's
        # TensorBoard callback).
        assert sorted(os.listdir(log_dir)) == ["metrics.jsonl", "train"]
        validation = sinks.run_writer("validation")
        assert sinks.run_writers() == [train, validation]
        assert sorted(os.listdir(log_dir)) == ["metrics.jsonl", "train",
                                               "validation"]
    finally:
        sinks.close()


def test_drain_returns_once_the_events_are_written_and_keeps_them_open(
        log_dir):
    sinks = Sinks(log_dir, None)
    try:
        sinks.submit(make_record(step=4, metrics={"loss": 0.5}))
        sinks.drain()
        assert event_tensors(log_dir)["batch_loss"] == [(4, 0.5)]
        sinks.submit(make_record(step=8, metrics={"loss": 0.25}))
        sinks.drain()
        assert event_tensors(log_dir)["batch_loss"] == [(4, 0.5),
                                                        (8, 0.25)]
    finally:
        sinks.close()
    # One events file for both.
    assert len(tf.io.gfile.glob(os.path.join(
        log_dir, "train", "events.out.tfevents.*"))) == 1


def test_held_records_reach_tensorboard_only_after_release(log_dir):
    sinks = Sinks(log_dir, None)
    try:
        sinks.hold()
        held = make_record(step=4, metrics={"loss": 0.5})
        sinks.submit(held)
        # The local line is written at once, held or not.
        assert read_back(log_dir) == [json.dumps(held)]
        # Had it been queued, a writer thread would write it, flush, and
        # end once idle: after waiting for every one, its events would be
        # on disk.
        for thread in writer_threads():
            thread.join(timeout=60)
        assert "batch_loss" not in event_tensors(log_dir)
        sinks.release()
        sinks.drain()
        assert event_tensors(log_dir)["batch_loss"] == [(4, 0.5)]
    finally:
        sinks.close()


def test_close_with_closes_the_files_when_the_owner_is_collected(log_dir):
    class Owner:
        pass

    owner = Owner()
    path = os.path.join(log_dir, "metrics.jsonl")
    sinks = Sinks(log_dir, None)
    sinks.close_with(owner)
    sinks.submit(make_record(step=4, metrics={"loss": 0.5}))
    assert open_handles(path) == 1
    del owner
    gc.collect()
    assert open_handles(path) == 0
    # Everything submitted was written before the files were closed.
    assert event_tensors(log_dir)["batch_loss"] == [(4, 0.5)]
    assert [json.loads(line)["step"] for line in read_back(log_dir)] == [4]


# Where a Ctrl-C (a KeyboardInterrupt) can land as the background writer
# starts: before `Thread.start` registers it, or after (Python has listed
# it in `threading.enumerate()` and never starts it).
_START_NEW_THREAD = ("_start_joinable_thread"
                     if hasattr(threading, "_start_joinable_thread")
                     else "_start_new_thread")


@pytest.mark.parametrize("where", ["Thread.start", _START_NEW_THREAD])
def test_a_ctrl_c_as_the_writer_starts_loses_nothing_at_close(
        tmp_path, monkeypatch, where):
    # The close at exit still writes what was queued, on its own thread,
    # without joining the writer that never started.
    log_dir = f"ram://keras_mgpu_test/{tmp_path.name}/interrupted"
    sinks = Sinks(log_dir, None)
    owner, name = ((threading.Thread, "start") if where == "Thread.start"
                   else (threading, where))
    original = getattr(owner, name)

    def interrupted(*args, **kwargs):
        monkeypatch.setattr(owner, name, original)
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, interrupted)
    record = make_record(step=4)
    with pytest.raises(KeyboardInterrupt):
        sinks.submit(record)
    writer = sinks._thread
    registered = writer in threading.enumerate()
    try:
        assert registered == (where != "Thread.start")
        sinks.close()
    finally:
        threading._limbo.pop(writer, None)
    assert [json.loads(line) for line in read_back(log_dir)] == [record]
    assert not writer.is_alive()


# --- A resume that redoes steps -----------------------------------------------

def attempt(log_dir, first_step, last_step, loss, begin_at=None):
    """One process's records: a window every 2 steps from `first_step` to
    `last_step`, its loss `loss`, an epoch record at step 8; after
    `begin_at(begin_at)` when given."""
    sinks = Sinks(log_dir, None)
    try:
        if begin_at is not None:
            sinks.begin_at(begin_at)
        for step in range(first_step, last_step + 1, 2):
            sinks.submit(make_record(step=step, metrics={"loss": loss}))
            if step == 8:
                sinks.submit(make_record("epoch", step=8,
                                         metrics={"loss": loss}))
    finally:
        sinks.close()


@pytest.mark.parametrize("where", ["local", "url"])
def test_a_resume_before_the_last_record_supersedes_what_follows_it(
        tmp_path, where):
    log_dir = (f"ram://keras_mgpu_test/{tmp_path.name}/redo"
               if where == "url" else str(tmp_path / "redo"))
    # Killed after recording step 10; its last backup was at step 6.
    attempt(log_dir, 2, 10, loss=1.0, begin_at=0)
    before = read_back(log_dir)
    attempt(log_dir, 8, 12, loss=2.0, begin_at=6)

    lines = read_back(log_dir)
    records = [json.loads(line) for line in lines]
    assert [(r["kind"], r["step"], r["superseded"]) for r in records] == [
        ("window", 2, False), ("window", 4, False), ("window", 6, False),
        ("window", 8, True), ("epoch", 8, True), ("window", 10, True),
        ("window", 8, False), ("epoch", 8, False), ("window", 10, False),
        ("window", 12, False)]
    # Set in place: every line keeps its length, the live ones their bytes.
    assert [len(line) for line in lines[:6]] == [len(b) for b in before]
    assert lines[:3] == before[:3]
    live = [r for r in records if not r["superseded"]]
    assert [(r["kind"], r["step"], r["metrics"]["loss"]) for r in live] == [
        ("window", 2, 1.0), ("window", 4, 1.0), ("window", 6, 1.0),
        ("window", 8, 2.0), ("epoch", 8, 2.0), ("window", 10, 2.0),
        ("window", 12, 2.0)]

    # Another resume marks only what is not marked yet.
    attempt(log_dir, 6, 6, loss=3.0, begin_at=4)
    again = [json.loads(line) for line in read_back(log_dir)]
    assert [r["step"] for r in again if not r["superseded"]] == [2, 4, 6]
    assert again[-1]["metrics"]["loss"] == 3.0

    if where == "local":
        # TensorBoard: one value per step, the newest attempt's.
        assert read_as_tensorboard_shows(log_dir, "batch_loss") == [
            (2, 1.0), (4, 1.0), (6, 3.0)]
        # The older values are still in the files: the markers drop them.
        steps = [step for step, _ in event_tensors(log_dir)["batch_loss"]]
        assert sorted(steps) == [2, 4, 6, 6, 8, 8, 10, 10, 12]


def test_a_torn_line_and_older_records_are_left_as_they_are(tmp_path):
    log_dir = torn_log_dir(tmp_path, "local")
    with open(os.path.join(log_dir, "metrics.jsonl"), "r+") as f:
        # A record of a keras-mgpu without the flag, before the torn line.
        f.write('{"kind": "window", "step": 9}\n' + TORN.split("\n")[1])
    attempt(log_dir, 2, 2, loss=1.0, begin_at=0)
    lines = read_back(log_dir)
    assert lines[:2] == ['{"kind": "window", "step": 9}',
                         TORN.split("\n")[1]]
    assert json.loads(lines[2])["superseded"] is False
