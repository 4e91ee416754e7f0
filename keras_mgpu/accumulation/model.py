"""`GradientAccumulationModel`: one optimizer step per N micro-batches."""

from __future__ import annotations

import inspect
import weakref
from typing import TYPE_CHECKING, Any, Optional

import keras

from keras_mgpu import backend
from keras_mgpu import compat
from keras_mgpu import strategy as strategy_lib
from keras_mgpu._checks import is_positive_int
from keras_mgpu.accumulation import _plan
from keras_mgpu.accumulation.window import (
    PARTIAL_WINDOW_MODES, _WindowEnd, _WindowMixin, _WrapperCallback)

MODES = ("window", "in_step")
"""The `mode` values of `GradientAccumulationModel`: `"window"` (each dataset
batch is a micro-batch) and `"in_step"` (each is split inside the step)."""

# The largest `accum_steps`: in-step mode splits a batch in 32-bit integer
# arithmetic (TensorFlow's `tf.shape`).
MAX_ACCUM_STEPS = 2**31 - 1
"""The largest `accum_steps` of `GradientAccumulationModel` (2**31 - 1)."""

if TYPE_CHECKING:
    # The active backend's; type checkers read TensorFlow's.
    from keras_mgpu.backend.tensorflow.accumulation import (
        AccumulationSteps as _AccumulationSteps)
else:
    _AccumulationSteps = backend.active().AccumulationSteps


@keras.saving.register_keras_serializable(package="keras_mgpu")
class GradientAccumulationModel(_WindowMixin,
                                _AccumulationSteps,
                                keras.Model):
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
    them over all replicas' micro-batches. Under a `tf.distribute`
    strategy each replica moves its own copy of the moving averages within
    a window, and the window's end sets every copy to their mean (stock
    Keras never does: replicas would predict differently).

    The wrapper has the wrapped model's `output_names`: losses, metrics,
    loss weights and targets keyed by output name work as they do for the
    wrapped model.

    The loss is assumed to be a mean over samples (Keras's default
    `"sum_over_batch_size"` reduction).

    Args:
        model: The Keras model to train (Sequential, Functional or
            subclassed, built or not). Compile the wrapper, not this model.
            It stays reachable as `.inner` for export without the wrapper.
        accum_steps: Defaults to `None`: 4, or with `global_batch_size`
            planned from it. Micro-batches per optimizer step, an integer
            from 1 to `MAX_ACCUM_STEPS` (2**31 - 1). 1 behaves like plain
            `fit`. Leave it out with `global_batch_size`.
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
        global_batch_size: Defaults to `None`. The samples of one optimizer
            step over all replicas, kept whatever the replica count: with
            `micro_batch_size`, `accum_steps` is planned as
            `global_batch_size / (micro_batch_size * replicas)` for the
            replicas of the model's strategy (or distribution), so a run
            restarted on fewer (or more) workers takes the same optimizer
            steps on the same samples. A `global_batch_size` that does not
            divide so is refused, naming the numbers, unless
            `allow_batch_change`. `BackupAndRestore` then resumes a backup
            made with the same `global_batch_size` on any replica count.
        micro_batch_size: Defaults to `None`. With `global_batch_size`
            (and only with it): the samples of one micro-batch on one
            replica. Batch the dataset to
            `keras_mgpu.global_batch_size(micro_batch_size)` in window mode
            and to `global_batch_size` in in-step mode; `fit` given arrays
            and no `batch_size` uses that size.
        allow_batch_change: Defaults to `False`. With `global_batch_size`:
            where it does not divide, train with the nearest whole number
            of micro-batches per step instead of refusing, and warn with
            the batch actually trained.
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

    The same optimizer step on any replica count, planned from the global
    batch (here 1 replica: 4 micro-batches of 8 per step):

    >>> inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model = keras_mgpu.GradientAccumulationModel(
    ...     inner, global_batch_size=32, micro_batch_size=8)
    >>> model.accum_steps
    4
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> _ = model.fit(x, y, epochs=1, verbose=0)  # batches of 8
    >>> int(model.optimizer.iterations.numpy())
    2
    """

    def __init__(
        self,
        model: keras.Model,
        accum_steps: Optional[int] = None,
        partial_window: str = "apply",
        log_window: bool = False,
        mode: str = "window",
        global_batch_size: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        allow_batch_change: bool = False,
        **kwargs: Any,
    ):
        self._check_backend_support()
        _plan.check_options(accum_steps, global_batch_size,
                            micro_batch_size, allow_batch_change)
        if accum_steps is None:
            # With a global batch: planned below, once the model has its
            # strategy.
            accum_steps = _plan.DEFAULT_ACCUM_STEPS
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
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.allow_batch_change = allow_batch_change
        self._window_state = None
        model._keras_mgpu_wrapper = weakref.ref(self)
        self._prepare_backend()
        self._plan_accum_steps()
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
        self._compiled()

    def compile_from_config(self, config):
        # Keras skips this for models that override `compile`; the override
        # only validates, so loading may compile as Keras would.
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def fit(self, *args, callbacks=None, **kwargs):
        _check_inner_not_compiled(self.inner)
        if self.global_batch_size is not None:
            args, kwargs = self._with_planned_batch(args, kwargs)
        if self.mode == "window":
            callbacks = [_WindowEnd(self), *(callbacks or [])]
            if self.global_batch_size is not None:
                # Last: after every callback's restore (BackupAndRestore's).
                callbacks.append(_ResumedWindow(self))
        return super().fit(*args, callbacks=callbacks, **kwargs)

    def get_config(self):
        return {
            **super().get_config(),
            "model": keras.saving.serialize_keras_object(self.inner),
            "accum_steps": self.accum_steps,
            "partial_window": self.partial_window,
            "log_window": self.log_window,
            "mode": self.mode,
            **({} if self.global_batch_size is None else {
                # Planned again where the model is loaded.
                "accum_steps": None,
                "global_batch_size": self.global_batch_size,
                "micro_batch_size": self.micro_batch_size,
                "allow_batch_change": self.allow_batch_change,
            }),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["model"] = keras.saving.deserialize_keras_object(
            config["model"], custom_objects=custom_objects
        )
        return cls(**config)

    # --- The global batch ---------------------------------------------------

    def _replicas(self) -> int:
        return strategy_lib.num_replicas(strategy_lib.of_model(self))

    def _planned_micro_batch(self) -> int:
        # Set with global_batch_size: `_plan.check_options` saw to it.
        assert self.micro_batch_size is not None
        return self.micro_batch_size

    def _plan_accum_steps(self) -> None:
        """With a global batch: the micro-batches per step on the replicas
        of the model's strategy; a new plan compiles a new step."""
        if self.global_batch_size is None:
            return
        accum_steps = _plan.accum_steps_for(
            self.global_batch_size, self._planned_micro_batch(),
            self._replicas(), self.allow_batch_change)
        if accum_steps != self.accum_steps:
            self.accum_steps = accum_steps
            self.train_function = None

    def _with_planned_batch(self, args: tuple, kwargs: dict):
        """`fit`'s arguments with the planned data batch filled in for
        arrays; refuses data batched otherwise where its batch is known."""
        self._plan_accum_steps()
        expected = _plan.data_batch_size(
            self.mode, self.accum_steps, self._planned_micro_batch(),
            self._replicas())
        bound = inspect.signature(keras.Model.fit).bind_partial(
            self, *args, **kwargs).arguments
        given = bound.get("batch_size")
        static = _static_batch_size(bound.get("x"))
        for what, size in (("batch_size", given), ("the data's batch", static)):
            if size is not None and size != expected:
                raise ValueError(
                    f"{what} is {size}, but this GradientAccumulationModel "
                    f"takes batches of {expected}: "
                    + _data_batch_text(self) + " Nothing was "
                    "trained. Batch the data to "
                    + ("keras_mgpu.global_batch_size(micro_batch_size)"
                       if self.mode == "window" else "global_batch_size")
                    + ", or leave batch_size out for arrays."
                )
        if given is None and _is_arrays(bound.get("x")):
            kwargs = {**kwargs, "batch_size": expected}
        return args, kwargs

    def _resume_window(self) -> None:
        """A window restored from a run on another replica count: counts its
        samples in this run's micro-batches."""
        micro_steps = self.micro_step
        if micro_steps == 0:
            return
        samples = float(self._sample_count.numpy())
        now = _plan.micro_steps_of_window(
            samples, micro_steps,
            self._planned_micro_batch() * self._replicas())
        if now != micro_steps:
            with strategy_lib.scope_of(self):
                self._micro_step.assign(now)

    # --- Training -----------------------------------------------------------

    def train_step(self, *args):
        # Keras's signature is the backend's: `(data)` on TensorFlow,
        # `(state, data)` on JAX.
        return self._accumulation_train_step(*args)


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


