"""`GradientAccumulationModel`: one optimizer step per N micro-batches."""

from __future__ import annotations

import math
import weakref

import keras
import tensorflow as tf

from keras_mgpu._checks import is_positive_int
from keras_mgpu import compat

PARTIAL_WINDOW_MODES = ("apply", "carry", "drop")
MODES = ("window", "in_step")
# The loss scale never drops below this under GradientAccumulationModel.
MIN_LOSS_SCALE = 1.0
# The largest `accum_steps`: in-step mode splits a batch in TensorFlow's
# int32 arithmetic (`tf.shape`).
MAX_ACCUM_STEPS = 2**31 - 1


@keras.saving.register_keras_serializable(package="keras_mgpu")
class GradientAccumulationModel(keras.Model):
    """Wraps a model so that `fit` takes one optimizer step per N micro-batches.

    Two modes, the same arithmetic:

    | | `mode="window"` (default) | `mode="in_step"` |
    |---|---|---|
    | batch the dataset to | the micro-batch | the big batch (N micro-batches) |
    | one `fit` step is | one micro-batch | one optimizer step |
    | micro-batches run | one per step, summed in variables | in a loop inside the step |
    | a short last batch | `partial_window` decides | one smaller, exact step |
    | metrics and callbacks see | each micro-batch | each big batch |
    | `jit_compile=True` | one device only | compiles the micro-batch loop, any replica count |
    | `BatchNormalization(synchronized=True)` | supported | refused |

    In-step mode does less work per micro-batch (no accumulator variables
    to read and write, one Keras step per N micro-batches) and holds one
    micro-batch's activations at a time (the loop is not unrolled), plus
    the gradient sums; window mode keeps the progress bar and callbacks per
    micro-batch. Both work with `steps_per_execution` on any replica count.

    Each optimizer step applies the gradient of the mean loss over every
    sample of the window's `accum_steps` micro-batches on every replica,
    exactly as one step on the concatenated big batch would: micro-batches are
    weighted by their real sample count (so sample weights and short
    micro-batches come out right), clipping (`clipnorm`, `clipvalue`,
    `global_clipnorm`) acts once on the accumulated, all-reduced gradient,
    and `optimizer.iterations`, learning-rate schedules and optimizer moments
    advance once per optimizer step.

    Under `MirroredStrategy` and `MultiWorkerMirroredStrategy`, each replica
    accumulates its own gradients locally; the window's last micro-batch does
    exactly one cross-replica all-reduce (gradients and sample counts in one
    batch), then one optimizer update. The other micro-batches communicate
    nothing (except in float8 training, below).

    Under `mixed_float16` (a `LossScaleOptimizer`), the finite check is made
    on the all-reduced window gradient, so every replica agrees; a window with
    an overflow is dropped whole, its accumulators are reset, and the loss
    scale is updated once per window, and never drops below
    `MIN_LOSS_SCALE` (1.0): overflowing windows go on being skipped, and the
    weights stay finite. `mixed_bfloat16` needs no loss scale.

    The accumulators, the sample count and the micro-step counter are
    saved with this model, so `save_weights`, `model.save` and checkpoints
    carry a half-finished window. The accumulators hold sums of per-sample
    gradients over the window's samples, whatever the replica count (each
    replica holds its share; reading sums them), so a window saved on 2
    replicas resumes exactly on 1 or 4 with the same global batch. They are
    not weights of the model: `weights`, `get_weights`, `count_params` and
    `summary` show the wrapped model's parameters only, as the wrapped model
    itself would. In in-step mode a window never outlives its step, so there
    are no accumulators; the counters are saved as in window mode.

    Variables with `overwrite_with_gradient` (the scales and amax histories
    of layers quantized with `model.quantize("float8")`) are handled as
    Keras's optimizer handles them: their "gradient" is their new value,
    unweighted by the sample count and never clipped; the window keeps its
    elementwise maximum over the micro-batches (as
    `gradient_accumulation_steps` does) and over the replicas, and the
    window's update overwrites them with it. On more than one replica, that
    maximum is taken on every micro-batch (one small all-gather of these
    variables, a few kilobytes per quantized layer), so a saved window holds
    it; models without such variables communicate nothing between updates.

    The window is public state (as optax's `MultiSteps` makes it):
    `micro_step`, `update_count`, `has_updated` and `grad_norm`, and
    `window_variables` for reading them inside a compiled function.

    BatchNormalization sees each micro-batch, not the big batch: its batch
    statistics are the micro-batch's and its moving averages are updated
    once per micro-batch (N times per optimizer step), as in plain `fit` at
    the micro-batch size and with Keras's `gradient_accumulation_steps`; so
    a model with BatchNormalization does not train exactly as on the big
    batch. In window mode `BatchNormalization(synchronized=True)` computes
    them over all replicas' micro-batches.

    The wrapper has the wrapped model's `output_names`: losses, metrics,
    loss weights and targets keyed by output name work as they do for the
    wrapped model.

    The loss is assumed to be a mean over samples (Keras's default
    `"sum_over_batch_size"` reduction).

    Args:
        model: The Keras model to train (Sequential, Functional or
            subclassed, built or not). Compile the wrapper, not this model.
            It stays reachable as `.inner` for export without the wrapper.
        accum_steps: Defaults to 4. Micro-batches per optimizer step, an
            integer from 1 to `MAX_ACCUM_STEPS` (2**31 - 1). 1 behaves like
            plain `fit`.
        partial_window: Defaults to `"apply"`. What happens to a window that
            the end of an epoch cuts short:
            `"apply"`: apply it, weighted by its real sample count (10
            micro-batches with `accum_steps=4` give 3 updates, the last
            averaging 2 micro-batches);
            `"carry"`: keep accumulating into the next epoch (and the next
            `fit` call);
            `"drop"`: discard it.
        mode: Defaults to `"window"`. `"window"`: each dataset batch is a
            micro-batch; `"in_step"`: each dataset batch is the big batch,
            split into `accum_steps` micro-batches inside the train step
            (each replica's share is split; when it does not divide
            evenly, the first micro-batch is the shorter one).
            `partial_window` must stay `"apply"` in this mode.
        log_window: Defaults to `False`. Whether `fit` adds the window's
            state to its logs (and so to the progress bar and `History`):
            `grad_norm` (global norm of the gradient of the last applied
            step, before clipping) and `accum_step` (micro-batches in the
            current window after this batch; 0 right after an update).
        **kwargs: Passed to `keras.Model` (e.g. `name`).

    Logs: by default `fit` logs exactly what it logs for the wrapped model
    (the loss and the compiled metrics). The window's state changes once
    per optimizer step at most, so it stays off the progress bar; it is
    always readable as `grad_norm` and `micro_step` (and
    `window_variables` in compiled code), in `keras_mgpu.runtime`'s
    counters and in `keras_mgpu.callbacks.DistributedLogger`'s records.
    `log_window=True` adds it to the logs.

    Example:

    >>> import numpy as np, keras, keras_mgpu
    >>> inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model = keras_mgpu.GradientAccumulationModel(inner, accum_steps=4)
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> x, y = np.ones((64, 4)), np.ones((64, 1))
    >>> _ = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    >>> int(model.optimizer.iterations.numpy())  # 8 micro-batches / 4
    2
    >>> model.count_params() == inner.count_params()  # no accumulators
    True
    >>> inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model = keras_mgpu.GradientAccumulationModel(
    ...     inner, accum_steps=4, mode="in_step")
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> _ = model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    >>> int(model.optimizer.iterations.numpy())  # 2 big batches of 4 x 8
    2
    """

    def __init__(
        self,
        model: keras.Model,
        accum_steps: int = 4,
        partial_window: str = "apply",
        log_window: bool = False,
        mode: str = "window",
        **kwargs,
    ):
        compat.check_accumulation_support()
        _validate(model, accum_steps, partial_window, mode)
        if not isinstance(log_window, bool):
            raise ValueError(
                f"log_window must be True or False, got {log_window!r}."
            )
        super().__init__(**kwargs)
        self.inner = model
        self.accum_steps = accum_steps
        self.partial_window = partial_window
        self.log_window = log_window
        self.mode = mode
        self._window_state = None
        model._keras_mgpu_wrapper = weakref.ref(self)
        compat.enable_multi_step_fit()
        if isinstance(
            tf.distribute.get_strategy(), tf.distribute.MultiWorkerMirroredStrategy
        ):
            compat.enable_multi_worker_fit()
        if model.built:
            self._create_state()
            self.built = True

    # --- Keras plumbing -----------------------------------------------------

    def build(self, input_shape):
        if not self.inner.built:
            # A symbolic call builds every kind of model, including
            # subclassed ones whose `build` creates nothing.
            self.inner(
                keras.tree.map_shape_structure(keras.KerasTensor, input_shape)
            )
        self._create_state()
        self.built = True

    def call(self, inputs, training=None):
        return self.inner(inputs, training=training)

    @property
    def output_names(self):
        """The wrapped model's `output_names` (None if it has none), so
        losses, metrics and targets keyed by output name work as they do
        for the wrapped model."""
        inner = self.__dict__.get("inner")
        return getattr(inner, "output_names", None)

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        _check_inner_not_compiled(self.inner)
        if self.mode == "in_step":
            _check_no_synchronized_batch_norm(self.inner)
        optimizer = keras.optimizers.get(optimizer)
        inner_opt = getattr(optimizer, "inner_optimizer", optimizer)
        if inner_opt.gradient_accumulation_steps:
            raise ValueError(
                f"The optimizer sets gradient_accumulation_steps="
                f"{inner_opt.gradient_accumulation_steps}, and "
                f"GradientAccumulationModel already accumulates "
                f"(accum_steps={self.accum_steps}). Remove "
                "gradient_accumulation_steps from the optimizer."
            )
        super().compile(optimizer, *args, **kwargs)
        self._loop_jit_compile = False
        if self.mode == "in_step" and self.jit_compile:
            # Keras would compile the whole step, cross-device work included,
            # which XLA cannot do under a strategy: only the replica-local
            # micro-batch loop is compiled.
            self._loop_jit_compile = True
            self.jit_compile = False

    _loop_jit_compile = False

    def compile_from_config(self, config):
        # Keras skips this for models that override `compile`; the override
        # only validates, so loading may compile as Keras would.
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def fit(self, *args, callbacks=None, **kwargs):
        _check_inner_not_compiled(self.inner)
        if self.mode == "window":
            callbacks = [_WindowEnd(self)] + list(callbacks or [])
        return super().fit(*args, callbacks=callbacks, **kwargs)

    def get_config(self):
        return {
            **super().get_config(),
            "model": keras.saving.serialize_keras_object(self.inner),
            "accum_steps": self.accum_steps,
            "partial_window": self.partial_window,
            "log_window": self.log_window,
            "mode": self.mode,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["model"] = keras.saving.deserialize_keras_object(
            config["model"], custom_objects=custom_objects
        )
        return cls(**config)

    # --- State --------------------------------------------------------------

    def _create_state(self):
        if self._window_state is not None:
            return
        variables = self.inner.trainable_variables
        # Ids, not the variables: a list of variables here would be tracked
        # as this model's own weights a second time.
        self._accumulated_ids = tuple(id(v) for v in variables)
        overwrite = tuple(
            bool(getattr(v, "overwrite_with_gradient", False))
            for v in variables
        )
        self._overwrite_indices = tuple(
            i for i, o in enumerate(overwrite) if o)
        self._regular_indices = tuple(
            i for i, o in enumerate(overwrite) if not o)
        # Replica-local sums: SUM on read, so reading (or saving) gives the
        # total over replicas, and writing a value back divides it among them.
        local = dict(
            trainable=False, synchronization="on_read", aggregation="sum"
        )
        accumulators = []
        # In-step mode sums in the step's own tensors.
        windowed = () if self.mode == "in_step" else variables
        for i, (v, o) in enumerate(zip(windowed, overwrite)):
            if o:
                # A running maximum, the same on every replica (maxed over
                # them each micro-batch), starting below any value.
                accumulators.append(keras.Variable(
                    keras.initializers.Constant(-math.inf), shape=v.shape,
                    dtype=_accumulator_dtype(v.dtype), trainable=False,
                    name=f"accumulator_{i}",
                ))
            else:
                accumulators.append(keras.Variable(
                    "zeros", shape=v.shape, dtype=_accumulator_dtype(v.dtype),
                    name=f"accumulator_{i}", **local,
                ))
        # Initializers, not values: an unbuilt model is built inside Keras's
        # stateless scope, where only deferred initialisation is allowed.
        scalar = dict(initializer="zeros", shape=())
        state = _WindowState()
        state.accumulators = accumulators
        state.samples = keras.Variable(
            **scalar, dtype="float32", name="accumulated_samples", **local
        )
        state.micro_step = keras.Variable(
            **scalar, dtype="int64", trainable=False, name="micro_step"
        )
        state.grad_norm = keras.Variable(
            **scalar, dtype="float32", trainable=False, name="grad_norm"
        )
        state.update_count = keras.Variable(
            **scalar, dtype="int64", trainable=False, name="update_count"
        )
        state.updated = keras.Variable(
            **scalar, dtype="int64", trainable=False, name="has_updated"
        )
        # Held outside Keras's variable tracking (in a tf.Module, which
        # TensorFlow checkpoints still follow), so that they are not
        # weights; `save_own_variables` saves them.
        self._window_state = state

    def _state(self, name):
        state = self.__dict__.get("_window_state")
        return None if state is None else getattr(state, name)

    _accumulators = property(lambda self: self._state("accumulators"))
    _sample_count = property(lambda self: self._state("samples"))
    _micro_step = property(lambda self: self._state("micro_step"))
    _grad_norm = property(lambda self: self._state("grad_norm"))
    _update_count = property(lambda self: self._state("update_count"))
    _updated = property(lambda self: self._state("updated"))

    def _saved_variables(self) -> list:
        # The order these had as Keras-tracked variables of this model, so
        # weight files written before they left the weights still load.
        return list(self._accumulators) + [
            self._sample_count, self._micro_step, self._grad_norm,
            self._update_count, self._updated,
        ]

    def save_own_variables(self, store):
        """Saves the accumulation window (the wrapped model saves itself)."""
        if self._window_state is None:
            return
        for i, variable in enumerate(self._saved_variables()):
            store[f"{i}"] = variable

    def load_own_variables(self, store):
        """Restores the accumulation window saved by `save_own_variables`."""
        saved = [] if self._window_state is None else self._saved_variables()
        if len(store.keys()) != len(saved):
            raise ValueError(
                f"GradientAccumulationModel {self.name!r} expected "
                f"{len(saved)} window variables (mode={self.mode!r}: "
                f"{len(self._accumulators)} accumulators, plus 5), but the "
                f"file has {len(store.keys())}. Build the wrapper (e.g. "
                "wrap a built model) before loading, and wrap the same "
                "architecture in the same mode (mode='window' saves one "
                "accumulator per trainable variable, 'in_step' none)."
            )
        for i, variable in enumerate(saved):
            variable.assign(store[f"{i}"])

    @property
    def micro_step(self) -> int:
        """Micro-batches accumulated in the current window."""
        return int(self._micro_step.numpy())

    @property
    def grad_norm(self) -> float:
        """Global norm of the last applied gradient, before clipping."""
        return float(self._grad_norm.numpy())

    @property
    def update_count(self) -> int:
        """Windows closed so far: optimizer steps made, plus those skipped
        for a non-finite gradient under a loss scale."""
        return int(self._update_count.numpy())

    @property
    def has_updated(self) -> bool:
        """Whether the last micro-batch (or epoch end) closed a window."""
        return bool(self._updated.numpy())

    @property
    def window_variables(self) -> dict:
        """The window's state as variables, for compiled readers: `micro_step`,
        `update_count`, `has_updated`, `grad_norm` and `samples` (the
        window's sample count so far, summed over replicas when read)."""
        return {
            "micro_step": self._micro_step,
            "update_count": self._update_count,
            "has_updated": self._updated,
            "grad_norm": self._grad_norm,
            "samples": self._sample_count,
        }

    # --- Training -----------------------------------------------------------

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self._check_variables()
        if not self.optimizer.built:
            # Without a strategy scope Keras builds the optimizer lazily in
            # `apply`; the window update needs its variables first.
            self.optimizer.build(self.trainable_variables)
        if self.mode == "in_step":
            return self._in_step_train_step(x, y, sample_weight)
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

    def _logs(self, x, y, y_pred, sample_weight):
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if self.log_window:
            logs["grad_norm"] = tf.identity(self._grad_norm.value)
            logs["accum_step"] = tf.identity(self._micro_step.value)
        return logs

    def _check_variables(self):
        if tuple(id(v) for v in self.trainable_variables) != (
                self._accumulated_ids):
            raise ValueError(
                "The trainable variables of the wrapped model changed after "
                "GradientAccumulationModel created its accumulators (e.g. a "
                "layer's `trainable` flag was flipped). Set `trainable` "
                "before wrapping the model, then wrap and compile again."
            )

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
            dtype = _accumulator_dtype(v.dtype)
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

    # --- In-step mode -------------------------------------------------------

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
        if sums is None:
            args = ()
            # Already the maximum over the window and the replicas.
            new_values = [self._accumulators[i].value for i in overwrite]
        else:
            args = ([sums[i] for i in regular] + [sums[-1]],)
            new_values = self._replica_max(
                strategy, [sums[i] for i in overwrite])

        def all_reduce(local=None):
            if local is None:
                local = []
                for variable in [self._accumulators[i] for i in regular] + [
                        self._sample_count]:
                    # Placed reads: a multi-worker all-reduce sends its
                    # result to the devices of its inputs, and needs them
                    # named.
                    with tf.device(variable.value.device):
                        local.append(tf.identity(variable.value))
            total = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, local
            )
            scale = 1.0 / tf.maximum(total[-1], 1.0)
            out = [None] * len(variables)
            for i, g in zip(regular, total[:-1]):
                out[i] = tf.cast(g * scale, variables[i].dtype)
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

    @staticmethod
    def _skip_window(optimizer):
        compat.loss_scale_skip(optimizer)
        # Halved on every overflowing window, the scale would reach 0 after
        # about 150 in a row, and the next finite window would divide its
        # zero gradient by it: NaN weights. A scale below 1 cannot help
        # (the gradient overflows unscaled), so it stops at 1.
        optimizer.dynamic_scale.assign(
            tf.maximum(optimizer.dynamic_scale, MIN_LOSS_SCALE))

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
        if self.partial_window == "carry" or self.micro_step == 0:
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

    _epoch_end_function = None


