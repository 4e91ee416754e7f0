"""What the logger's tests read back and check on either Keras backend:
its TensorBoard events, Keras TensorBoard's layout of them, and the
records of the logger's reference fit."""

import os

import pytest
import tensorflow as tf

from keras_mgpu.callbacks.distributed_logger import JSONL_KEYS
from keras_mgpu.goodput.ledger import CATEGORIES


def read_scalars(log_dir, run="train"):
    """{tag: [(step, value), ...]} from the chief's TensorBoard events of
    one run (local or at a URL)."""
    scalars = {}
    paths = tf.io.gfile.glob(
        tf.io.gfile.join(log_dir, run, "events.out.tfevents.*"))
    assert paths, f"no events file under {log_dir}/{run}"
    for path in paths:
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append(
                    (event.step, float(tf.make_ndarray(value.tensor))))
    return scalars


def read_as_tensorboard_shows(log_dir, tag, run="train"):
    """[(step, value)] of `tag` in one run as TensorBoard loads it with
    `--load_fast=false` (its plugin loader, which honours restart markers;
    its data server keeps the newest value of a step)."""
    from tensorboard.backend.event_processing import (
        plugin_event_accumulator)

    accumulator = plugin_event_accumulator.EventAccumulator(
        os.path.join(log_dir, run), size_guidance={"tensors": 0})
    accumulator.Reload()
    return [(e.step, float(tf.make_ndarray(e.tensor_proto)))
            for e in accumulator.Tensors(tag)]


def check_tensorboard_layout(log_dir, history, windows, epochs):
    """Keras TensorBoard's layout: train and validation runs, one tag each
    for a metric (loss and mae) so that the two curves overlay, the
    telemetry in its groups, nothing that does not apply (loss scale,
    accumulation, workers, GPU memory) and no constants (replicas); the
    epoch values are History's, the batch values the windows'. Returns the
    train run's scalars."""
    scalars = read_scalars(log_dir)
    validation = read_scalars(log_dir, "validation")
    assert sorted(os.listdir(log_dir)) == ["metrics.jsonl", "train",
                                           "validation"]
    grouped = [f"{group}/{kind}_{name}" for kind in ("batch", "epoch")
               for group, name in [
                   ("throughput", "examples_per_sec"),
                   ("throughput", "examples_per_sec_per_replica"),
                   ("throughput", "step_time_mean"),
                   ("throughput", "step_time_max"),
                   ("input", "wait")]]
    # The time ledger: its categories and the productive share.
    grouped += [f"goodput/{name}" for name in (*CATEGORIES, "goodput")]
    assert sorted(scalars) == sorted([
        "batch_loss", "batch_mae", "batch_steps_per_second",
        "epoch_loss", "epoch_mae", "epoch_learning_rate",
        "epoch_steps_per_second", *grouped])
    assert sorted(validation) == [
        "epoch_loss", "epoch_mae", "evaluation_loss_vs_iterations",
        "evaluation_mae_vs_iterations"]
    assert scalars["batch_loss"] == [
        (r["step"], pytest.approx(r["metrics"]["loss"])) for r in windows]
    for key in ("loss", "mae"):
        assert scalars[f"epoch_{key}"] == [
            (i, pytest.approx(v))
            for i, v in enumerate(history.history[key])]
        assert validation[f"epoch_{key}"] == [
            (i, pytest.approx(v))
            for i, v in enumerate(history.history[f"val_{key}"])]
        assert validation[f"evaluation_{key}_vs_iterations"] == [
            (r["step"], pytest.approx(r["metrics"][f"val_{key}"]))
            for r in epochs]
    return scalars


def metrics_only(records):
    """The metrics records: all but the time ledger's own (kind `goodput`,
    one as each process's training begins; tests/backends/
    test_backend_goodput.py checks them)."""
    return [r for r in records if r["kind"] != "goodput"]


def check_reference_records(records):
    """The records of the reference fit: 100 samples in batches of 16 (six
    full batches and one of 4) on 2 replicas, 2 epochs, `update_freq=3`,
    Adam at 0.01. Returns the window and epoch records."""
    for record in records:
        assert tuple(record) == JSONL_KEYS
    records = metrics_only(records)
    windows = [r for r in records if r["kind"] == "window"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    # 7 batches per epoch: windows of 3, 3 and 1, then the epoch record.
    assert [r["kind"] for r in records] == (["window"] * 3 + ["epoch"]) * 2
    assert [r["steps"] for r in windows] == [3, 3, 1] * 2
    assert [r["step"] for r in windows] == [3, 6, 7, 10, 13, 14]
    assert [r["examples"] for r in windows] == [48.0, 48.0, 4.0] * 2
    assert [r["examples"] for r in epochs] == [100.0, 100.0]
    for r in records:
        assert r["examples_per_sec"] == pytest.approx(
            r["examples"] / r["seconds"], rel=1e-9)
        assert r["examples_per_sec_per_replica"] == pytest.approx(
            r["examples_per_sec"] / 2, rel=1e-9)
        assert (r["workers"], r["replicas"], r["slowest_worker"]) == (1, 2, 0)
        assert r["learning_rate"] == pytest.approx(0.01)
        assert r["memory"] == {}  # CPU only: no GPU figures, no error
        assert r["loss_scale"] is None and r["skipped_steps"] is None
    return windows, epochs
