"""Keras's JAX cross-entropy (keras/src/backend/jax/nn.py): the float32
logits of `FP32OutputHead`'s softmax or sigmoid output, for the losses.

On TensorFlow the head attaches its logits to its output as an attribute,
which Keras's cross-entropy reads (`_get_logits`). A JAX array takes no
attribute, and Keras's JAX cross-entropy reads none: it clips the
probabilities to `[epsilon, 1 - epsilon]`. Here instead the head
remembers which output object it returned and its logits
(`remember_logits`), for as long as that object lives (a weak reference:
nothing is kept for an output that is gone, and a later array given the
same `id` is not that output), and `enable_logits_losses` wraps Keras's
JAX `categorical_crossentropy`, `sparse_categorical_crossentropy` and
`binary_crossentropy`, the module functions `keras.ops` calls at call
time: given exactly a remembered output (`is`), with `from_logits=False`,
the matching activation (softmax for the categorical ones, over the last
axis; sigmoid for the binary one), they compute the loss from the logits
with `from_logits=True`; given anything else they are Keras's own.

Identity holds along Keras's loss path, eagerly and while tracing under
`jit`, `grad`, `lax.scan` and `shard_map`: `Loss.__call__` and the loss
functions convert `y_pred` with `ops.convert_to_tensor`, which returns a
JAX array (or tracer) of the requested dtype as is. An output changed on
the way (squeezed, masked with `ignore_class`, cast to another dtype) is
a new array: its loss is Keras's own, from probabilities, as on
TensorFlow, where such a tensor loses its attribute too.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import keras

from keras_mgpu.compat._core import _lock, _require, _require_module
from keras_mgpu.compat.registry import _JAX_LOGITS

_JAX_NN = "keras.src.backend.jax.nn"

# id(output) -> (weak reference to output, logits, activation name). Taken
# out when the output is collected; reentrant, for a collection that
# happens while the lock is held.
_remembered: dict[int, tuple[weakref.ref, Any, str]] = {}
_remembered_lock = threading.RLock()


def remember_logits(output, logits, activation: str) -> bool:
    """Remembers that `output` is `activation` (`"softmax"` or
    `"sigmoid"`) of `logits`, while `output` lives; returns whether it
    could (an object that takes no weak reference is not remembered)."""
    key = id(output)

    def forget(ref, key=key):
        with _remembered_lock:
            entry = _remembered.get(key)
            if entry is not None and entry[0] is ref:
                del _remembered[key]

    try:
        ref = weakref.ref(output, forget)
    except TypeError:
        return False
    with _remembered_lock:
        _remembered[key] = (ref, logits, activation)
    return True


def remembered_logits(output, activation: str):
    """The logits `output` was computed from by `activation`, if
    `remember_logits` was told so about this very object; else None."""
    with _remembered_lock:
        entry = _remembered.get(id(output))
    if entry is None or entry[0]() is not output or entry[2] != activation:
        return None
    return entry[1]


def _last_axis(axis, output) -> bool:
    rank = len(getattr(output, "shape", ()))
    return axis == -1 or (rank > 0 and axis == rank - 1)


def _categorical(original):
    def crossentropy(target, output, from_logits=False, axis=-1):
        logits = (None if from_logits or not _last_axis(axis, output)
                  else remembered_logits(output, "softmax"))
        if logits is not None:
            return original(target, logits, from_logits=True, axis=axis)
        return original(target, output, from_logits=from_logits, axis=axis)

    return crossentropy


def _binary(original):
    def binary_crossentropy(target, output, from_logits=False):
        logits = None if from_logits else remembered_logits(output, "sigmoid")
        if logits is not None:
            return original(target, logits, from_logits=True)
        return original(target, output, from_logits=from_logits)

    return binary_crossentropy


_PARAMS = ("target", "output", "from_logits")
_WRAPPERS = {
    "categorical_crossentropy": _categorical,
    "sparse_categorical_crossentropy": _categorical,
    "binary_crossentropy": _binary,
}


def enable_logits_losses() -> bool:
    """Makes Keras's JAX cross-entropy losses read the logits
    `remember_logits` keeps for an output.

    Idempotent; acts only on an output `remember_logits` was told about
    (`FP32OutputHead`'s), every other call is Keras's own. A Keras without
    the module or one of its three functions, or with other parameters for
    one, gets `KerasInternalsError` and nothing is changed.

    Returns:
        `True`: the three losses read remembered logits after the call.
    """
    with _lock:
        module = _require_module(_JAX_NN, _JAX_LOGITS)
        current = {
            "categorical_crossentropy": _require(
                module, "categorical_crossentropy", _JAX_LOGITS,
                params=_PARAMS + ("axis",)),
            "sparse_categorical_crossentropy": _require(
                module, "sparse_categorical_crossentropy", _JAX_LOGITS,
                params=_PARAMS + ("axis",)),
            "binary_crossentropy": _require(
                module, "binary_crossentropy", _JAX_LOGITS, params=_PARAMS),
        }
        for name, function in current.items():
            if getattr(function, "keras_mgpu_original", None) is not None:
                continue
            wrapper = _WRAPPERS[name](function)
            wrapper.__name__ = name
            wrapper.__doc__ = function.__doc__
            wrapper.keras_mgpu_original = function
            setattr(module, name, wrapper)
        return True


def logits_losses_work() -> bool:
    """Whether Keras's JAX cross-entropy losses, called as `fit` calls them
    (`keras.losses` classes, under `jit`), compute the loss of a
    remembered output from its logits: measured on deliberately wrong
    probabilities carrying the right logits, for each of the three."""
    import jax
    import jax.numpy as jnp

    def losses(logits, wrong_softmax, wrong_sigmoid):
        remember_logits(wrong_softmax, logits, "softmax")
        remember_logits(wrong_sigmoid, logits, "sigmoid")
        return jnp.stack([
            keras.losses.CategoricalCrossentropy()(
                jnp.array([[1.0, 0.0]]), wrong_softmax),
            keras.losses.SparseCategoricalCrossentropy()(
                jnp.array([0]), wrong_softmax),
            keras.losses.BinaryCrossentropy()(
                jnp.array([[1.0, 0.0]]), wrong_sigmoid),
        ])

    # Probabilities of 0.5 give about ln(2) = 0.69 per loss (0.69 for the
    # binary mean too); the logits, about 2e-9.
    values = jax.jit(losses)(jnp.array([[20.0, -20.0]]),
                             jnp.full((1, 2), 0.5), jnp.full((1, 2), 0.5))
    return bool(jnp.all(values < 1e-3))
