"""Keras's JAX backend internals: what `GradientAccumulationModel`'s JAX
step needs from the trainer (keras/src/backend/jax/trainer.py), the
placement of a last batch that does not divide by the devices, and the
batch statistics of in-step mode's micro-batches synchronised across the
devices (keras/src/backend/jax/nn.py's `moments`)."""

from __future__ import annotations

import contextlib
import threading

import keras
from keras import tree

from keras_mgpu.compat._core import _require, _require_module
from keras_mgpu.compat.registry import _IN_STEP_BATCH_MOMENTS
from keras_mgpu.compat.registry import _JAX_ACCUMULATION, _UNEVEN_BATCHES

_JAX_TRAINER = "keras.src.backend.jax.trainer"
_JAX_NN = "keras.src.backend.jax.nn"
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

        setattr(distribute_data, "keras_mgpu_original", current)
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


# --- In-step mode's batch statistics -----------------------------------------


def _jax_moments():
    """Keras's JAX `moments` (what `keras.ops.moments` calls) and its
    module, checked."""
    module = _require_module(_JAX_NN, _IN_STEP_BATCH_MOMENTS)
    return module, _require(module, "moments", _IN_STEP_BATCH_MOMENTS,
                            params=("x", "axes", "keepdims", "synchronized"))


def check_jax_in_step_support() -> None:
    """Raises `KerasInternalsError` unless this Keras's JAX backend has the
    `moments` that `batch_moments_across` swaps (checked as an in-step
    model is wrapped)."""
    _jax_moments()


# The axis names of the `batch_moments_across` blocks each thread is in,
# innermost last; and, under `_lock`, how many blocks are open in all
# threads and Keras's own `moments` while its replacement is in place.
_axis_names = threading.local()
_open_blocks = 0
_keras_moments = None


@contextlib.contextmanager
def batch_moments_across(axis_name):
    """Within the block, in this thread, the batch statistics Keras's JAX
    backend computes (`keras.ops.moments` over axes that include the batch
    axis 0: BatchNormalization's) are those of the batch across every
    device of the `shard_map` axis `axis_name`, as plain `fit` computes
    them under `DataParallel`; moments over other axes
    (GroupNormalization's) are untouched.

    For code traced inside `jax.shard_map` over `axis_name`, whose devices
    hold equal shares of the batch: each device's mean and variance are
    gathered (one small collective per call, and one in the backward
    pass) and combined exactly (Chan et al.'s formula for equal counts:
    the mean of the variances plus the variance of the means). Keras's
    `moments` is swapped for the block only (restored when the last open
    block in any thread ends); other threads, and this one outside a
    block, get Keras's own. `axis_name` None: nothing is changed.

    Example:

    >>> def local(x):  # in jax.shard_map over "batch"  # doctest: +SKIP
    ...     with compat.batch_moments_across("batch"):
    ...         return keras.ops.moments(x, axes=[0])  # the global batch's
    """
    global _open_blocks, _keras_moments
    if axis_name is None:
        yield
        return
    with _lock:
        module, current = _jax_moments()
        if _open_blocks == 0:
            _keras_moments = getattr(current, "keras_mgpu_original", current)
            module.moments = _synchronized_moments(_keras_moments)
        _open_blocks += 1
    names = getattr(_axis_names, "stack", None)
    if names is None:
        names = _axis_names.stack = []
    names.append(axis_name)
    try:
        yield
    finally:
        names.pop()
        with _lock:
            _open_blocks -= 1
            if _open_blocks == 0:
                module.moments = _keras_moments
                _keras_moments = None


def _synchronized_moments(original):
    def moments(x, axes, keepdims=False, synchronized=False):
        names = getattr(_axis_names, "stack", None)
        if not names or synchronized or not _over_batch(x, axes):
            return original(x, axes, keepdims=keepdims,
                            synchronized=synchronized)
        return _moments_across(original, x, axes, keepdims, names[-1])

    moments.__doc__ = original.__doc__
    setattr(moments, "keras_mgpu_original", original)
    return moments


def _reduced_axes(x, axes) -> tuple:
    axes = axes if isinstance(axes, (list, tuple)) else (axes,)
    return tuple(sorted(int(a) % len(x.shape) for a in axes))


def _over_batch(x, axes) -> bool:
    return len(x.shape) > 0 and 0 in _reduced_axes(x, axes)


def _moments_across(original, x, axes, keepdims, axis_name):
    import jax
    import jax.numpy as jnp

    axes = _reduced_axes(x, axes)
    dtype = jnp.dtype(x.dtype)
    # As Keras's own: half-precision statistics are computed in float32.
    half = dtype in (jnp.float16, jnp.bfloat16)
    if half:
        x = x.astype("float32")
    # One collective: every device's mean and variance, stacked.
    means, variances = jax.lax.all_gather(
        jnp.stack(original(x, axes, keepdims=True)), axis_name, axis=1)
    mean = jnp.mean(means, axis=0)
    variance = (jnp.mean(variances, axis=0)
                + jnp.mean(jnp.square(means - mean), axis=0))
    if not keepdims:
        mean, variance = jnp.squeeze(mean, axes), jnp.squeeze(variance, axes)
    if half:
        limit = jnp.finfo(jnp.float16)
        mean = jnp.clip(mean, limit.min, limit.max).astype(dtype)
        variance = jnp.clip(variance, limit.min, limit.max).astype(dtype)
    return mean, variance
