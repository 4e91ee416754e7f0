"""The in-step mode of `GradientAccumulationModel` under `tf.distribute`:
the whole window inside one train step, as a loop over micro-batches."""

from __future__ import annotations

from typing import TYPE_CHECKING

import tensorflow as tf

from keras_mgpu import compat

if TYPE_CHECKING:
    from keras_mgpu.backend.tensorflow.accumulation.step import _Host
else:
    _Host = object


class _InStepMixin(_Host):
    """Splits the step's batch into micro-batches and applies them at once."""

    def _in_step_train_step(self, x, y, sample_weight):
        """Replica-local: the whole window inside one step.

        The replica's share of the big batch is split into `accum_steps`
        micro-batches (the first takes the remainder when the share does
        not split evenly), run one after another in a `tf.while_loop`
        whose carried tensors sum their gradients; then one all-reduce and
        one optimizer update, as for a window.
        """
        loop = self._micro_batch_loop
        if self._loop_jit_compile:
            # One per trace, so each replica's trace gets its own.
            loop = tf.function(loop, jit_compile=True)
        grads, loss_sum, y_pred, weight = loop(x, y, sample_weight)
        compat.track_loss(
            self, loss_sum / tf.maximum(weight, 1.0), tf.cast(weight, tf.int32))
        tf.distribute.get_replica_context().merge_call(
            self._apply_window, args=(grads + [weight],))
        return self._logs(x, y, y_pred, sample_weight)

    def _micro_batch_loop(self, x, y, sample_weight):
        data = (x, y, sample_weight)
        batch_size = tf.shape(next(t for t in tf.nest.flatten(x)))[0]
        # The ceiling of batch_size / accum_steps, without an int32
        # overflow for any accum_steps up to MAX_ACCUM_STEPS.
        size = tf.maximum((batch_size - 1) // self.accum_steps + 1, 1)
        rest = tf.maximum((batch_size + size - 1) // size - 1, 0)
        first = batch_size - rest * size
        # The first micro-batch runs outside the loop: it gives the loop
        # the predictions' structure, and leaves equal, static-size
        # micro-batches to the loop (what XLA compiles).
        grads, loss, y_pred, weight = self._micro_batch(
            *_map_data(lambda t: t[:first], data))
        loss_sum = tf.cast(loss, tf.float32) * weight
        # Never longer than the batch, so that XLA, which compiles even a
        # loop that will not run, sees a valid slice of an empty share.
        rows = tf.minimum(size, batch_size)
        predictions = [
            tf.TensorArray(p.dtype, size=rest, element_shape=tf.TensorShape(
                [None]).concatenate(p.shape[1:]))
            for p in tf.nest.flatten(y_pred)
        ]
        overwrite = self._overwrite_indices

        def body(i, grads, loss_sum, predictions):
            micro = _map_data(
                lambda t: _rows(t, first + i * size, rows), data)
            step_grads, loss, step_pred, weight = self._micro_batch(*micro)
            grads = [
                tf.maximum(a, g) if j in overwrite else a + g
                for j, (a, g) in enumerate(zip(grads, step_grads))
            ]
            loss_sum += tf.cast(loss, tf.float32) * weight
            predictions = [
                array.write(i, p) for array, p in
                zip(predictions, tf.nest.flatten(step_pred))
            ]
            return i + 1, grads, loss_sum, predictions

        _, grads, loss_sum, predictions = tf.while_loop(
            lambda i, *_: i < rest, body,
            [tf.constant(0), grads, loss_sum, predictions],
            # One micro-batch's activations at a time.
            parallel_iterations=1,
        )
        y_pred = tf.nest.pack_sequence_as(y_pred, [
            tf.concat([p, array.concat()], 0) for p, array in
            zip(tf.nest.flatten(y_pred), predictions)
        ])
        return grads, loss_sum, y_pred, tf.cast(batch_size, tf.float32)


def _map_data(fn, data):
    """`fn` on every tensor of an (x, y, sample_weight) structure."""
    return tf.nest.map_structure(
        lambda t: None if t is None else fn(t), data)


def _rows(tensor, start, count):
    """`tensor[start:start + count]`, as a slice of static size under XLA."""
    rank = tensor.shape.rank
    return tf.slice(tensor, [start] + [0] * (rank - 1),
                    [count] + [-1] * (rank - 1))