def _static_batch_size(x) -> Optional[int]:
    """A dataset's batch where its shape fixes it (`drop_remainder=True`)."""
    specs = keras.tree.flatten(getattr(x, "element_spec", None))
    shape = getattr(specs[0], "shape", None) if specs else None
    if shape is None or not getattr(shape, "rank", None):
        return None
    return shape[0]


def _is_arrays(x) -> bool:
    """Whether `fit` batches `x` itself (`batch_size` applies)."""
    if x is None or hasattr(x, "element_spec") or isinstance(
            x, keras.utils.PyDataset):
        return False
    leaves = keras.tree.flatten(x)
    return bool(leaves) and all(hasattr(v, "shape") for v in leaves)


def _data_batch_text(model) -> str:
    replicas = model._replicas()
    where = (f"micro_batch_size={model.micro_batch_size} on {replicas} "
             f"replica(s)")
    if model.mode == "window":
        return f"one micro-batch of {where}."
    return (f"global_batch_size={model.global_batch_size} as "
            f"{model.accum_steps} micro-batches of {where}.")


class _ResumedWindow(_WrapperCallback):
    """Recounts a restored window in this run's micro-batches, after every
    other callback's `on_train_begin` (where backups restore)."""

    def on_train_begin(self, logs=None):
        wrapper = self._wrapped()
        assert isinstance(wrapper, GradientAccumulationModel)
        wrapper._resume_window()


def _check_inner_not_compiled(model) -> None:
    if getattr(model, "optimizer", None) is not None:
        raise ValueError(
            f"The wrapped model {model.name!r} was compiled itself. Compile "
            "the GradientAccumulationModel instead, e.g. "
            "`wrapper.compile(optimizer=..., loss=...)`, and rebuild the "
            "inner model without compiling it."
        )


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
