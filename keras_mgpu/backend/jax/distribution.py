"""Distribution facts under `keras.distribution` on JAX: replicas are the
devices along the distribution's batch axis, workers are JAX processes.

`keras_mgpu.strategy`'s public facts answer through this module on
Keras's JAX backend. The worker facts start JAX's backends: in a
multi-process job, call `keras.distribution.initialize()` first.
"""

from __future__ import annotations

from typing import Optional

import jax
import keras


def current(distribution=None, call: str = "this call"):
    """`distribution`, or the one set with `keras.distribution`, or None.

    A `tf.distribute.Strategy` (or anything else) is a `TypeError`: under
    the JAX backend it distributes nothing.
    """
    if distribution is None:
        return keras.distribution.distribution()
    if not isinstance(distribution, keras.distribution.Distribution):
        raise TypeError(
            f"{call}: on Keras's JAX backend, pass a keras.distribution."
            f"Distribution (e.g. keras.distribution.DataParallel()) or None "
            f"for the one set with keras.distribution.set_distribution(), "
            f"got {distribution!r}.")
    return distribution


def num_replicas(distribution, call: str) -> int:
    """Devices along the batch axis of `distribution` (or the one set);
    1 without a distribution, where Keras trains on one device."""
    distribution = current(distribution, call)
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
    current(distribution, "is_multi_worker()")
    return jax.process_count() > 1