class _WindowEnd(keras.callbacks.Callback):
    """Applies, carries or drops the partial window before anything else."""

    def __init__(self, wrapper):
        super().__init__()
        self._wrapper = weakref.ref(wrapper)

    def on_test_begin(self, logs=None):
        # `fit` runs validation with its own callback list, before
        # `on_epoch_end`: validate the weights the epoch ends with.
        self._wrapper()._finish_epoch()

    def on_epoch_end(self, epoch, logs=None):
        self._wrapper()._finish_epoch()


class _WindowState(tf.Module):
    """Holds the window's variables away from Keras's weight tracking."""


def _map_data(fn, data):
    """`fn` on every tensor of an (x, y, sample_weight) structure."""
    return tf.nest.map_structure(
        lambda t: None if t is None else fn(t), data)


def _rows(tensor, start, count):
    """`tensor[start:start + count]`, as a slice of static size under XLA."""
    rank = tensor.shape.rank
    return tf.slice(tensor, [start] + [0] * (rank - 1),
                    [count] + [-1] * (rank - 1))


def _accumulator_dtype(dtype) -> str:
    dtype = keras.backend.standardize_dtype(dtype)
    return "float32" if dtype in ("float16", "bfloat16") else dtype


def _validate(model, accum_steps, partial_window, mode) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    if mode == "in_step" and partial_window != "apply":
        raise ValueError(
            f"partial_window={partial_window!r} applies to mode='window', "
            "where a window spans several batches. With mode='in_step' each "
            "batch is a whole window (a short last batch is one smaller, "
            "exact step): leave partial_window at 'apply'."
        )
    if not is_positive_int(accum_steps) or accum_steps > MAX_ACCUM_STEPS:
        raise ValueError(
            f"accum_steps must be an integer from 1 to {MAX_ACCUM_STEPS} "
            f"(2**31 - 1), got {accum_steps!r}. Use 1 for no accumulation, "
            "N to apply one optimizer step per N micro-batches."
        )
    if partial_window not in PARTIAL_WINDOW_MODES:
        raise ValueError(
            f"partial_window must be one of {PARTIAL_WINDOW_MODES}, got "
            f"{partial_window!r}."
        )
    if isinstance(model, GradientAccumulationModel):
        raise ValueError(
            f"{model.name!r} is already a GradientAccumulationModel "
            f"(accum_steps={model.accum_steps}); wrapping it again would "
            "accumulate twice. Wrap the original model once, with "
            f"accum_steps={model.accum_steps} * N."
        )
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"GradientAccumulationModel wraps a keras.Model, got "
            f"{type(model).__name__}."
        )
    owner = getattr(model, "_keras_mgpu_wrapper", None)
    if owner is not None and owner() is not None:
        raise ValueError(
            f"Model {model.name!r} is already wrapped by the "
            f"GradientAccumulationModel {owner().name!r}. Use that wrapper, "
            "or rebuild the model to wrap it again."
        )
    _check_inner_not_compiled(model)


def _check_no_synchronized_batch_norm(model) -> None:
    for layer in compat.sublayers(model):
        if isinstance(layer, keras.layers.BatchNormalization) and getattr(
                layer, "synchronized", False):
            raise ValueError(
                f"Layer {layer.name!r} is BatchNormalization(synchronized="
                "True), which all-reduces its batch statistics: that cannot "
                "run inside mode='in_step''s replica-local micro-batch loop. "
                "Use mode='window' (which supports it), or "
                "synchronized=False."
            )


def _check_inner_not_compiled(model) -> None:
    if getattr(model, "optimizer", None) is not None:
        raise ValueError(
            f"The wrapped model {model.name!r} was compiled itself. Compile "
            "the GradientAccumulationModel instead, e.g. "
            "`wrapper.compile(optimizer=..., loss=...)`, and rebuild the "
            "inner model without compiling it."
        )
