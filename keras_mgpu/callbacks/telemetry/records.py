"""The records `DistributedLogger` writes: the JSONL schema, the window and
epoch spans they measure, and the figures computed from them. Knows nothing
of sinks, devices or workers."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import numpy as np

# Every JSONL line has exactly these keys, in this order; a value that cannot
# be measured in this run is `null`.
JSONL_KEYS = (
    "kind",  # "window" (every `update_freq` steps), "epoch", "resume" or
    #          "goodput" (the time ledger alone, as training begins)
    "epoch",  # 0-based epoch index, as Keras's callbacks get it
    "step",  # the run's global step (train batches, across resumes)
    "steps",  # batches trained in the record
    "resumed_after",  # epoch records of an epoch a resume began inside: the
    #                   batches of it the interrupted run had trained (not
    #                   counted in `steps`, `seconds`, `examples`); else null
    "time",  # Unix time when the record closed
    "seconds",  # wall time of the record: first batch begin to last batch done
    "examples",  # samples trained on in the record, all replicas and workers
    "examples_per_sec",  # examples / seconds
    "examples_per_sec_per_replica",  # examples_per_sec / replicas
    "step_time_mean",  # seconds / steps
    "step_time_max",  # longest batch-begin to next-batch-begin interval
    "input_wait",  # share of `seconds` train steps spent blocked on input
    "input_bound",  # "no", "moderately", "highly": input_wait less what
    #                 fetching batches already there costs, <= 5%, > 5%,
    #                 > 20% (`input_wait_summary`)
    "learning_rate",  # the optimizer's, schedules evaluated at its iterations
    "loss_scale",  # LossScaleOptimizer's dynamic scale, else null
    "skipped_steps",  # optimizer steps skipped for overflow in the record
    "grad_norm",  # GradientAccumulationModel's last applied gradient norm
    "accum_step",  # GradientAccumulationModel's micro-batches in its window
    "memory",  # {"GPU0": {"current_bytes", "peak_bytes"}}; {} without GPUs
    "workers",  # training worker processes
    "replicas",  # replicas in sync, over all workers
    "worker_step_time",  # {"min", "mean", "max"} of step_time_mean by worker
    "worker_examples_per_sec",  # {"min", "mean", "max"} by worker
    "worker_input_wait",  # {"min", "mean", "max"} of input_wait by worker
    "slowest_worker",  # rank with the largest step_time_mean
    "metrics",  # loss and compiled metrics, global values (val_* at epochs)
    "resume",  # resume records: {"generation", "step", "saved_replicas",
    #            "replicas", "text"}; else null
    "goodput",  # the time ledger of this process's attempt when the record
    #             was written: {"time", "attempt": {"started", "pid",
    #             "launch_attempt", "job_started", "previous_ended"},
    #             "seconds": {category: seconds since "started"}}
    #             (keras_mgpu/goodput/ledger.py); `keras-mgpu goodput` reads
    #             it
    "superseded",  # true once a resume redid the record's steps (a window
    #                or epoch record of an attempt that failed after its
    #                last backup): readers skip it; else false. Last, so
    #                that it is set in place.
)
"""The keys of every `DistributedLogger` JSONL record, in order (a value
the run cannot measure is `null`); docs/telemetry.md describes each."""


@dataclasses.dataclass
class _Span:
    """A window or an epoch being measured: where it started, what it ran."""

    start: Optional[dict] = None  # counters when its first batch began
    began: Optional[float] = None  # perf_counter at its first batch begin
    steps: int = 0  # batches trained, as predicted at each batch begin
    step_max: float = 0.0  # longest batch interval
    untimed: bool = False  # a batch ran without input timing
    examples: float = 0.0  # samples counted batch by batch (hand loops)

    def add(self, steps: int, start: dict, now: float, timed: bool) -> None:
        if self.began is None:
            self.start, self.began = start, now
        self.steps += steps
        self.untimed = self.untimed or not timed


def _snapshot(counters) -> dict:
    """The runtime's counters a span is measured between."""
    return {
        "step": counters.global_step,
        "samples": counters.samples_seen,
        "skipped": counters.updates_skipped,
        "input_wait": counters.input_wait_seconds,
    }


