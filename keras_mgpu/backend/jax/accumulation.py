"""`GradientAccumulationModel`'s train step on JAX (`keras.distribution`).

Keras's JAX train step is a pure function of `(state, data)`: the window's
variables are non-trainable variables of the wrapper, so they travel in
that state (and are saved and restored with the model).

- **Window mode**: each step is one micro-batch, its gradient (a sum over
  its samples) added to the accumulators; on the window's last
  micro-batch a `lax.cond` applies the window (only that branch runs).
  Under `DataParallel` the micro-batch's gradient is reduced across
  devices by XLA, as in Keras's own step, once per micro-batch.
- **In-step mode**: the step's big batch is split into `accum_steps`
  micro-batches on each device, inside `shard_map` over the distribution's
  batch axis: a `lax.scan` sums each device's gradients, then one `psum`
  reduces the window (gradient sums, sample count, loss and any float
  non-trainable state such as BatchNormalization's moving statistics,
  averaged) across devices, and one optimizer update follows. Micro-batch
  k is, globally, every device's k-th slice of its share: batch
  statistics (BatchNormalization's) are those of that global micro-batch,
  as in plain `fit` (`compat.batch_moments_across`, a small collective
  per normalization and micro-batch), so the moving statistics come out
  the same on every device.

Either way the update is `optimizer.stateless_apply` on the window's mean
gradient: clipping acts on the whole window's gradient, and
`optimizer.iterations` (and so a learning-rate schedule) counts optimizer
steps.
"""

from __future__ import annotations

import math
import types
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import keras
from jax.sharding import PartitionSpec

from keras_mgpu import compat
from keras_mgpu import strategy as strategy_lib
from keras_mgpu.backend._accumulation import MIN_LOSS_SCALE
from keras_mgpu.backend._accumulation import accumulator_dtype

# The window's variables in the order `_track_window` lists them.
_COUNTERS = ("samples", "micro_step", "grad_norm", "update_count", "updated")

if TYPE_CHECKING:
    from keras_mgpu.backend._accumulation import AccumulationHost as _Host
else:
    _Host = object


