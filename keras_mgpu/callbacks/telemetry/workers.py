"""Cross-worker figures of a record: each worker's row, gathered from every
worker, and their spread."""

from __future__ import annotations

import numpy as np

from keras_mgpu import backend
from keras_mgpu.callbacks.telemetry.records import _input_bound


_ROW = ("step_time_mean", "examples_per_sec", "input_wait",
        "input_wait_ready")


def _worker_row(measured: dict) -> np.ndarray:
    return np.array(
        [np.nan if measured.get(key) is None else measured[key]
         for key in _ROW],
        dtype=np.float64,
    )


def _across_workers(rows: np.ndarray) -> dict:
    """The cross-worker figures of a record from each worker's row (the
    columns of `_ROW`)."""
    step_time, per_sec, waited, ready = rows.T

    def spread(values):
        if np.isnan(values).any():
            return None
        return {"min": float(values.min()), "mean": float(values.mean()),
                "max": float(values.max())}

    return {
        "worker_step_time": spread(step_time),
        # Every worker's examples/s is the global figure measured over its
        # own clock, divided by the number of workers.
        "worker_examples_per_sec": spread(per_sec / len(rows)),
        "worker_input_wait": spread(waited),
        "input_wait": (
            None if np.isnan(waited).any() else float(waited.mean())
        ),
        # From the mean, the figure reported beside it, less the mean cost
        # of fetching ready batches: one rule for every record. The most
        # input-bound worker is in worker_input_wait.
        "input_bound": (
            None if np.isnan(waited).any() else _input_bound(
                float(waited.mean()),
                None if np.isnan(ready).any() else float(ready.mean()))
        ),
        "slowest_worker": int(np.argmax(step_time)),
    }


def _spread_over_workers(strategy, workers: int, measured: list) -> None:
    """Adds the cross-worker figures to each of `measured` (a window, and
    the epoch at its end): one gather for all of them."""
    rows = [_worker_row(m) for m in measured]
    gathered = backend.active().gather_rows(
        strategy, np.concatenate(rows), workers)
    width = rows[0].size
    for i, m in enumerate(measured):
        m.update(_across_workers(gathered[:, i * width:(i + 1) * width]))
