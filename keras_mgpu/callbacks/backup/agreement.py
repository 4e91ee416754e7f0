"""Cross-worker agreement: every worker decides the same (which generation
to restore, whether to stop for a SIGTERM save)."""

from __future__ import annotations

from keras_mgpu import backend
from keras_mgpu import strategy as strategy_lib


def sum_over_workers(strategy, value: float) -> float:
    """The sum of one number over every worker (a collective when > 1)."""
    return backend.active().sum_over_workers(strategy, value,
                                             strategy_lib.num_workers())


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
