"""The methods `jax_accumulation_vs_keras.py` compares, and how each trains.

The big batch (the reference), Keras's own `gradient_accumulation_steps`,
and `GradientAccumulationModel` in window and in-step mode: how each is
built and compiled from the same initial weights (`make_model`), the batch
its `fit` takes (`fit_batch`), and the callback that makes `fit` wait for
each step (`WaitForEachStep`). The correctness cases and the timing both
train through these. Imported after the script has set `KERAS_BACKEND`
and `XLA_FLAGS`.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

import keras_mgpu

import keras

BIG = "big batch"
KERAS = "Keras's own"
WINDOW = "keras-mgpu window"
IN_STEP = "keras-mgpu in_step"
METHODS = (BIG, KERAS, WINDOW, IN_STEP)
DESCRIPTIONS = {
    BIG: "plain model, fit at the big batch (accum_steps x micro-batch); "
         "the reference",
    KERAS: "plain model, fit at the micro-batch, optimizer with "
           "gradient_accumulation_steps=accum_steps",
    WINDOW: "GradientAccumulationModel(mode='window'), fit at the "
            "micro-batch",
    IN_STEP: "GradientAccumulationModel(mode='in_step'), fit at the big "
             "batch",
}
ACCUM_STEPS = 4


class WaitForEachStep(keras.callbacks.Callback):
    """Makes `fit` wait for each step's logs before it dispatches the next.

    A callback with its own `on_train_batch_end` turns off Keras's
    asynchronous batch callbacks, with which the JAX trainer dispatches
    steps without waiting for any: with 2 host devices on 2 busy cores,
    epochs of a few hundred steps then at times stall in a step's
    all-reduce (one device's share never joins the rendezvous), and XLA
    aborts the process after 40 s. Any method, plain `fit` included.
    Waiting for each step's logs keeps one step in flight.
    """

    def on_train_batch_end(self, batch, logs=None):
        pass


def step_callbacks(args: argparse.Namespace) -> list:
    return [] if args.async_callbacks else [WaitForEachStep()]


def fresh_session() -> None:
    """Clears Keras's global state, then sets DataParallel again (the
    distribution is part of that state)."""
    keras.backend.clear_session()
    keras.distribution.set_distribution(keras.distribution.DataParallel())


def mlp(features: int, width: int, classes: int, depth: int) -> keras.Model:
    return keras.Sequential(
        [keras.Input((features,))]
        + [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        + [keras.layers.Dense(classes)],
        name=f"mlp_{features}_{depth}x{width}_{classes}")


def make_model(method: str, build: Callable[[], keras.Model],
               initial: list, optimizer: Callable[[Optional[int]],
                                                  keras.optimizers.Optimizer]
               ) -> tuple[keras.Model, keras.Model]:
    """The compiled model `fit` trains and the model holding the weights."""
    inner = build()
    inner.set_weights(initial)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if method in (WINDOW, IN_STEP):
        mode = "window" if method == WINDOW else "in_step"
        model = keras_mgpu.GradientAccumulationModel(
            inner, accum_steps=ACCUM_STEPS, mode=mode)
        model.compile(optimizer=optimizer(None), loss=loss)
        return model, inner
    accumulation = ACCUM_STEPS if method == KERAS else None
    inner.compile(optimizer=optimizer(accumulation), loss=loss)
    return inner, inner


def fit_batch(method: str, micro_batch: int) -> int:
    """The dataset batch: the micro-batch or the big batch."""
    return micro_batch if method in (KERAS, WINDOW) else micro_batch * ACCUM_STEPS

