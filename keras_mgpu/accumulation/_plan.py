"""`GradientAccumulationModel`'s plan for a global batch that stays the same
on any replica count: its micro-batches per optimizer step, the batch its
data must have, and a resumed window's micro-batches on this replica count.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from keras_mgpu._checks import is_positive_int

DEFAULT_ACCUM_STEPS = 4


def check_options(accum_steps: Optional[int], global_batch_size: Any,
                  micro_batch_size: Any, allow_batch_change: Any) -> None:
    """Refuses a combination that names the step's size twice, or half."""
    if not isinstance(allow_batch_change, bool):
        raise ValueError("allow_batch_change must be True or False, got "
                         f"{allow_batch_change!r}.")
    if global_batch_size is None:
        for name, value in (("micro_batch_size", micro_batch_size),
                            ("allow_batch_change", allow_batch_change)):
            if value not in (None, False):
                raise ValueError(
                    f"{name}={value!r} applies with global_batch_size, "
                    "which is not set. Pass global_batch_size too (the "
                    "samples of one optimizer step over all replicas), or "
                    f"leave {name} out."
                )
        return
    for name, value in (("global_batch_size", global_batch_size),
                        ("micro_batch_size", micro_batch_size)):
        if not is_positive_int(value):
            raise ValueError(
                f"{name} must be a positive integer, got {value!r}. With "
                "global_batch_size=B and micro_batch_size=m (samples per "
                "replica per micro-batch), each optimizer step takes "
                "B / (m * replicas) micro-batches."
            )
    if accum_steps is not None:
        raise ValueError(
            f"accum_steps={accum_steps!r} and global_batch_size="
            f"{global_batch_size} both set the optimizer step's size. Leave "
            "accum_steps out: it is planned from global_batch_size, "
            "micro_batch_size and the replica count."
        )


def accum_steps_for(global_batch_size: int, micro_batch_size: int,
                    replicas: int, allow_batch_change: bool) -> int:
    """Micro-batches per optimizer step, so that each step takes
    `global_batch_size` samples on `replicas`; refuses (or, allowed, warns
    of) a global batch that is no whole number of micro-batches."""
    step = micro_batch_size * replicas
    if global_batch_size % step == 0:
        return global_batch_size // step
    nearest = max(round(global_batch_size / step), 1)
    where = (f"global_batch_size={global_batch_size} is not a whole number "
             f"of micro-batches of micro_batch_size={micro_batch_size} on "
             f"{replicas} replica(s) ({step} samples each)")
    if not allow_batch_change:
        raise ValueError(
            f"{where}, so the optimizer step cannot keep its batch. Nothing "
            f"was trained. Use a micro_batch_size that divides "
            f"{global_batch_size} / {replicas}, a replica count that does, "
            "or pass allow_batch_change=True to train "
            f"{nearest} micro-batch(es) per step (a global batch of "
            f"{nearest * step})."
        )
    warnings.warn(
        f"{where}: training {nearest} micro-batch(es) per optimizer step, a "
        f"global batch of {nearest * step}, not {global_batch_size} "
        "(allow_batch_change=True).",
        stacklevel=3,
    )
    return nearest


def data_batch_size(mode: str, accum_steps: int, micro_batch_size: int,
                    replicas: int) -> int:
    """The batch `fit` must be given: a micro-batch on every replica in
    window mode, the whole step in in-step mode."""
    step = micro_batch_size * replicas
    return step if mode == "window" else step * accum_steps


def micro_steps_of_window(samples: float, micro_steps: int,
                          micro_samples: int) -> int:
    """A resumed window's micro-batches at `micro_samples` each: the window
    saved `samples` in `micro_steps` micro-batches (of another size if the
    replica count changed). Refuses where they do not tile it."""
    if samples % micro_samples:
        raise ValueError(
            f"The window being resumed holds {samples:g} samples "
            f"({micro_steps} micro-batch(es) of the saved run); this run's "
            f"micro-batches of {micro_samples} samples do not tile them, so "
            "its optimizer step would not take the saved run's samples. "
            "Nothing was trained. Resume on the saved replica count, or "
            "from a backup saved at a window's end (BackupAndRestore saves "
            "there with global_batch_size)."
        )
    return int(samples // micro_samples)
