"""GradientAccumulationModel on the active Keras backend, 2 replicas: both
modes against one big-batch step on one device (schedules, clipping, sample
weights, a partial trailing window, mixed precision), the partial-window
policies, and a window saved mid-way and resumed."""

import numpy as np
import pytest
import keras

from keras_mgpu import GradientAccumulationModel
from keras_mgpu.layers import FP32OutputHead

FEATURES = 6
MICRO = 4
ACCUM = 4


def data(n=40):
    """The first `n` of 64 fixed samples, with sample weights."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1).astype("float32")
    weights = rng.uniform(0.1, 3.0, size=(64,)).astype("float32")
    return x[:n], y[:n], weights[:n]


def mlp(head=keras.layers.Dense):
    """`head(1)` on a hidden layer, seeded."""
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(16, activation="tanh"),
        head(1),
    ])


OPTIMIZERS = {
    # Counted in optimizer steps: Keras's own accumulation counts micro-steps.
    "sgd_schedule_global_clipnorm": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5),
        global_clipnorm=0.3),
    "adam_clipnorm": lambda: keras.optimizers.Adam(0.01, clipnorm=0.2),
}


def big_batch_run(optimizer, n=40, epochs=1, head=keras.layers.Dense,
                  loss_scale=None):
    """The reference: one device, one step per big batch."""
    x, y, w = data(n)
    model = mlp(head)
    optimizer = OPTIMIZERS[optimizer]()
    if loss_scale:
        optimizer = keras.optimizers.LossScaleOptimizer(
            optimizer, initial_scale=loss_scale)
    model.compile(optimizer, "mse")
    model.fit(x, y, sample_weight=w, batch_size=MICRO * ACCUM, epochs=epochs,
              verbose=0, shuffle=False)
    return model


def accumulated_run(scope, mode, optimizer, n=40, epochs=1,
                    head=keras.layers.Dense,
                    loss_scale=None, partial_window="apply"):
    x, y, w = data(n)
    with scope():
        model = GradientAccumulationModel(
            mlp(head), accum_steps=ACCUM, mode=mode,
            partial_window=partial_window)
        optimizer = OPTIMIZERS[optimizer]()
        if loss_scale:
            optimizer = keras.optimizers.LossScaleOptimizer(
                optimizer, initial_scale=loss_scale)
        model.compile(optimizer, "mse")
        batch = MICRO if mode == "window" else MICRO * ACCUM
        history = model.fit(x, y, sample_weight=w, batch_size=batch,
                            epochs=epochs, verbose=0, shuffle=False)
    model.history_ = history
    return model


def max_diff(a, b):
    return max(float(np.abs(np.asarray(u, "float64") - v).max())
               for u, v in zip(a.get_weights(), b.get_weights()))


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mode", ["window", "in_step"])
def test_both_modes_equal_the_big_batch_step(two_replicas, mode, optimizer):
    # 40 samples: two whole windows of 16 and a trailing one of 8, which
    # the big-batch run takes as its third, shorter step.
    reference = big_batch_run(optimizer, epochs=2)
    model = accumulated_run(two_replicas, mode, optimizer, epochs=2)
    assert int(model.optimizer.iterations.numpy()) == 6
    assert model.update_count == 6
    assert model.micro_step == 0
    assert max_diff(model.inner, reference) < 1e-5
    # The loss is each window's weighted mean, as Keras reports it.
    assert np.isfinite(model.history_.history["loss"]).all()


@pytest.mark.parametrize("policy, updates, micro_step", [
    ("apply", 3, 0), ("carry", 2, 2), ("drop", 2, 0)])
def test_partial_window_policies(two_replicas, policy, updates, micro_step):
    model = accumulated_run(two_replicas, "window", "adam_clipnorm",
                            partial_window=policy)
    assert (model.update_count, model.micro_step) == (updates, micro_step)
    assert int(model.optimizer.iterations.numpy()) == updates
    if policy == "drop":
        # Only the two whole windows trained: the first 32 samples.
        assert max_diff(model.inner, big_batch_run("adam_clipnorm", n=32)) < 1e-5


def test_a_window_saved_mid_way_resumes_exactly(two_replicas, tmp_path):
    x, y, w = data(32)
    path = str(tmp_path / "window.weights.h5")

    def wrapper():
        model = GradientAccumulationModel(mlp(), accum_steps=ACCUM)
        model.compile(OPTIMIZERS["adam_clipnorm"](), "mse")
        return model

    def fit(model, rows):
        model.fit(x[rows], y[rows], sample_weight=w[rows], batch_size=MICRO,
                  verbose=0, shuffle=False)

    with two_replicas():
        whole = GradientAccumulationModel(mlp(), accum_steps=ACCUM,
                                          partial_window="carry")
        whole.compile(OPTIMIZERS["adam_clipnorm"](), "mse")
        fit(whole, slice(0, 32))
        first = GradientAccumulationModel(mlp(), accum_steps=ACCUM,
                                          partial_window="carry")
        first.compile(OPTIMIZERS["adam_clipnorm"](), "mse")
        # One window and two micro-batches of the next.
        fit(first, slice(0, 24))
        assert (first.update_count, first.micro_step) == (1, 2)
        first.optimizer.build(first.trainable_variables)
        first.save_weights(path)
        resumed = GradientAccumulationModel(mlp(), accum_steps=ACCUM,
                                            partial_window="carry")
        resumed.compile(OPTIMIZERS["adam_clipnorm"](), "mse")
        resumed.optimizer.build(resumed.trainable_variables)
        resumed.load_weights(path)
        assert (resumed.update_count, resumed.micro_step) == (1, 2)
        fit(resumed, slice(24, 32))
    assert (resumed.update_count, resumed.micro_step) == (2, 0)
    assert max_diff(resumed.inner, whole.inner) < 1e-6
    assert max_diff(whole.inner, big_batch_run("adam_clipnorm", n=32)) < 1e-5


# The loss scale in both modes; bfloat16 (no loss scale) in window mode,
# in-step mode's own loop running it as float16's (`make test-all`).
@pytest.mark.parametrize("mode, policy, loss_scale", [
    ("window", "mixed_float16", 256.0), ("in_step", "mixed_float16", 256.0),
    ("window", "mixed_bfloat16", None),
    pytest.param("in_step", "mixed_bfloat16", None,
                 marks=pytest.mark.exhaustive)], indirect=["policy"])
def test_mixed_precision_with_the_float32_head(two_replicas, policy, mode,
                                               loss_scale):
    model = accumulated_run(two_replicas, mode, "adam_clipnorm",
                            head=FP32OutputHead, loss_scale=loss_scale)
    x, _, _ = data(4)
    assert keras.backend.standardize_dtype(
        model.predict(x, verbose=0).dtype) == "float32"
    assert all(keras.backend.standardize_dtype(v.dtype) == "float32"
               for v in model.inner.trainable_variables)
    reference = big_batch_run("adam_clipnorm", head=FP32OutputHead,
                              loss_scale=loss_scale)
    # Half-precision activations round differently at the micro-batch and
    # the big-batch sizes (float32 runs agree within 1e-5, above); one
    # missed or doubled update of Adam at 0.01 would differ by about 1e-2.
    assert max_diff(model.inner, reference) < 1e-3
