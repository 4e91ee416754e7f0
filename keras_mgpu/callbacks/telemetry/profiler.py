"""`profile_steps`: a TensorBoard/xprof profile of a range of train batches,
each batch marked as a step."""

from __future__ import annotations

import warnings
from typing import Optional

import tensorflow as tf

from keras_mgpu import _fs


class _Profiler:
    """Captures the profile of batches `start` to `stop` (global steps, both
    included) into `<log_dir>/train`, holding the sinks' background writes
    meanwhile."""

    def __init__(self, steps: Optional[tuple], log_dir: str):
        self.steps = steps  # None once another profiler refused to start
        self._log_dir = log_dir
        self._sinks = None  # while profiling: whose writes are held
        self._step_trace = None

    def update(self, step: int, sinks) -> None:
        """At the begin of the batch that makes the global step `step`."""
        if self.steps is None:
            return
        start, stop = self.steps
        if self._sinks is not None and step > stop:
            self.stop()
        if self._sinks is None and start <= step <= stop:
            try:
                tf.profiler.experimental.start(
                    _fs.join(self._log_dir, "train")
                )
                self._sinks = sinks
                # Nothing of the logger's own in the profile: its background
                # writes (the first traces the event writer) can hide
                # xprof's step markers. JSONL lines are still written.
                sinks.hold()
            except tf.errors.AlreadyExistsError:
                warnings.warn(
                    "DistributedLogger: another profiler is running; "
                    f"profile_steps={self.steps} is not captured.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self.steps = None
        self.end_step()
        if self._sinks is not None:
            # A root trace event (`_r=1`) with the step number is xprof's
            # step marker: without it the overview shows no step time.
            # Keras's own batch trace has no `_r` and is not recognised.
            self._step_trace = tf.profiler.experimental.Trace(
                "train", step_num=step, _r=1)
            self._step_trace.__enter__()

    @property
    def profiling(self) -> bool:
        return self._sinks is not None

    def end_step(self) -> None:
        if self._step_trace is not None:
            trace, self._step_trace = self._step_trace, None
            trace.__exit__(None, None, None)

    def stop(self) -> None:
        self.end_step()
        if self._sinks is not None:
            sinks, self._sinks = self._sinks, None
            tf.profiler.experimental.stop()
            sinks.release()
