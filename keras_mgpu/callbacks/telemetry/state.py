"""`DistributedLogger`'s state between hooks: what a `fit` runs under, and
where the run is (epoch, window, the spans they measure)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

from keras_mgpu.callbacks.telemetry.records import _Span

if TYPE_CHECKING:
    from keras_mgpu.runtime.core import TrainingRuntime


@dataclasses.dataclass
class _Fit:
    """What one `fit` (or hand-written loop) of the logger runs under."""

    runtime: TrainingRuntime
    # The tf.distribute strategy; on JAX, the keras.distribution (or None).
    strategy: Any
    workers: int
    replicas: int
    chief: bool
    num_gpus: int
    freq: float  # batches per window (inf: epoch records only)
    # Seconds a timed fetch of a batch already there takes (None: a
    # hand-written loop, whose input is not timed).
    ready_fetch: Optional[float] = None
    reader_checked: bool = False  # the reader compared with the model


@dataclasses.dataclass
class _Progress:
    """Where the logger is in the run: the epoch, its window and the spans
    they measure, and the resumes already recorded."""

    epoch: int = 0
    in_epoch: bool = False
    epoch_record: Optional[dict] = None  # the epoch's, once it closed
    epoch_span: _Span = dataclasses.field(default_factory=_Span)
    window: _Span = dataclasses.field(default_factory=_Span)
    window_id: Optional[float] = None
    last_begin: Optional[float] = None  # perf_counter at the latest batch begin
    epoch_first_step: Optional[int] = None  # global step before its first
    last: Optional[dict] = None  # counters where the next span starts
    last_batch: int = 0
    logged_resumes: set = dataclasses.field(default_factory=set)

    def begin_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.in_epoch = True
        self.epoch_record = None
        self.epoch_span = _Span()
        self.window = _Span()
        self.window_id = None
        self.last_begin = None
        self.epoch_first_step = None
