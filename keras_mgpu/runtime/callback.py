"""The base of keras-mgpu's callbacks: Keras's hooks told to the runtime once."""

from __future__ import annotations

import keras

from keras_mgpu import compat
from keras_mgpu.runtime.core import TrainingRuntime, training_runtime


class RuntimeCallback(keras.callbacks.Callback):
    """A Keras callback that drives its model's `TrainingRuntime`.

    Each training hook tells the runtime first (`train_begin`,
    `epoch_begin`, `train_batch_begin`, ...); the runtime acts once per
    event, so several such callbacks in one list, in any order, count each
    batch once. A subclass that overrides a hook calls `super()` first, then
    reads the runtime's counters.

    Example:

    >>> import numpy as np, keras
    >>> class Steps(RuntimeCallback):
    ...     def on_train_batch_end(self, batch, logs=None):
    ...         super().on_train_batch_end(batch, logs)
    ...         self.step = self.runtime.global_step
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> steps = Steps()
    >>> _ = model.fit(np.ones((32, 4)), np.ones((32, 1)), batch_size=8,
    ...               epochs=2, verbose=0, callbacks=[steps])
    >>> steps.step
    8
    """

    def __init__(self):
        super().__init__()
        self._trained = None
        # Refuses a Keras without what the runtime reads of a running `fit`
        # now, not at the first batch.
        compat.record_fits()
        compat.keep_ctrl_c()

    def set_model(self, model):
        super().set_model(model)
        self._trained = model

    @property
    def runtime(self) -> TrainingRuntime:
        """The runtime of the model being trained."""
        return training_runtime(self._trained_model)

    @property
    def _trained_model(self):
        """The model, without the JAX train state put back in its variables
        (Keras's `Callback.model` does that at every read on JAX, which a
        hook run every batch cannot afford; the runtime syncs before its
        own reads)."""
        return self.model if self._trained is None else self._trained

    def on_train_begin(self, logs=None):
        self.runtime.train_begin(self)

    def on_epoch_begin(self, epoch, logs=None):
        self.runtime.epoch_begin(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        self.runtime.train_batch_begin(batch)

    def on_train_batch_end(self, batch, logs=None):
        self.runtime.train_batch_end(batch)

    def on_test_begin(self, logs=None):
        self.runtime.test_begin()

    def on_test_end(self, logs=None):
        self.runtime.test_end()

    def on_test_batch_begin(self, batch, logs=None):
        # A Ctrl-C during validation inside `fit` (deferred there).
        compat.raise_deferred_ctrl_c()

    def on_epoch_end(self, epoch, logs=None):
        self.runtime.epoch_end(epoch)

    def on_train_end(self, logs=None):
        self.runtime.train_end()
