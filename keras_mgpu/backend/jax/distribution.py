"""Distribution facts under `keras.distribution` on JAX: replicas are the
devices along the distribution's batch axis, workers are JAX processes.

`keras_mgpu.strategy`'s public facts answer through this module on
Keras's JAX backend, and `auto_strategy()` through `auto_distribution`: a
`DataParallel` over every device, of every process of the cluster
`TF_CONFIG` or a SLURM step describes (joined with `jax.distributed`).
The worker facts start JAX's backends: in a multi-process job, call
`keras_mgpu.auto_strategy()` (or `keras.distribution.initialize()`) first.
"""

from __future__ import annotations

import contextlib

import jax
import keras

# `auto_strategy()` on JAX has its own module; the seam names it here.
from keras_mgpu.backend.jax.auto import auto_distribution  # noqa: F401
from keras_mgpu.backend.jax.auto import processes_of  # noqa: F401


def _checked(distribution, call: str):
    """`distribution`, or the one set with `keras.distribution`, or None.

    A `tf.distribute.Strategy` (or anything else) is a `TypeError`: under
    the JAX backend it distributes nothing.
    """
    if distribution is None:
        return keras.distribution.distribution()
    if not isinstance(distribution, (keras.distribution.DataParallel,
                                     keras.distribution.ModelParallel)):
        raise TypeError(
            f"{call}: on Keras's JAX backend, pass a keras.distribution "
            f"distribution (DataParallel or ModelParallel) or None "
            f"for the one set with keras.distribution.set_distribution(), "
            f"got {distribution!r}.")
    return distribution


def num_replicas(distribution, call: str) -> int:
    """Devices along the batch axis of `distribution` (or the one set);
    1 without a distribution, where Keras trains on one device."""
    distribution = _checked(distribution, call)
    if distribution is None:
        return 1
    mesh = distribution.device_mesh
    return int(mesh.shape[mesh.axis_names.index(distribution.batch_dim_name)])


def num_workers() -> int:
    return jax.process_count()


def worker_index() -> int:
    return jax.process_index()


def is_chief() -> bool:
    return jax.process_index() == 0


def is_multi_worker(distribution) -> bool:
    _checked(distribution, "is_multi_worker()")
    return jax.process_count() > 1


def of_model(model):
    """The distribution in effect (Keras keeps none per model): the one
    set with `keras.distribution`, or None on one device."""
    return keras.distribution.distribution()


def scope_of(model):
    """The distribution's scope, or no scope on one device."""
    distribution = keras.distribution.distribution()
    return contextlib.nullcontext() if distribution is None else (
        distribution.scope())


def current():
    """The distribution set with `keras.distribution`, or None."""
    return keras.distribution.distribution()


def restore(distribution) -> None:
    """Sets `distribution` again where `keras.backend.clear_session()`
    (which KerasTuner calls before each trial) dropped it."""
    if distribution is not None and keras.distribution.distribution() is None:
        keras.distribution.set_distribution(distribution)
