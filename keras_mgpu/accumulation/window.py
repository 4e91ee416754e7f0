"""The window state of `GradientAccumulationModel`: its accumulators and
counters, their saving, and the callback that ends a window cut short by
the end of an epoch. The steps that fill and apply it are the backend's
(`keras_mgpu.backend.<name>.AccumulationSteps`)."""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING

import keras

from keras_mgpu.backend._accumulation import MIN_LOSS_SCALE  # noqa: F401
from keras_mgpu.backend._accumulation import accumulator_dtype

PARTIAL_WINDOW_MODES = ("apply", "carry", "drop")
"""The `partial_window` values of `GradientAccumulationModel`: what happens
to a window the end of an epoch cuts short."""

if TYPE_CHECKING:
    from keras_mgpu.backend._accumulation import AccumulationHost as _Host
else:
    _Host = object


class _WindowMixin(_Host):
    """The window's variables and public state."""

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
                    dtype=accumulator_dtype(v.dtype), trainable=False,
                    name=f"accumulator_{i}",
                ))
            else:
                accumulators.append(keras.Variable(
                    "zeros", shape=v.shape, dtype=accumulator_dtype(v.dtype),
                    name=f"accumulator_{i}", **local,
                ))
        # Initializers, not values: an unbuilt model is built inside Keras's
        # stateless scope, where only deferred initialisation is allowed.
        scalar = dict(initializer="zeros", shape=())
        state = self._new_window_state()
        state.accumulators = accumulators
        state.samples = keras.Variable(
            **scalar, dtype="float32", name="accumulated_samples", **local
        )
        state.micro_step = keras.Variable(
            **scalar, dtype=self._COUNTER_DTYPE, trainable=False, name="micro_step"
        )
        state.grad_norm = keras.Variable(
            **scalar, dtype="float32", trainable=False, name="grad_norm"
        )
        state.update_count = keras.Variable(
            **scalar, dtype=self._COUNTER_DTYPE, trainable=False, name="update_count"
        )
        state.updated = keras.Variable(
            **scalar, dtype=self._COUNTER_DTYPE, trainable=False, name="has_updated"
        )
        # `save_own_variables` saves them; the backend decides whether
        # Keras tracks them (TensorFlow keeps them out of the weights, JAX
        # needs them in the train step's state).
        self._window_state = state
        self._track_window(state)

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

    def _check_variables(self):
        if tuple(id(v) for v in self.trainable_variables) != (
                self._accumulated_ids):
            raise ValueError(
                "The trainable variables of the wrapped model changed after "
                "GradientAccumulationModel created its accumulators (e.g. a "
                "layer's `trainable` flag was flipped). Set `trainable` "
                "before wrapping the model, then wrap and compile again."
            )

class _WrapperCallback(keras.callbacks.Callback):
    """A callback the wrapper's own `fit` adds, holding it weakly."""

    def __init__(self, wrapper: _WindowMixin):
        super().__init__()
        self._wrapper = weakref.ref(wrapper)

    def _wrapped(self) -> _WindowMixin:
        wrapper = self._wrapper()
        # Alive: the wrapper's own `fit` runs this callback.
        assert wrapper is not None
        return wrapper


class _WindowEnd(_WrapperCallback):
    """Applies, carries or drops the partial window before anything else."""

    def on_test_begin(self, logs=None):
        # `fit` runs validation with its own callback list, before
        # `on_epoch_end`: validate the weights the epoch ends with.
        self._wrapped()._finish_epoch()

    def on_epoch_end(self, epoch, logs=None):
        self._wrapped()._finish_epoch()


