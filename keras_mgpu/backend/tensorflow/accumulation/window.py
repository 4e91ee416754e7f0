"""The window mode of `GradientAccumulationModel` under `tf.distribute`:
one micro-batch per step, summed into replica-local accumulators; the
window's last micro-batch all-reduces once and applies."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Optional

import tensorflow as tf

from keras_mgpu import compat

if TYPE_CHECKING:
    from keras_mgpu.backend.tensorflow.accumulation.step import _Host
else:
    _Host = object


class _WindowStepMixin(_Host):
    """The window-mode step and the partial window at epoch end."""

    @staticmethod
    def _new_window_state():
        # A tf.Module, which TensorFlow checkpoints follow, outside Keras's
        # variable tracking: the window's variables are not weights.
        return _WindowState()

    def _track_window(self, state):
        pass

    def _window_train_step(self, x, y, sample_weight):
        """Replica-local: one micro-batch, added to the window."""
        grads, loss, y_pred, weight = self._micro_batch(x, y, sample_weight)
        compat.track_loss(self, loss, tf.cast(weight, tf.int32))
        context = tf.distribute.get_replica_context()
        overwrite = self._overwrite_indices
        if self.accum_steps == 1:
            # Every micro-batch is a whole window: skip the accumulators.
            context.merge_call(self._apply_window, args=(grads + [weight],))
        else:
            for i in self._regular_indices:
                self._accumulators[i].assign_add(grads[i])
            self._sample_count.assign_add(weight)
            context.merge_call(
                self._end_micro_step, args=([grads[i] for i in overwrite],))
        return self._logs(x, y, y_pred, sample_weight)

    def _end_micro_step(self, strategy, overwrite_grads=()):
        """Cross-replica: count the micro-batch; on the window's last, apply."""
        maxima = self._replica_max(strategy, list(overwrite_grads))
        for i, value in zip(self._overwrite_indices, maxima):
            accumulator = self._accumulators[i]
            accumulator.assign(tf.maximum(accumulator.value, value))
        self._micro_step.assign_add(1)
        closes = self._micro_step.value >= self.accum_steps
        self._updated.assign(tf.cast(closes, "int64"))
        tf.cond(
            closes,
            lambda: self._apply_window(strategy),
            lambda: None,
        )

    def _reset_window(self):
        for i, accumulator in enumerate(self._accumulators):
            if i in self._overwrite_indices:
                accumulator.assign(tf.fill(
                    accumulator.shape,
                    tf.constant(-math.inf, accumulator.dtype)))
            else:
                accumulator.assign(tf.zeros_like(accumulator.value))
        self._sample_count.assign(0.0)
        self._micro_step.assign(0)

    def _finish_epoch(self):
        """Handles a window cut short by the end of an epoch."""
        if self.micro_step == 0:
            return
        if self.partial_window != "apply":
            # What follows (validation, a save, the next fit's `predict`)
            # sees one set of moving statistics; applying averages them.
            self._sync_replica_statistics()
        if self.partial_window == "carry":
            return
        if self._epoch_end_function is None:
            strategy = self.distribute_strategy

            @tf.function
            def epoch_end():
                if self.partial_window == "apply":
                    self._apply_window(strategy)
                else:
                    self._reset_window()
                    self._updated.assign(0)

            self._epoch_end_function = epoch_end
        with self.distribute_strategy.scope():
            self._epoch_end_function()

    _epoch_end_function: Optional[Callable[[], Any]] = None


class _WindowState(tf.Module):
    """Holds the window's variables away from Keras's weight tracking."""
