"""What a record reads from the device: metrics, the runtime's counters,
learning rate, loss scale and the accumulation state, at once (on
TensorFlow in one compiled call). The local GPUs' memory is the
runtime's too (`runtime.gpu_memory`)."""

from __future__ import annotations

from typing import Optional

import keras
import numpy as np

from keras_mgpu.callbacks.telemetry.records import _floats


def _read(model, runtime, reader: Optional[tuple], check: bool
          ) -> tuple[Optional[tuple], bool, dict]:
    """Everything a record reads from the device, at once.

    Metrics, the runtime's counters, learning rate, loss scale and the
    accumulation state, read as the runtime's backend reads device values
    (`runtime.read_device`): on TensorFlow one cached `tf.function` (one
    dispatch, one wait for the device) instead of a dozen eager reads; on
    JAX eagerly, once the train state is back in the model's variables.
    Reading the replica-summed metrics is a collective under
    MultiWorkerMirroredStrategy: every worker calls this at the same
    record boundaries.

    `reader` is what the runtime kept from earlier reads (on TensorFlow,
    `(key, concrete function)`); with `check`, it is compared with what
    the model reads now and traced anew if that changed. Returns the
    reader to keep, whether it was checked, and the values.
    """
    optimizer = getattr(model, "optimizer", None)

    def read(value):
        return _read_values(model, runtime, value)

    if optimizer is not None and not optimizer.built:
        # A hand-written loop that has not stepped the optimizer yet:
        # read eagerly, its variables may not exist.
        reader, raw = runtime.read_device(read, reader, compiled=False)
        checked = False
    else:
        checked = check
        # Once per fit (the key walks the model's metrics).
        key = _reader_key(model, runtime) if check else None
        reader, raw = runtime.read_device(read, reader, key)
    values = {k: None if v is None else np.asarray(v)
              for k, v in raw["counters"].items()}
    return reader, checked, {
        "metrics": _floats(raw["metrics"]),
        "counters": runtime.counters(values),
        "grad_norm": _scalar(raw["grad_norm"], float),
        "learning_rate": _scalar(raw["learning_rate"], float),
        "loss_scale": _scalar(raw["loss_scale"], float),
    }


def _read_values(model, runtime, value) -> dict:
    """The values a record reads (traced into the logger's reader on
    TensorFlow); `value(x)` converts a variable or tensor."""
    optimizer = getattr(model, "optimizer", None)
    window = getattr(model, "window_variables", None) or {}

    def tensor(variable):
        return None if variable is None else value(variable)

    return {
        "metrics": _metrics_result(model),
        "counters": {key: tensor(v)
                     for key, v in runtime.counter_variables().items()},
        "grad_norm": tensor(window.get("grad_norm")),
        "learning_rate": (
            None if optimizer is None
            else _learning_rate_tensor(optimizer, value)),
        "loss_scale": (
            tensor(optimizer.dynamic_scale) if isinstance(
                optimizer, keras.optimizers.LossScaleOptimizer) else None),
    }


def _reader_key(model, runtime) -> tuple:
    """What `_read_values` reads, by identity: a recompiled model (new
    optimizer or metrics) or a new runtime variable needs a new reader."""
    window = getattr(model, "window_variables", None) or {}
    return (
        id(model), id(getattr(model, "optimizer", None)),
        tuple(id(m) for m in getattr(model, "metrics", [])),
        # `applied` is the optimizer's `iterations` (the optimizer is keyed
        # above): with Keras's own accumulation a new value at every read.
        tuple(id(v) for key, v in runtime.counter_variables().items()
              if key != "applied"),
        id(window.get("grad_norm")),
    )


def _metrics_result(model) -> dict:
    """`model.get_metrics_result()` without the metrics nothing has updated
    yet (a hand-written loop), whose `result()` would raise."""
    out = {}
    for metric in getattr(model, "metrics", []):
        if not getattr(metric, "built", True):
            continue
        result = metric.result()
        if isinstance(result, dict):
            out.update(result)
        else:
            out[metric.name] = result
    return out


def _learning_rate_tensor(optimizer, value):
    try:
        # Through LossScaleOptimizer; a schedule is evaluated at the
        # optimizer's iterations.
        return value(optimizer.learning_rate)
    except (AttributeError, TypeError, ValueError):
        return None


def _scalar(value, kind):
    return None if value is None else kind(np.asarray(value))
