"""Keras's JAX trainer internals that `GradientAccumulationModel`'s JAX
step needs (keras/src/backend/jax/trainer.py)."""

from __future__ import annotations

import keras

from keras_mgpu.compat._core import _require
from keras_mgpu.compat.registry import _JAX_ACCUMULATION


def _update_metrics_variables(owner):
    return _require(owner, "_update_metrics_variables", _JAX_ACCUMULATION,
                    params=(*_SELF[isinstance(owner, type)], "metrics_variables",
                            "unscaled_loss", "x", "y", "y_pred",
                            "sample_weight"))


# The function on the class takes `self`; bound to a model, it does not.
_SELF = {True: ("self",), False: ()}


def check_jax_accumulation_support() -> None:
    """Raises `KerasInternalsError` unless this Keras's JAX trainer has what
    the accumulation wrapper's JAX step uses (checked as a model is
    wrapped)."""
    _update_metrics_variables(keras.Model)


def update_metrics(model, metrics_values, loss, x, y, y_pred, sample_weight):
    """The loss tracker and compiled metrics updated as Keras's JAX
    `train_step` updates them: `(logs, new metrics values)`."""
    return _update_metrics_variables(model)(
        metrics_values, loss, x, y, y_pred, sample_weight)
