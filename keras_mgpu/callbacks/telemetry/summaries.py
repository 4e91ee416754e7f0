"""The model's own `tf.summary` calls, recorded at the last batch of each
window, at the window record's global step."""

from __future__ import annotations

import tensorflow as tf

from keras_mgpu import compat
from keras_mgpu import strategy as strategy_lib


class _ModelSummaries:
    """Routes `tf.summary` calls in the model's train step to a writer.

    The writer is the default only inside each train step (through the
    runtime, a few attribute writes a step), so nothing other callbacks
    write (a stock `TensorBoard`'s scalars, before, between and after
    steps) meets it or its condition. The step is a variable, not a
    Python number: the train function is compiled once, and a number
    would be frozen into it at trace time.
    """

    def __init__(self):
        self._step = None  # the chief's step for the model's summaries
        self._ops = [False]  # whether a traced step had any
        self._runtime = None  # while recording: the runtime scoping steps
        self._at = -1
        self._windows = 0

    def enter(self, runtime, writer) -> None:
        """Starts recording the summaries of `runtime`'s steps to `writer`."""
        if self._step is None:
            self._step = strategy_lib.local_variable(-1, tf.int64)
        step = self._step
        seen = self._ops

        def recording():
            # Called once per summary op while the step is traced (at every
            # write in an eager step): a model without any is never
            # recorded, and its step variable is never assigned. Kept across
            # fits: a later fit reuses the traced step.
            seen[0] = True
            return step >= 0

        self._runtime = runtime
        self._at = -1
        self._windows = 0
        runtime.scope_steps(
            lambda: compat.summary_scope(writer, step, recording))

    @property
    def recording(self) -> bool:
        return self._runtime is not None

    def record(self, on: bool) -> None:
        """Records the next step's summaries (`on`), or none."""
        if self._runtime is None:
            return
        at = self._runtime.global_step if on else -1
        if at == self._at:
            return
        if on:
            self._windows += 1
        # The assign waits for the step in flight, which reads the variable:
        # only where the traced step has summary ops, and in a fit's first
        # window (the step may not be traced yet).
        if self._ops[0] or self._windows <= 1:
            assert self._step is not None  # made by `enter`
            self._step.assign(at)
            self._at = at

    def leave(self) -> None:
        """Stops recording the model's summaries (at train end, or at the
        next train begin after a `fit` that raised)."""
        if self._runtime is not None:
            self.record(False)
            self._runtime.scope_steps(None)
            self._runtime = None
