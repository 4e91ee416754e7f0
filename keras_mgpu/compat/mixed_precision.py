"""Keras's layer and tensor internals for mixed precision
(keras/src/layers/layer.py, keras/src/backend/tensorflow/nn.py): the logits
the float32 head gives the losses (an attribute on TensorFlow; on JAX,
through `jax_nn`), whether the losses use them, and the audit's view of
layers.
"""

from __future__ import annotations

import functools

import keras

from keras_mgpu.compat import jax_nn
from keras_mgpu.compat._core import KerasInternalsError, _require
from keras_mgpu.compat.registry import _MIXED


# --- Mixed precision (keras_mgpu.mixed_precision, keras_mgpu.layers) ---------
# `keras.src.backend.tensorflow.nn._get_logits` reads this attribute on a
# softmax/sigmoid output to recover its logits for the cross-entropy losses;
# `keras.activations.softmax`/`sigmoid` set it.
KERAS_LOGITS_ATTR = "_keras_logits"


def attach_logits(output, logits, activation: str = "softmax") -> bool:
    """Gives Keras's cross-entropy losses `logits` for `output`, which is
    `activation` (`"softmax"` or `"sigmoid"`) of them.

    On TensorFlow, `logits` are attached to `output` as the attribute
    Keras's losses read. On JAX, whose arrays take no attribute, the
    pair is remembered while `output` lives (`jax_nn.remember_logits`)
    for Keras's JAX cross-entropy, which `attached_logits_problem` wraps
    to read it. Returns whether `logits` could be given (eager tensors of
    some TensorFlow builds refuse new attributes; the losses then see
    probabilities only).
    """
    if keras.backend.backend() == "jax":
        return jax_nn.remember_logits(output, logits, activation)
    try:
        setattr(output, KERAS_LOGITS_ATTR, logits)
    except AttributeError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def logits_recovered() -> bool:
    """Whether Keras's TensorFlow cross-entropy reads logits attached to
    probabilities.

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


@functools.lru_cache(maxsize=None)
def attached_logits_problem() -> str | None:
    """Why this Keras's cross-entropy losses compute the loss of an
    `attach_logits` output from its probabilities, not its logits; None
    when they use the logits.

    Measured, not assumed, once per process, on the active backend: on
    TensorFlow, `logits_recovered()`; on JAX, Keras's cross-entropy is
    wrapped first (`jax_nn.enable_logits_losses`: a Keras whose JAX
    functions moved or changed is the reason), then its three losses are
    measured under `jit` (`jax_nn.logits_losses_work`).
    """
    version = f"Keras {keras.__version__}"
    backend = keras.backend.backend()
    if backend == "jax":
        try:
            jax_nn.enable_logits_losses()
        except KerasInternalsError as error:
            return (f"{version}'s JAX losses cannot be given the head's "
                    f"logits ({error})")
        with _concrete():
            works = jax_nn.logits_losses_work()
        return None if works else (
            f"{version}'s JAX losses no longer read the logits keras-mgpu "
            "gives them")
    if backend == "tensorflow":
        return None if logits_recovered() else (
            f"{version}'s cross-entropy losses no longer read the logits "
            f"attached to probabilities (`{KERAS_LOGITS_ATTR}`)")
    return f"Keras's {backend} backend's losses read no attached logits"


def attached_logits_dropped() -> bool:
    """Whether this Keras's cross-entropy losses compute the loss of an
    `attach_logits` output from its (clipped) probabilities: measured on
    both backends (`attached_logits_problem`)."""
    return attached_logits_problem() is not None


@functools.lru_cache(maxsize=None)
def activation_logits_recovered() -> bool:
    """Whether Keras's cross-entropy losses compute the loss of Keras's
    own `keras.activations.softmax` output from its logits (on
    TensorFlow, Keras's softmax and sigmoid attach them; on JAX they
    cannot, and nothing keras-mgpu does reads them).

    Measured once per process, compiled as `fit` compiles: the
    cross-entropy of the class 40 logits below the other is 40 from the
    logits, -ln(1e-7) = 16.1 from clipped probabilities.
    """
    def probe(logits):
        return keras.losses.categorical_crossentropy(
            keras.ops.convert_to_tensor([[0.0, 1.0]]),
            keras.activations.softmax(logits))

    logits = [[20.0, -20.0]]
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        with tf.init_scope():
            loss = tf.function(probe, autograph=False)(tf.constant(logits))
    elif keras.backend.backend() == "jax":
        import jax

        with _concrete():
            loss = jax.jit(probe)(keras.ops.convert_to_tensor(logits))
    else:
        loss = probe(keras.ops.convert_to_tensor(logits))
    return float(keras.ops.convert_to_numpy(loss)[0]) > 30.0


def _concrete():
    """On JAX, a context in which a probe computes a value even when first
    asked while a step is traced."""
    import jax

    return jax.ensure_compile_time_eval()


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
