"""Keras's train-step building blocks and optimizer hooks that
`keras_mgpu.accumulation` needs (keras/src/trainers, keras/src/losses,
keras/src/optimizers/loss_scale_optimizer.py; keras-team/keras#20582).
"""

from __future__ import annotations

import contextlib
import inspect

import keras

from keras_mgpu.compat._core import (
    _internals_error,
    _require,
    _require_module,
    warn_if_untested,
)
from keras_mgpu.compat.optimizer import _keep_reduced, _tf_optimizer_class
from keras_mgpu.compat.registry import _ACCUMULATION
from keras_mgpu.compat.telemetry import loss_tracker


# --- Gradient accumulation (keras_mgpu.accumulation) -------------------------
# The train-step building blocks below are the ones Keras's own
# `TensorFlowTrainer.train_step` uses; the optimizer hooks are the
# replica-context all-reduce and the LossScaleOptimizer's two outcomes.


def check_accumulation_support() -> None:
    """Raises `KerasInternalsError` unless this Keras has everything the
    accumulation wrapper uses (checked before any model is wrapped)."""
    TFOptimizer = _tf_optimizer_class(_ACCUMULATION)
    loss_module = _require_module("keras.src.losses.loss", _ACCUMULATION)

    # Replica-local accumulators need `keras.Variable(synchronization=...)`,
    # which Keras 3.8 does not take (3.10 does).
    warn_if_untested()
    if "synchronization" not in inspect.signature(
            keras.Variable.__init__).parameters:
        raise _internals_error(
            "`keras.Variable(synchronization=...)`", _ACCUMULATION)
    _require(keras.Model, "_compute_loss", _ACCUMULATION)
    _require(loss_module, "unscale_loss_for_distribution", _ACCUMULATION)
    _require(TFOptimizer, "_all_reduce_sum_gradients", _ACCUMULATION,
             params=("self", "grads_and_vars"))
    for name in ("_stateful_handle_finite_grads",
                 "_stateful_handle_non_finite_grads"):
        _require(keras.optimizers.LossScaleOptimizer, name, _ACCUMULATION)


def compute_loss(model, x, y, y_pred, sample_weight):
    """The training loss as Keras computes it, scaled for distribution."""
    return _require(model, "_compute_loss", _ACCUMULATION)(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )


def track_loss(model, loss, batch_size) -> None:
    """Feeds `loss` to the model's `loss` metric, as Keras's train_step does."""
    loss_module = _require_module("keras.src.losses.loss", _ACCUMULATION)
    unscale = _require(loss_module, "unscale_loss_for_distribution",
                       _ACCUMULATION)
    loss_tracker(model, _ACCUMULATION).update_state(
        unscale(loss), sample_weight=batch_size
    )


@contextlib.contextmanager
def gradients_already_reduced(optimizer):
    """Stops `optimizer.apply` from all-reducing gradients in replica context.

    Keras's TF optimizer sums gradients across replicas inside `apply`. The
    accumulation wrapper has already reduced them (once, for the whole
    window), so inside this block `apply` clips, decays and updates only.
    Takes effect while tracing, which is when the all-reduce would be built.
    A Keras without the method raises rather than reducing twice.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    _require(type(inner), "_all_reduce_sum_gradients", _ACCUMULATION,
             params=("self", "grads_and_vars"))
    # `enable_exact_clipping` recognises it: no all-reduce before clipping.
    inner._all_reduce_sum_gradients = _keep_reduced
    try:
        yield
    finally:
        del inner._all_reduce_sum_gradients


def loss_scale_apply(optimizer, grads, trainable_variables) -> None:
    """LossScaleOptimizer's finite-gradient branch: unscale, apply, grow scale."""
    _require(optimizer, "_stateful_handle_finite_grads", _ACCUMULATION)(
        grads, trainable_variables)


def loss_scale_skip(optimizer) -> None:
    """LossScaleOptimizer's non-finite branch: halve the scale, skip the step."""
    _require(optimizer, "_stateful_handle_non_finite_grads", _ACCUMULATION)()
