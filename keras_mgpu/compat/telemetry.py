"""What the runtime and the logger read of Keras and TensorFlow: the loss
tracker's sample count (keras/src/backend/tensorflow/trainer.py), whether
`train_on_batch` resets it, `tf.summary`'s default-writer state
(tensorflow/python/ops/summary_ops_v2.py), and the summary writer's
resource, through which TensorBoard's restart marker is written.
"""

from __future__ import annotations

import inspect

import keras
import numpy as np

from keras_mgpu.compat._core import _internals_error, _require, _require_module
from keras_mgpu.compat.keras_trainer import active_trainer_module
from keras_mgpu.compat.keras_trainer import trainer_class
from keras_mgpu.compat.registry import _RESTART_MARKER, _SUMMARIES, _TELEMETRY


# --- Telemetry (keras_mgpu.runtime, read by the callbacks) -------------------
# Keras's `train_step` (and `compat.track_loss`) feeds the loss tracker with
# `sample_weight=batch_size`, so the tracker's `count` is the number of
# samples trained on since the metrics were last reset (each epoch).
class _SummaryScope:
    """Sets this thread's default `tf.summary` writer, step and recording
    condition, and puts back what was there: what `writer.as_default(step)`
    with `tf.summary.record_if(condition)` do, without the flush of the
    writer on every exit and in a few attribute writes (it is entered
    around every train step)."""

    __slots__ = ("_state", "_new", "_old")

    def __init__(self, state, writer, step, condition):
        self._state = state
        self._new = (writer, step, condition)
        self._old = None

    def __enter__(self):
        state = self._state
        self._old = (state.writer, state.step, state.is_recording)
        state.writer, state.step, state.is_recording = self._new
        return self

    def __exit__(self, *exc):
        state, old = self._state, self._old
        assert old is not None  # set by __enter__
        state.writer, state.step, state.is_recording = old
        return False


def summary_scope(writer, step, condition) -> _SummaryScope:
    """A context in which `tf.summary` calls write to `writer` at `step`
    where `condition()` holds (TensorFlow's own summary state: it has no
    public setter without a flush per use)."""
    return _SummaryScope(check_summary_support(), writer, step, condition)


def check_summary_support():
    """TensorFlow's summary state, checked: `KerasInternalsError` unless it
    has what `summary_scope` sets (called as the logger begins)."""
    summary_ops_v2 = _require_module("tensorflow.python.ops.summary_ops_v2",
                                     _SUMMARIES)
    state = _require(summary_ops_v2, "_summary_state", _SUMMARIES)
    for name in ("writer", "step", "is_recording"):
        _require(state, name, _SUMMARIES)
    return state


def write_restart_marker(writer, step: int) -> None:
    """Writes TensorBoard's restart marker (an event with a `SessionLog`
    START) at `step` into `writer`'s file (a `tf.summary` file writer):
    TensorBoard's Python loaders drop the values of steps >= `step` that
    came before it, as its data server drops a value when its step is
    written again. `tf.summary` writes only `Summary` protos; the raw
    `ImportEvent` op takes the writer's resource."""
    import time

    import tensorflow as tf
    from tensorboard.compat.proto import event_pb2

    resource = _require(writer, "_resource", _RESTART_MARKER)
    event = event_pb2.Event(
        wall_time=time.time(), step=step,
        session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))
    with tf.init_scope():
        tf.raw_ops.ImportEvent(writer=resource,
                               event=event.SerializeToString())


def loss_tracker(model, used_for: str = _TELEMETRY):
    """The compiled model's `loss` metric (a `Mean`), or None if uncompiled."""
    if not getattr(model, "compiled", False):
        return None
    return _require(model, "_loss_tracker", used_for)


def examples_count(model):
    """The variable counting samples trained on this epoch, or None.

    Summed over replicas when read in cross-replica context. None when the
    model is not compiled (Keras creates the loss tracker in `compile`).
    """
    tracker = loss_tracker(model)
    if tracker is None:
        return None
    return _require(tracker, "count", _TELEMETRY)


def examples_seen(model) -> float | None:
    """Samples `fit` has trained on this epoch, over all replicas and workers.

    Read in cross-replica context, the tracker's on-read variable is summed
    over every replica; under MultiWorkerMirroredStrategy that is a
    collective, so every worker must call this at the same point. `None`
    when the model is not compiled.
    """
    count = examples_count(model)
    if count is None:
        return None
    return float(np.asarray(keras.ops.convert_to_numpy(count)))


def train_on_batch_resets_metrics() -> bool:
    """Whether Keras's `train_on_batch` resets the metrics (the loss
    tracker's sample count among them) at every call.

    Keras 3.15 does (`self.reset_metrics()` first thing); 3.10 does not, so
    there the count runs on over a hand-written loop. Read from the
    installed trainer's code, not its version. Remove when keras-mgpu no
    longer supports a Keras without the reset.
    """
    trainer = trainer_class(_TELEMETRY, active_trainer_module())
    method = inspect.unwrap(_require(trainer, "train_on_batch", _TELEMETRY))
    code = getattr(method, "__code__", None)
    if code is None:
        raise _internals_error(
            f"`{trainer.__name__}.train_on_batch`'s code", _TELEMETRY)
    return "reset_metrics" in code.co_names
