"""Ctrl-C during `fit` with a keras-mgpu callback, on the active Keras
backend: the KeyboardInterrupt comes at the next batch (and so cannot be
lost where the signal lands: keras_mgpu/compat/interrupts.py)."""

import signal

import keras
import numpy as np
import pytest

from keras_mgpu.runtime import RuntimeCallback


def test_a_ctrl_c_during_fit_ends_it_at_the_next_batch(python_sigint_handler):
    begun = []

    class CtrlC(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            begun.append(batch)
            if batch == 1:
                signal.raise_signal(signal.SIGINT)  # a real Ctrl-C

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with pytest.raises(KeyboardInterrupt) as raised:
        model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                  callbacks=[RuntimeCallback(), CtrlC()])
    # Batch 1 began and trained; batch 2 did not begin.
    assert begun == [0, 1]
    assert raised.traceback[-1].name == "raise_deferred_ctrl_c"