def _measure(span: _Span, state: dict, end: float, *,
             batch_size: Optional[int], hand_loop: bool, replicas: int,
             loss_scaled: bool, ready_fetch: Optional[float] = None) -> dict:
    """A span's own figures, from its start to `state` (the counters read
    at `end`); `ready_fetch` is the runtime's `ready_fetch_seconds()`, None
    where not measured. Its `input_wait_ready` (not a JSONL key) is the
    share of `seconds` that fetching its batches costs with every batch
    already there (`_ready_share`)."""
    start = span.start
    # Measured once a batch began in it (`add`).
    assert span.began is not None and start is not None
    seconds = max(end - span.began, 1e-9)
    # What the runtime counted once the span's calls returned: a batch
    # begin predicts a call's batches, and the call that finds the end
    # of data of unknown length trains fewer (none) than predicted.
    steps = state["step"] - start["step"]
    if batch_size is not None:
        examples = float(batch_size * steps)
    elif hand_loop:
        examples = span.examples
    elif state["samples"] is not None:
        examples = state["samples"] - start["samples"]
    else:
        examples = None
    if not examples:
        # Batches trained that Keras's loss tracker never saw (a
        # hand-written loop): unknown, not zero.
        examples = None
    per_sec = None if examples is None else examples / seconds
    return {
        "steps": steps,
        "seconds": seconds,
        "examples": examples,
        "examples_per_sec": per_sec,
        "examples_per_sec_per_replica": (
            None if per_sec is None else per_sec / replicas
        ),
        "step_time_mean": seconds / steps if steps else None,
        "step_time_max": span.step_max,
        "input_wait": None if span.untimed else min(
            (state["input_wait"] - start["input_wait"]) / seconds, 1.0),
        "input_wait_ready": (
            None if span.untimed or ready_fetch is None
            else _ready_share(steps, ready_fetch, seconds)),
        "skipped_steps": (state["skipped"] - start["skipped"]
                          if loss_scaled else None),
    }


def _record(kind, epoch, step, measured, common, metrics, resume=None) -> dict:
    values = {**measured, **common, "kind": kind, "epoch": epoch,
              "step": step, "time": time.time(), "metrics": metrics,
              "resume": resume, "superseded": False}
    return {key: values.get(key) for key in JSONL_KEYS}


def _floats(values) -> dict:
    out = {}
    for key, value in dict(values).items():
        try:
            out[key] = float(np.asarray(value))
        except (TypeError, ValueError):
            continue
    return out


# A fetch timed inside the compiled train step measures more than the same
# fetch timed alone (`ready_fetch_seconds`, as the fit begins): the step's
# own start and the machine's other work land between its timestamps, from
# twice to over ten times as much on a loaded CPU. Up to this many ready
# fetches a batch is what any input costs there, not the pipeline's doing.
_READY_FETCHES_PER_BATCH = 10


def _ready_share(batches: int, ready_fetch: float, seconds: float) -> float:
    """The share of `seconds` that fetching `batches` batches costs when
    each is already there: what no input pipeline can remove."""
    return min(batches * _READY_FETCHES_PER_BATCH * ready_fetch / seconds,
               1.0)


def _input_bound(fraction: Optional[float],
                 ready: Optional[float] = None) -> Optional[str]:
    # xprof's input-pipeline analysis: "moderately" input-bound above 5% of
    # the step time waiting for input, "highly" above 20%; counted here
    # beyond what fetching batches that are already there costs (`ready`, a
    # share of the same time), which no pipeline can remove.
    if fraction is None:
        return None
    waited = fraction - (ready or 0.0)
    if waited > 0.20:
        return "highly"
    return "moderately" if waited > 0.05 else "no"


def input_wait_summary(fraction: Optional[float],
                       ready: Optional[float] = None) -> str:
    """A record's `input_wait` as the logger prints it: percent and label.

    The label is the record's `input_bound`: "moderately" input-bound
    where the wait exceeds what fetching the same batches costs when each
    is already there by more than 5% of the step time, "highly" by more
    than 20% (xprof's thresholds). The logger measures that cost (`ready`)
    as a `fit` begins: the fixed cost under any pipeline's wait, which
    `keras-mgpu bench` measures in a whole `fit` and which alone is a large
    share of a step of a few milliseconds (in-memory arrays on a CPU). Over
    several workers both are their mean.

    Args:
        fraction: A record's `input_wait` (0 to 1), or `None` where it was
            not measured.
        ready: Defaults to `None` (not known: the label reads `fraction`
            alone). The share of the same time that fetching ready
            batches costs.

    Example:

    >>> input_wait_summary(0.156)
    '15.6% of step time (moderately input-bound)'
    >>> input_wait_summary(0.29, ready=0.31)
    '29.0% of step time (not input-bound)'
    >>> input_wait_summary(None)
    'n/a'
    """
    return _summary(fraction, _input_bound(fraction, ready))


def _summary(fraction: Optional[float], bound: Optional[str]) -> str:
    """`fraction` as a percentage of step time, labelled with `bound` (a
    record's `input_bound`)."""
    if fraction is None:
        return "n/a"
    return (f"{100 * fraction:.1f}% of step time "
            f"({'not' if bound == 'no' else bound} input-bound)")