class AccumulationSteps(_Host):
    """The JAX train step of `GradientAccumulationModel`."""

    # JAX keeps 32-bit integers unless x64 is enabled.
    _COUNTER_DTYPE = "int32"

    @staticmethod
    def _check_backend_support():
        compat.check_jax_accumulation_support()

    def _prepare_backend(self):
        # A last batch that does not divide by the devices, placed whole.
        compat.enable_uneven_last_batches()
        if self.mode == "in_step":
            # Its micro-batches' batch statistics (`_in_step_sums`).
            compat.check_jax_in_step_support()

    def _compiled(self):
        pass

    @staticmethod
    def _new_window_state():
        return types.SimpleNamespace()

    def _track_window(self, state):
        # Tracked by Keras as non-trainable variables of the wrapper: JAX's
        # train step sees only the state Keras hands it.
        if self._overwrite_indices:
            raise ValueError(
                "GradientAccumulationModel on Keras's JAX backend does not "
                "accumulate variables with `overwrite_with_gradient` (float8 "
                "quantized layers) yet. Train this model with "
                "KERAS_BACKEND=tensorflow, or without float8 quantization.")
        self._window_tracked = list(state.accumulators) + [
            getattr(state, name) for name in _COUNTERS]

    # --- The train step -----------------------------------------------------

    def _accumulation_train_step(self, state, data):
        self._check_variables()
        trainable, non_trainable, optimizer_values, metrics = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if self.mode == "in_step":
            window = _WindowValues(self, non_trainable)
            grads, count, loss, y_pred, non_trainable = self._in_step_sums(
                trainable, non_trainable, optimizer_values, metrics,
                (x, y, sample_weight))
            trainable, optimizer_values = self._apply_sums(
                trainable, optimizer_values, grads, count, window)
        else:
            grads, loss, y_pred, non_trainable, count = self._micro_batch(
                trainable, non_trainable, optimizer_values, metrics,
                x, y, sample_weight)
            window = _WindowValues(self, non_trainable)
            window.add(grads, count)
            # Only the branch taken runs: no update work off the window's end.
            trainable, optimizer_values, window = jax.lax.cond(
                window.get("micro_step") >= self.accum_steps,
                self._apply_accumulated,
                lambda t, o, w: (t, o, w.closed(False)),
                trainable, optimizer_values, window)
        non_trainable = window.into(non_trainable)
        logs, metrics = compat.update_metrics(
            self, metrics, loss, x, y, y_pred, sample_weight)
        if self.log_window:
            logs["grad_norm"] = window.get("grad_norm")
            logs["accum_step"] = window.get("micro_step")
        return logs, (trainable, non_trainable, optimizer_values, metrics)

    def _micro_batch(self, trainable, non_trainable, optimizer_values,
                     metrics, x, y, sample_weight):
        """One forward and backward pass: gradients as sums over the
        micro-batch's samples (float32 for half-precision variables), its
        loss, predictions, non-trainable values and sample count."""
        count = next(t for t in jax.tree.leaves(x)).shape[0]
        loss_scaled = isinstance(
            self.optimizer, keras.optimizers.LossScaleOptimizer)

        def objective(values):
            loss, (unscaled, y_pred, new_non_trainable, _) = (
                self.compute_loss_and_updates(
                    values, non_trainable, metrics, x, y, sample_weight,
                    training=True, optimizer_variables=optimizer_values))
            # Under a loss scale the gradients are weighted instead: a
            # weighted loss would push half-precision gradients `count`
            # times closer to overflow.
            if not loss_scaled:
                loss = loss * count
            return loss, (unscaled, y_pred, new_non_trainable)

        (_, (loss, y_pred, non_trainable)), grads = jax.value_and_grad(
            objective, has_aux=True)(trainable)
        grads = [
            g.astype(accumulator_dtype(v.dtype)) * (count if loss_scaled else 1)
            for g, v in zip(grads, trainable)]
        return grads, loss, y_pred, non_trainable, jnp.float32(count)

    def _apply_accumulated(self, trainable, optimizer_values, window):
        trainable, optimizer_values = self._apply_sums(
            trainable, optimizer_values, window.accumulators(),
            window.get("samples"), window)
        return trainable, optimizer_values, window.reset()

    def _apply_sums(self, trainable, optimizer_values, sums, count, window):
        """One optimizer update with the window's mean gradient; records
        its norm and the closed window in `window`."""
        grads = [(g / jnp.maximum(count, 1.0)).astype(v.dtype)
                 for g, v in zip(sums, trainable)]
        optimizer = self.optimizer
        loss_scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        scale = 1.0
        if loss_scaled:
            scale_index = _index_of(optimizer.variables, optimizer.dynamic_scale)
            scale = optimizer_values[scale_index]
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype("float32")))
                            for g in grads)) / scale
        trainable, optimizer_values = optimizer.stateless_apply(
            optimizer_values, grads, trainable)
        if loss_scaled:
            # Halved on every overflowing window, the scale would reach 0
            # and turn the next finite window's gradient into NaN.
            optimizer_values = list(optimizer_values)
            optimizer_values[scale_index] = jnp.maximum(
                optimizer_values[scale_index], MIN_LOSS_SCALE)
        window.set("grad_norm", norm)
        window.closed(True)
        return trainable, optimizer_values

    def _in_step_sums(self, trainable, non_trainable, optimizer_values,
                      metrics, data):
        """The window's gradient sums, sample count, mean loss, predictions
        and non-trainable values: micro-batches looped on each device, one
        `psum` across the distribution's batch axis (and the batch
        statistics of each micro-batch across it)."""
        distribution = keras.distribution.distribution()
        axis = None if distribution is None else distribution.batch_dim_name
        rows = jax.tree.leaves(data)[0].shape[0]
        if axis is not None and rows % strategy_lib.num_replicas(
                distribution):
            # A short last batch, placed whole on every device
            # (`enable_uneven_last_batches`): each computes all of it.
            axis = None
        window_ids = {id(v) for v in self._window_tracked}
        model_indices = [i for i, v in enumerate(self.non_trainable_variables)
                         if id(v) not in window_ids]

        def local(trainable, non_trainable, data):
            if axis is not None:
                # Device-local values: their gradients are this device's
                # sums, not yet reduced (JAX would psum the gradient of a
                # replicated value at every micro-batch).
                trainable = jax.lax.pcast(trainable, axis, to="varying")
                non_trainable = [
                    jax.lax.pcast(v, axis, to="varying")
                    if i in model_indices and _is_float(v) else v
                    for i, v in enumerate(non_trainable)]
            # Batch statistics over the global micro-batch (every device's
            # slice of it), as plain `fit` under `DataParallel` has them.
            with compat.batch_moments_across(axis):
                grads, loss_sum, y_pred, non_trainable, count = (
                    self._window_loop(trainable, non_trainable,
                                      optimizer_values, metrics, data))
            state = [non_trainable[i] for i in model_indices]
            if axis is not None:
                floats = [i for i, v in enumerate(state) if _is_float(v)]
                devices = jax.lax.psum(1, axis)
                grads, count, loss_sum, averaged = jax.lax.psum(
                    (grads, count, loss_sum, [state[i] for i in floats]), axis)
                for i, value in zip(floats, averaged):
                    state[i] = value / devices
            return grads, count, loss_sum, y_pred, state

        if axis is None:
            result = local(trainable, non_trainable, data)
        else:
            replicated, sharded = PartitionSpec(), PartitionSpec(axis)
            result = jax.shard_map(
                local, mesh=distribution.device_mesh.backend_mesh,
                in_specs=(replicated, replicated, sharded),
                out_specs=(replicated, replicated, replicated, sharded,
                           replicated),
            )(trainable, non_trainable, data)
        grads, count, loss_sum, y_pred, state = result
        non_trainable = list(non_trainable)
        for i, value in zip(model_indices, state):
            non_trainable[i] = value
        return grads, count, loss_sum / jnp.maximum(count, 1.0), y_pred, (
            non_trainable)

    def _window_loop(self, trainable, non_trainable, optimizer_values,
                     metrics, data):
        """This device's share, split into `accum_steps` micro-batches
        (the first the shorter when it does not split evenly), the rest in
        a `lax.scan` over equal, static-size slices."""
        rows = next(t for t in jax.tree.leaves(data)).shape[0]
        size = max(math.ceil(rows / self.accum_steps), 1)
        rest = max(math.ceil(rows / size) - 1, 0)
        first = rows - rest * size
        step = lambda values, micro: self._micro_batch(  # noqa: E731
            trainable, values, optimizer_values, metrics, *micro)
        grads, loss, y_pred, non_trainable, count = step(
            non_trainable, jax.tree.map(lambda t: t[:first], data))
        loss_sum = loss.astype("float32") * count
        if rest == 0:
            return grads, loss_sum, y_pred, non_trainable, count

        def body(carry, micro):
            grads, loss_sum, non_trainable = carry
            more, loss, y_pred, non_trainable, count = step(
                non_trainable, micro)
            grads = [a + b for a, b in zip(grads, more)]
            return (grads, loss_sum + loss.astype("float32") * count,
                    non_trainable), y_pred

        tail = jax.tree.map(
            lambda t: t[first:].reshape((rest, size) + t.shape[1:]), data)
        (grads, loss_sum, non_trainable), tail_pred = jax.lax.scan(
            body, (grads, loss_sum, non_trainable), tail)
        y_pred = jax.tree.map(
            lambda head, more: jnp.concatenate(
                [head, more.reshape((rest * size,) + more.shape[2:])]),
            y_pred, tail_pred)
        return grads, loss_sum, y_pred, non_trainable, jnp.float32(rows)

    # --- The epoch's end ----------------------------------------------------

    def _finish_epoch(self):
        """Applies or drops a window the epoch's end cut short (Keras has
        put the state back into the variables by then)."""
        if self.partial_window == "carry" or self.micro_step == 0:
            return
        values = [v.value for v in self.non_trainable_variables]
        window = _WindowValues(self, values)
        if self.partial_window == "apply":
            trainable, optimizer_values = self._apply_sums(
                [v.value for v in self.trainable_variables],
                [v.value for v in self.optimizer.variables],
                window.accumulators(), window.get("samples"), window)
            for variable, value in zip(self.trainable_variables, trainable):
                variable.assign(value)
            for variable, value in zip(self.optimizer.variables,
                                       optimizer_values):
                variable.assign(value)
        else:
            window.closed(False)
        window.reset()
        for variable, value in zip(self.non_trainable_variables,
                                   window.into(values)):
            variable.assign(value)


