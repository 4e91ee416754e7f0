"""The shared micro-batch math of `GradientAccumulationModel`: one
micro-batch's weighted gradients, and one window's all-reduce and update."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Optional

import keras
import numpy as np
import tensorflow as tf

from keras_mgpu import compat
from keras_mgpu.backend._accumulation import MIN_LOSS_SCALE
from keras_mgpu.backend._accumulation import accumulator_dtype

if TYPE_CHECKING:
    from keras_mgpu.backend._accumulation import AccumulationHost

    class _Host(AccumulationHost):
        """For type checkers only: what the TensorFlow mixins (`step`,
        `window`, `in_step`) read from one another and from
        `AccumulationSteps` (this package's `__init__`)."""

        _loop_jit_compile: bool

        def _micro_batch(self, x: Any, y: Any, sample_weight: Any) -> Any: ...

        def _replica_max(self, strategy: Any,
                         values: list[Any]) -> list[Any]: ...

        def _apply_window(self, strategy: Any,
                          sums: Optional[list[Any]] = None) -> None: ...

        def _sync_replica_statistics(self) -> None: ...

        def _reset_window(self) -> None: ...

        def _logs(self, x: Any, y: Any, y_pred: Any,
                  sample_weight: Any) -> dict[str, Any]: ...
else:
    _Host = object


class _StepMixin(_Host):
    """The micro-batch and the window update, shared by both modes."""

    def _micro_batch(self, x, y, sample_weight):
        """Replica-local: one micro-batch's forward and backward pass.

        Returns its gradients as sums over its samples (see below), its
        loss (as Keras's `_compute_loss` gives it), its predictions and its
        sample count (float32).
        """
        batch_size = tf.shape(next(t for t in tf.nest.flatten(x)))[0]
        weight = tf.cast(batch_size, tf.float32)
        loss_scaled = isinstance(
            self.optimizer, keras.optimizers.LossScaleOptimizer
        )
        overwrite = self._overwrite_indices
        # Weighting the loss by the sample count costs one multiply;
        # weighting every gradient costs a pass over the parameters. The
        # gradients are weighted instead under a loss scale (a weighted loss
        # would push half-precision gradients n times closer to overflow)
        # and with `overwrite_with_gradient` variables (their "gradient" is
        # what Keras's own step computes: float8 layers record the
        # magnitude of the gradient flowing back, which must not be scaled).
        weight_gradients = loss_scaled or bool(overwrite)
        # Keras divides each replica's loss by the replica count (for a SUM
        # all-reduce); undone here, so the gradients are plain sums of
        # per-sample gradients: the same global sums on any replica count.
        context = tf.distribute.get_replica_context()
        weight_sum = weight * float(context.num_replicas_in_sync)
        variables = self.trainable_variables
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = compat.compute_loss(self, x, y, y_pred, sample_weight)
            objective = self.optimizer.scale_loss(loss)
            if not weight_gradients:
                objective = objective * tf.cast(weight_sum, objective.dtype)
        grads = []
        raw = tape.gradient(objective, variables)
        for i, (g, v) in enumerate(zip(raw, variables)):
            dtype = accumulator_dtype(v.dtype)
            if i in overwrite:
                # No new value: keep the current one.
                g = v.value if g is None else g
                grads.append(tf.cast(tf.convert_to_tensor(g), dtype))
                continue
            g = tf.zeros_like(v) if g is None else g
            g = tf.cast(tf.convert_to_tensor(g), dtype)
            if weight_gradients:
                g = g * tf.cast(weight_sum, dtype)
            grads.append(g)
        return grads, loss, y_pred, weight

    def _replica_max(self, strategy, values):
        """Cross-replica: the elementwise maximum over replicas of the
        per-replica `overwrite_with_gradient` values (one all-gather)."""
        if not values:
            return []
        if strategy.num_replicas_in_sync == 1:
            return [strategy.experimental_local_results(v)[0] for v in values]
        shapes = [self.trainable_variables[i].shape
                  for i in self._overwrite_indices]

        def gather(local):
            flat = tf.concat(
                [tf.reshape(tf.cast(v, tf.float32), [-1]) for v in local], 0)
            gathered = tf.distribute.get_replica_context().all_gather(
                flat[None], axis=0)
            return tf.reduce_max(gathered, axis=0)

        flat = strategy.experimental_local_results(
            strategy.extended.call_for_each_replica(gather, args=(values,))
        )[0]
        sizes = [math.prod(shape) for shape in shapes]
        return [tf.reshape(part, shape)
                for part, shape in zip(tf.split(flat, sizes), shapes)]

    def _apply_window(self, strategy, sums=None):
        """Cross-replica: one all-reduce, then one optimizer update.

        `sums`: per-replica weighted gradients and sample count, given
        directly instead of read from the accumulators.
        """
        variables = self.trainable_variables
        regular, overwrite = self._regular_indices, self._overwrite_indices
        args: tuple[list[Any], ...]
        if sums is None:
            args = ()
            # Already the maximum over the window and the replicas.
            new_values = [self._accumulators[i].value for i in overwrite]
        else:
            args = ([sums[i] for i in regular] + [sums[-1]],)
            new_values = self._replica_max(
                strategy, [sums[i] for i in overwrite])

        statistics = self._replica_statistics()

        def all_reduce(local=None):
            if local is None:
                local = _placed_reads(
                    [self._accumulators[i] for i in regular]
                    + [self._sample_count])
            # The moving statistics ride on the window's all-reduce.
            total = _sum_across_replicas(
                list(local) + _placed_reads(statistics))
            for variable, mean in zip(statistics, _means(
                    statistics, total[len(local):])):
                # A `MirroredVariable` without aggregation (as
                # BatchNormalization's) takes a replica-local assign into
                # that replica's copy alone.
                variable.assign(mean)
            total = total[:len(local)]
            scale = 1.0 / tf.maximum(total[-1], 1.0)
            out = [None] * len(variables)
            for i, g in zip(regular, total[:-1]):
                out[i] = tf.cast(g * tf.cast(scale, g.dtype),
                                 variables[i].dtype)
            # The optimizer overwrites these with their "gradient", unscaled
            # and unclipped, as it does outside the wrapper.
            for i, value in zip(overwrite, new_values):
                out[i] = tf.cast(value, variables[i].dtype)
            return out

        grads = strategy.extended.call_for_each_replica(all_reduce, args=args)
        first = [strategy.experimental_local_results(g)[0] for g in grads]
        optimizer = self.optimizer
        loss_scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        loss_scale = optimizer.dynamic_scale if loss_scaled else 1.0
        norm = tf.linalg.global_norm(
            [tf.cast(first[i], tf.float32) for i in regular]
        ) / tf.cast(loss_scale, tf.float32)

        with compat.gradients_already_reduced(optimizer):
            if loss_scaled:
                # Every replica holds the same all-reduced gradient, so the
                # first replica's finite check is the agreed one.
                finite = tf.reduce_all(
                    [tf.reduce_all(tf.math.is_finite(g)) for g in first]
                )
                tf.cond(
                    finite,
                    lambda: strategy.extended.call_for_each_replica(
                        compat.loss_scale_apply,
                        args=(optimizer, grads, variables),
                    ),
                    lambda: self._skip_window(optimizer),
                )
            else:
                strategy.extended.call_for_each_replica(
                    lambda g: optimizer.apply(g, variables), args=(grads,)
                )
        self._grad_norm.assign(norm)
        self._update_count.assign_add(1)
        self._updated.assign(1)
        if sums is None:
            self._reset_window()

    def _replica_statistics(self) -> list:
        """The variables each replica updates on its own, which every
        window averages: the moving mean and variance of each
        BatchNormalization that trains them. Stock Keras leaves them
        apart under `MirroredStrategy` (tensorflow/tensorflow#46488), so
        replicas would predict differently and a save would keep the
        first's. `synchronized=True` ones are the same on every replica."""
        if self.distribute_strategy.num_replicas_in_sync == 1:
            return []
        return [
            variable for layer in compat.sublayers(self.inner)
            if isinstance(layer, keras.layers.BatchNormalization)
            and layer.trainable and not layer.synchronized
            for variable in (layer.moving_mean, layer.moving_variance)
        ]

    def _replica_statistics_means(self) -> dict:
        """Cross-replica, outside a step: each moving statistic's mean over
        the replicas, by the variable's id, in host memory (a collective:
        every worker calls it). What a save mid-window keeps, where the
        replicas' copies part; the variables are left as they are, so the
        run trains on as it would have without the save. Empty where no
        window is open: the window's end made the copies agree."""
        statistics = self._replica_statistics()
        if not statistics or self.micro_step == 0:
            return {}
        key = tuple(id(v) for v in statistics)
        strategy = self.distribute_strategy
        if key != self._means_key:

            @tf.function
            def means():
                return strategy.experimental_local_results(
                    strategy.extended.call_for_each_replica(
                        lambda: _means(statistics, _sum_across_replicas(
                            _placed_reads(statistics)))))[0]

            self._means_key, self._means_function = key, means
        with strategy.scope():
            values = self._means_function()
        return {id(v): np.asarray(m) for v, m in zip(statistics, values)}

    def _sync_replica_statistics(self) -> None:
        """Sets every replica's moving statistics to their mean, at an
        epoch's end that leaves a window open: what follows (validation,
        `predict`, `save`, `export`) sees one set. As the update is affine
        with the same factor on every replica, the window's end (which
        averages) comes out the same, up to rounding."""
        statistics = self._replica_statistics()
        means = self._replica_statistics_means()
        with self.distribute_strategy.scope():
            for variable in statistics:
                variable.assign(means[id(variable)])

    _means_key: Optional[tuple[int, ...]] = None
    _means_function: Callable[[], Any]

    @staticmethod
    def _skip_window(optimizer):
        compat.loss_scale_skip(optimizer)
        # Halved on every overflowing window, the scale would reach 0 after
        # about 150 in a row, and the next finite window would divide its
        # zero gradient by it: NaN weights. A scale below 1 cannot help
        # (the gradient overflows unscaled), so it stops at 1.
        optimizer.dynamic_scale.assign(
            tf.maximum(optimizer.dynamic_scale, MIN_LOSS_SCALE))


def _sum_across_replicas(values):
    """A SUM all-reduce of `values`, one per dtype (one in all but a
    float64 model, whose gradients go with the float32 sample count):
    TensorFlow packs a list into one tensor, which takes one dtype."""
    groups: dict[Any, list[int]] = {}
    for i, value in enumerate(values):
        groups.setdefault(value.dtype, []).append(i)
    context = tf.distribute.get_replica_context()
    total = [None] * len(values)
    for indices in groups.values():
        reduced = context.all_reduce(
            tf.distribute.ReduceOp.SUM, [values[i] for i in indices]
        )
        for i, value in zip(indices, reduced):
            total[i] = value
    return total


def _placed_reads(variables) -> list:
    """Replica-local: each variable's local value, read on its device. A
    multi-worker all-reduce sends its result to the devices of its inputs,
    and needs them named."""
    values = []
    for variable in variables:
        with tf.device(variable.value.device):
            values.append(tf.identity(variable.value))
    return values


def _means(variables, sums) -> list:
    """Replica-local: each variable's sum over the replicas divided by
    their count."""
    replicas = tf.distribute.get_replica_context().num_replicas_in_sync
    return [total / tf.cast(replicas, total.dtype) for total in sums]
