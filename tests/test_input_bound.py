"""The input-bound verdict: a record's input wait, less what fetching the
same batches costs when each is already there, against xprof's 5% and 20%
of the step time."""

import json
import os
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mgpu.callbacks import DistributedLogger, input_wait_summary
from keras_mgpu.callbacks.telemetry import records
from keras_mgpu.callbacks.telemetry import workers as telemetry_workers
from keras_mgpu.runtime import training_runtime


@pytest.mark.parametrize("fraction, ready, bound", [
    # 29% waited where ready batches would cost 31%: in-memory arrays on a
    # CPU step of a millisecond, not a slow pipeline.
    (0.29, 0.31, "no"),
    (0.29, 0.26, "no"),  # 3% beyond the fixed cost
    (0.29, 0.20, "moderately"),  # 9% beyond
    (0.29, 0.05, "highly"),  # 24% beyond
    (0.29, None, "highly"),  # not known: the wait alone, as before
    (0.29, 0.0, "highly"),
    (None, 0.31, None),  # not timed
])
def test_the_verdict_counts_the_wait_beyond_ready_fetches(fraction, ready,
                                                          bound):
    assert records._input_bound(fraction, ready) == bound
    label = {"no": "not", None: None}.get(bound, bound)
    assert input_wait_summary(fraction, ready=ready) == (
        "n/a" if label is None
        else f"{100 * fraction:.1f}% of step time ({label} input-bound)")


def test_a_spans_ready_share_is_its_batches_ready_fetches():
    """64 batches in 0.1 s, a ready fetch 20 us: what they cost ready is
    a share of the same 0.1 s; untimed (or unmeasured) spans have none."""
    span = records._Span()
    start = {"step": 0, "samples": 0.0, "skipped": 0, "input_wait": 0.0}
    span.add(64, start, now=10.0, timed=True)
    state = {"step": 64, "samples": 512.0, "skipped": 0, "input_wait": 0.03}
    measure = dict(batch_size=None, hand_loop=False, replicas=1,
                   loss_scaled=False)
    measured = records._measure(span, state, 10.1, ready_fetch=20e-6,
                                **measure)
    assert measured["input_wait"] == pytest.approx(0.3)
    assert measured["input_wait_ready"] == pytest.approx(
        records._ready_share(64, 20e-6, 0.1))
    assert records._ready_share(64, 20e-6, 0.1) == pytest.approx(
        2 * records._ready_share(32, 20e-6, 0.1))
    assert records._ready_share(10**6, 20e-6, 0.1) == 1.0  # at most all
    assert records._measure(span, state, 10.1, **measure)[
        "input_wait_ready"] is None
    span.untimed = True
    assert records._measure(span, state, 10.1, ready_fetch=20e-6, **measure)[
        "input_wait_ready"] is None
    # Not a key of the file: the verdict is.
    assert "input_wait_ready" not in records.JSONL_KEYS


def test_workers_are_judged_on_their_mean_wait_less_their_mean_ready_cost():
    # Waiting 30% and 24% (27% on average) where ready batches would cost
    # them 28% and 22% (25%): 2% beyond, not input-bound.
    rows = np.array([[0.001, 100.0, 0.30, 0.28], [0.001, 90.0, 0.24, 0.22]])
    record = telemetry_workers._across_workers(rows)
    assert record["input_wait"] == pytest.approx(0.27)
    assert record["input_bound"] == "no"
    assert record["worker_input_wait"]["max"] == pytest.approx(0.30)
    # A worker whose ready cost is unknown: the mean wait alone.
    rows[1, 3] = np.nan
    assert telemetry_workers._across_workers(rows)["input_bound"] == "highly"


# --- End to end ---------------------------------------------------------------

# A batch delay far beyond what the logger counts as any input's cost (ten
# ready fetches: tens of microseconds each on a CPU, 7 ms beside 8 busy
# loops on 2 cores): sleeping takes at least this long.
SLOW_BATCH_SECONDS = 0.2


def _epoch_records(tmp_path, name, *data, console=False, **fit_kwargs):
    """Three epochs of a one-layer model (steps of about a millisecond on a
    CPU, where a ready fetch is a large share); the epoch records, and the
    model."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    log_dir = str(tmp_path / name)
    model.fit(*data, epochs=3, verbose=0, callbacks=[
        DistributedLogger(log_dir, update_freq="epoch", console=console)],
        **fit_kwargs)
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "epoch"], model


def _verdict_of_its_figures(record, ready):
    """The `input_bound` a record's own wait and ready fetches give."""
    share = records._ready_share(record["steps"], ready, record["seconds"])
    return records._input_bound(record["input_wait"], share)


def _slow(x, y):
    x = tf.numpy_function(
        lambda a: (time.sleep(SLOW_BATCH_SECONDS), a)[1], [x], tf.float32,
        stateful=False)
    return tf.ensure_shape(x, (None, 8)), y


def test_each_verdict_is_its_logged_wait_less_ready_fetches_end_to_end(
        tmp_path, capsys):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2048, 8), dtype=np.float32)
    y = rng.standard_normal((2048, 1), dtype=np.float32)
    # 256 batches an epoch: the first fetch of each (the pipeline starting
    # anew, milliseconds) is a small part of it, as in a real epoch.
    in_memory, model = _epoch_records(tmp_path, "arrays", x, y,
                                      batch_size=8, console=True)
    # Measured once, before the first batch. How long it takes depends on
    # the machine's load (7 ms beside 8 busy loops on 2 cores): that it is
    # far below the slow delay shows in the slow run's verdicts below.
    runtime = training_runtime(model)
    ready = runtime.ready_fetch_seconds()
    assert ready > 0
    assert runtime.ready_fetch_seconds() == ready
    # Every fetch waited (the wait is never zero). Whether in-memory
    # arrays on a one-millisecond CPU step read as input-bound depends on
    # the machine's load (their wait and the ready fetches are both
    # microseconds): only that each verdict, and the epoch line printed
    # beside it, is the one its logged wait and the ready fetches give
    # (the thresholds have their own tests above).
    out = capsys.readouterr().out
    for r in in_memory:
        assert r["input_wait"] > 0
        assert r["input_bound"] == _verdict_of_its_figures(r, ready), r
        share = records._ready_share(r["steps"], ready, r["seconds"])
        assert input_wait_summary(r["input_wait"], ready=share) in out, out

    # A batch that sleeps 200 ms against a step of about a millisecond:
    # nearly all of each step is waited, on any machine, once the step is
    # traced. The first epoch also traces it (seconds on a loaded machine,
    # against 8 waits of 200 ms): its verdict is the one its figures give.
    slow = (tf.data.Dataset.from_tensor_slices((x[:256], y[:256]))
            .batch(32).map(_slow))
    starved, slow_model = _epoch_records(tmp_path, "slow", slow,
                                         shuffle=False)
    first, *later = starved
    assert first["input_bound"] == _verdict_of_its_figures(
        first, training_runtime(slow_model).ready_fetch_seconds()), first
    assert [r["input_bound"] for r in later] == ["highly"] * 2, starved
    assert min(r["input_wait"] for r in later) > max(
        r["input_wait"] for r in in_memory), (starved, in_memory)
