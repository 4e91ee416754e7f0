"""Keras's layer and tensor internals for mixed precision
(keras/src/layers/layer.py, keras/src/backend/tensorflow/nn.py): the logits
attribute of the float32 head and the audit's view of layers.
"""

from __future__ import annotations

import functools

import keras

from keras_mgpu.compat._core import _require
from keras_mgpu.compat.registry import _MIXED


# --- Mixed precision (keras_mgpu.mixed_precision, keras_mgpu.layers) ---------
# `keras.src.backend.tensorflow.nn._get_logits` reads this attribute on a
# softmax/sigmoid output to recover its logits for the cross-entropy losses;
# `keras.activations.softmax`/`sigmoid` set it.
KERAS_LOGITS_ATTR = "_keras_logits"


def attach_logits(output, logits) -> bool:
    """Attaches `logits` to `output` so Keras's cross-entropy losses use them.

    Returns whether the attribute could be set (eager tensors of some builds
    refuse new attributes; the losses then see probabilities only).
    """
    try:
        setattr(output, KERAS_LOGITS_ATTR, logits)
    except AttributeError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def logits_recovered() -> bool:
    """Whether Keras's cross-entropy reads logits attached to probabilities.

    Measured, not assumed, once per process: a categorical cross-entropy of
    deliberately wrong probabilities carrying the right logits.
    """
    import tensorflow as tf

    @tf.function(autograph=False)
    def probe():
        logits = tf.constant([[20.0, -20.0]])
        wrong = tf.constant([[0.5, 0.5]])
        attach_logits(wrong, logits)
        return keras.losses.categorical_crossentropy([[1.0, 0.0]], wrong)

    with tf.init_scope():  # also when first asked while tracing
        return float(probe()[0]) < 1e-3  # ln(2) if the logits were ignored


def attached_logits_dropped() -> bool:
    """Whether this Keras's losses stopped reading the logits attached to
    probabilities, where they did: on the TensorFlow backend,
    `not logits_recovered()`; on JAX, whose arrays take no attributes and
    whose losses read none (a float32 head's probabilities are what any
    float32 model's loss gets there), False."""
    return keras.backend.backend() == "tensorflow" and not logits_recovered()


def sublayers(layer) -> list:
    """Every layer nested in `layer` (itself excluded), depth first."""
    flatten = _require(layer, "_flatten_layers", _MIXED)
    return list(flatten(include_self=False, recursive=True))


def own_variables(layer) -> list:
    """The variables created by `layer` itself, not by its sublayers."""
    return list(_require(layer, "_trainable_variables", _MIXED)) + list(
        _require(layer, "_non_trainable_variables", _MIXED)
    )


def variable_autocasts(variable) -> bool:
    """Whether `variable` is cast to the compute dtype when read in `call`."""
    return bool(_require(variable, "_autocast", _MIXED))


def producing_layer(keras_tensor):
    """The layer whose call produced a symbolic `keras_tensor`, or None."""
    if not isinstance(keras_tensor, keras.KerasTensor):
        return None
    history = _require(keras_tensor, "_keras_history", _MIXED)
    return history[0] if history else None
