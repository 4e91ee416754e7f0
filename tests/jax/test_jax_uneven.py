"""A last batch that does not divide by the devices (keras-team/keras#21167):
65 samples in batches of 32 on 2 devices end with a batch of 1, which
Keras's JAX trainer refuses with `IndivisibleError`. With keras-mgpu that
batch is placed whole on every device: `fit`, `evaluate` and `predict`
equal one device's, BatchNormalization's statistics included."""

import jax
import keras
import numpy as np
import pytest

from keras_mgpu import GradientAccumulationModel, compat
from tests.workers import max_diff

SAMPLES, BATCH, FEATURES = 65, 32, 6


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1))).astype("float32")
    return x, y


def mlp(batch_norm=False):
    """A small MLP, seeded; BatchNormalization (whose statistics are over a
    micro-batch, so not for the accumulation's comparisons) if asked."""
    keras.utils.set_random_seed(1)
    norm = [keras.layers.BatchNormalization()] if batch_norm else []
    return keras.Sequential([
        keras.Input((FEATURES,)),
        # No bias before the normalization: its gradient is zero, so
        # Adam would scale rounding noise up to steps of the learning rate.
        keras.layers.Dense(16, use_bias=not batch_norm),
        *norm,
        keras.layers.Activation("tanh"),
        keras.layers.Dense(1),
    ])


def run(build, batch_size, distribution=None):
    """The model `build()` makes, under `distribution`: 2 epochs of fit,
    then evaluate and predict: (the weights of the model it wraps, if any,
    losses, evaluation, predictions)."""
    x, y = data()

    def go():
        model = build()
        model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
        history = model.fit(x, y, batch_size=batch_size, epochs=2,
                            shuffle=False, verbose=0)
        inner = getattr(model, "inner", model)
        return (inner.get_weights(), history.history,
                model.evaluate(x, y, batch_size=batch_size, verbose=0,
                               return_dict=True),
                model.predict(x, batch_size=batch_size, verbose=0))

    if distribution is None:
        return go()
    with distribution.scope():
        return go()


@pytest.fixture(scope="module")
def one_device():
    """The one-device runs, with and without BatchNormalization."""
    cache = {}

    def get(batch_norm):
        if batch_norm not in cache:
            cache[batch_norm] = run(lambda: mlp(batch_norm), BATCH)
        return cache[batch_norm]

    return get


def two_devices():
    return keras.distribution.DataParallel(devices=jax.devices()[:2])


MODELS = {
    "plain": (lambda: mlp(batch_norm=True), BATCH),
    # Each batch of 32 is the window, split into 4 micro-batches inside
    # the step; the last batch of 1 is a window of 1.
    "in_step": (lambda: GradientAccumulationModel(
        mlp(), accum_steps=4, mode="in_step"), BATCH),
    # Micro-batches of 16 in windows of 2: the same 32-sample steps, then
    # a window of the last sample alone.
    "window": (lambda: GradientAccumulationModel(mlp(), accum_steps=2),
               BATCH // 2),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_a_last_batch_of_one_on_two_devices_trains_as_one_device(
        one_device, name):
    compat.enable_uneven_last_batches()
    build, batch_size = MODELS[name]
    weights, history, evaluation, predictions = run(build, batch_size,
                                                    two_devices())
    ref_weights, ref_history, ref_evaluation, ref_predictions = one_device(
        name == "plain")
    assert max_diff(weights, ref_weights) <= 1e-6
    for key in ("loss", "mae"):
        np.testing.assert_allclose(history[key], ref_history[key], rtol=1e-6)
        assert evaluation[key] == pytest.approx(ref_evaluation[key],
                                                rel=1e-6)
    assert predictions.shape == (SAMPLES, 1)
    np.testing.assert_allclose(predictions, ref_predictions, rtol=1e-5,
                               atol=1e-6)


def test_keras_alone_refuses_the_same_batch():
    # What the fix changes, shown on Keras's own function.
    distribute = compat.enable_uneven_last_batches() and getattr(
        keras.src.backend.jax.trainer._distribute_data,
        "keras_mgpu_original")
    distribution = two_devices()
    x, _ = data()
    with distribution.scope(), pytest.raises(
            ValueError, match="IndivisibleError|evenly divide"):
        distribute((x[:1],))