class _WindowValues:
    """The window's variables as values within the train step's state."""

    def __init__(self, model, non_trainable):
        position = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
        self._model = model
        self._index = tuple(position[id(v)] for v in model._window_tracked)
        self._values = [non_trainable[i] for i in self._index]
        self._accumulated = len(self._index) - len(_COUNTERS)

    def get(self, name):
        return self._values[self._accumulated + _COUNTERS.index(name)]

    def set(self, name, value):
        slot = self._accumulated + _COUNTERS.index(name)
        self._values[slot] = jnp.asarray(value, self._values[slot].dtype)

    def accumulators(self):
        return self._values[:self._accumulated]

    def add(self, grads, count):
        for i, g in enumerate(grads):
            self._values[i] = self._values[i] + g
        self.set("samples", self.get("samples") + count)
        self.set("micro_step", self.get("micro_step") + 1)

    def closed(self, applied: bool):
        """Marks whether this step closed a window (and counts it)."""
        self.set("updated", int(applied))
        if applied:
            self.set("update_count", self.get("update_count") + 1)
        return self

    def reset(self):
        for i in range(self._accumulated):
            self._values[i] = jnp.zeros_like(self._values[i])
        self.set("samples", 0.0)
        self.set("micro_step", 0)
        return self

    def into(self, non_trainable):
        non_trainable = list(non_trainable)
        for i, value in zip(self._index, self._values):
            non_trainable[i] = value
        return non_trainable


# A pytree, so that `lax.cond` carries it through its branches.
jax.tree_util.register_pytree_node(
    _WindowValues,
    lambda w: (w._values, (w._model, w._index, w._accumulated)),
    lambda aux, values: _rebuilt(aux, values))


def _rebuilt(aux, values):
    window = _WindowValues.__new__(_WindowValues)
    window._model, window._index, window._accumulated = aux
    window._values = list(values)
    return window


def _index_of(variables, variable) -> int:
    return next(i for i, v in enumerate(variables) if v is variable)


def _is_float(value) -> bool:
    return jnp.issubdtype(value.dtype, jnp.floating)
