"""Host values across workers: one compiled all-gather per strategy and size.

The logger's cross-worker statistics and the backup's agreement on a save
both need a few numbers from every worker. Run eagerly, a collective warns
("Using CollectiveAllReduceStrategy eagerly has significant overhead") and
is traced anew for every call; here it is traced once per strategy and row
size, and every later call reuses it.
"""

from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf

# strategy -> {row size: compiled gather}
_GATHERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def gather_rows(strategy: tf.distribute.Strategy,
                row: np.ndarray, num_workers: int) -> np.ndarray:
    """Every worker's `row` (float64), one row per worker in worker order.

    A collective when `num_workers > 1`: every worker must call it, in the
    same order, with a row of the same size.
    """
    row = np.asarray(row, np.float64).reshape(-1)
    if num_workers == 1:
        return row[None]
    by_size = _GATHERS.setdefault(strategy, {})
    gather = by_size.get(row.size)
    if gather is None:
        # A weak reference: the function, kept as a value of the weak map,
        # must not keep its key (the strategy) alive.
        strategy_ref = weakref.ref(strategy)

        # No autograph: nothing to convert, and a converted function is
        # written to a temporary file, which a non-chief must not leave.
        @tf.function(input_signature=[tf.TensorSpec([1, row.size],
                                                    tf.float64)],
                     autograph=False)
        def gather(value):
            live = strategy_ref()
            assert live is not None  # the caller's strategy
            distributed = live.experimental_distribute_values_from_function(
                lambda _: tf.identity(value))
            return live.gather(distributed, axis=0)

        by_size[row.size] = gather
    gathered = gather(tf.constant(row[None])).numpy()
    # One row per replica, replicas numbered worker by worker.
    return gathered.reshape(num_workers, -1, row.size)[:, 0]


def sum_over_workers(strategy: tf.distribute.Strategy, value: float,
                     num_workers: int) -> float:
    """The sum of one number over every worker (a collective when > 1)."""
    return float(gather_rows(strategy, np.array([value]),
                             num_workers)[:, 0].sum())
