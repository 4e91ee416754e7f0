"""Cross-worker agreement: every worker decides the same (which generation
to restore, whether to stop for a SIGTERM save)."""

from __future__ import annotations

import tensorflow as tf

from keras_mgpu import strategy as strategy_lib


def sum_over_workers(strategy, value: float) -> float:
    """A real all-reduce of one number across every replica."""
    per_replica = strategy.run(
        lambda: tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, tf.constant(value, tf.float32)
        )
    )
    total = strategy.experimental_local_results(per_replica)[0].numpy()
    # Each worker's value was contributed by each of its local replicas.
    return float(total) / len(strategy.extended.worker_devices)


def check_same_generation(strategy, number: int, backup_dir: str) -> None:
    """Refuses a restore where the workers chose different generations."""
    total = sum_over_workers(strategy, float(number))
    expected = number * strategy_lib.num_workers()
    if total != expected:
        raise RuntimeError(
            f"Workers see different backups in {backup_dir} (this "
            f"worker: generation {number}). backup_dir must be storage "
            "that every worker reads the same, e.g. a shared filesystem "
            "or gs://."
        )
