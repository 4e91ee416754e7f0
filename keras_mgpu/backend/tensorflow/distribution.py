"""Distribution facts under `tf.distribute`: replicas of the strategy in
scope, workers of the `TF_CONFIG` cluster.

`keras_mgpu.strategy`'s public facts answer through this module on
Keras's TensorFlow backend.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from keras_mgpu import strategy as strategy_lib
from keras_mgpu.cluster import cluster_info


def num_replicas(strategy: Optional[tf.distribute.Strategy], call: str) -> int:
    """Replicas of `strategy` (or the scope's), over all workers; `call`
    names the caller in the error raised outside every scope."""
    return int(strategy_lib.require_strategy(
        strategy, call).num_replicas_in_sync)


def num_workers() -> int:
    return cluster_info().num_workers


def worker_index() -> int:
    return cluster_info().worker_index


def is_chief() -> bool:
    return cluster_info().is_chief


def is_multi_worker(strategy: Optional[tf.distribute.Strategy]) -> bool:
    if strategy is None:
        strategy = tf.distribute.get_strategy()
    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and num_workers() > 1
    )


def of_model(model) -> tf.distribute.Strategy:
    """The strategy `model` was built under."""
    return model.distribute_strategy


def scope_of(model):
    """The scope to create or assign `model`'s variables in."""
    return model.distribute_strategy.scope()


def current():
    """The strategy of the current scope."""
    return tf.distribute.get_strategy()


def restore(distribution) -> None:
    """Nothing to restore: `keras.backend.clear_session()` leaves
    `tf.distribute` scopes alone."""
