"""Keras's JAX trainer internals (keras/src/backend/jax/trainer.py): what
`GradientAccumulationModel`'s JAX step needs, and the placement of a last
batch that does not divide by the devices."""

from __future__ import annotations

import threading

import keras
from keras import tree

from keras_mgpu.compat._core import _require, _require_module
from keras_mgpu.compat.registry import _JAX_ACCUMULATION, _UNEVEN_BATCHES

_JAX_TRAINER = "keras.src.backend.jax.trainer"
_lock = threading.Lock()


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


def enable_uneven_last_batches() -> bool:
    """Makes `fit`, `evaluate` and `predict` take a batch that does not
    divide by the devices of the distribution's batch axis.

    Keras (keras-team/keras#21167) raises `IndivisibleError` for such a
    batch: 65 samples in batches of 32 on 2 devices end with a batch of 1.
    With this, that batch is placed whole on every device (replicated)
    instead of split: each device computes the whole short batch, so the
    step is exactly the one-device step (the loss's mean, the metrics and
    BatchNormalization's statistics over exactly its samples), at the cost
    of one replicated batch per epoch. Batches that divide are split as
    before. Under several JAX processes each process's batch is its own
    rows, and Keras's error stays.

    Idempotent. A Keras without the module function it wraps gets
    `KerasInternalsError`, before any training.

    Returns:
        `True`: the fix is active after the call.

    Example:

    >>> from keras_mgpu import compat
    >>> compat.enable_uneven_last_batches()  # doctest: +SKIP
    True
    """
    # JAX only here: compat is imported on TensorFlow too, maybe without it.
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    with _lock:
        module = _require_module(_JAX_TRAINER, _UNEVEN_BATCHES)
        current = _require(module, "_distribute_data", _UNEVEN_BATCHES,
                           params=("data", "layouts"))
        if getattr(current, "keras_mgpu_original", None) is not None:
            return True

        def distribute_data(data, layouts=None):
            distribution = keras.distribution.distribution()
            if distribution is not None and _indivisible(
                    data, distribution, jax.process_count()):
                sharding = NamedSharding(
                    distribution.device_mesh.backend_mesh, PartitionSpec())
                return tree.map_structure(
                    lambda d: None if d is None else jax.device_put(
                        d, sharding), data)
            return current(data, layouts)

        distribute_data.keras_mgpu_original = current
        module._distribute_data = distribute_data
        return True


def _batch_axis_size(distribution) -> int:
    # As keras_mgpu.strategy.num_replicas counts them (compat imports no
    # part of keras-mgpu above it).
    mesh = distribution.device_mesh
    return mesh.shape[list(mesh.axis_names).index(
        distribution.batch_dim_name)]


def _indivisible(data, distribution, processes: int) -> bool:
    if processes > 1:
        return False  # each process's own rows: Keras's placement
    size = _batch_axis_size(distribution)
    return any(getattr(d, "ndim", 0) and d.shape[0] % size
               for d in tree.flatten(data) if d is not None)
