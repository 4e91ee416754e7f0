"""Host values across JAX processes, for the logger's cross-worker figures
and the backup's agreement."""

from __future__ import annotations

import numpy as np
from jax.experimental import multihost_utils


def gather_rows(distribution, row: np.ndarray, num_workers: int) -> np.ndarray:
    """Every process's `row` (float64), one row per process in process
    order. A collective when `num_workers > 1`: every process must call it,
    in the same order, with a row of the same size."""
    row = np.asarray(row, np.float64).reshape(-1)
    if num_workers == 1:
        return row[None]
    # float64 needs jax_enable_x64; a float32 and its float32 remainder
    # carry about 48 of its 53 bits (relative error below 1e-14).
    high = row.astype(np.float32)
    low = (row - high.astype(np.float64)).astype(np.float32)
    gathered = np.asarray(multihost_utils.process_allgather(
        np.stack([high, low])), np.float64)
    return gathered[:, 0] + gathered[:, 1]


def sum_over_workers(distribution, value: float, num_workers: int) -> float:
    """The sum of `value` over every process (a collective, as above)."""
    return float(gather_rows(distribution, np.array([value]),
                             num_workers).sum())
