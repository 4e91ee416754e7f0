"""Keras's JAX trainer internals that `GradientAccumulationModel`'s JAX
step needs (keras/src/backend/jax/trainer.py)."""

from __future__ import annotations

from keras_mgpu.compat._core import _require
from keras_mgpu.compat.registry import _JAX_ACCUMULATION


def update_metrics(model, metrics_values, loss, x, y, y_pred, sample_weight):
    """The loss tracker and compiled metrics updated as Keras's JAX
    `train_step` updates them: `(logs, new metrics values)`."""
    update = _require(model, "_update_metrics_variables", _JAX_ACCUMULATION,
                      params=("metrics_variables", "unscaled_loss", "x", "y",
                              "y_pred", "sample_weight"))
    return update(metrics_values, loss, x, y, y_pred, sample_weight)
