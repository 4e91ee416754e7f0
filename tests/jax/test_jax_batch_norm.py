"""BatchNormalization under `GradientAccumulationModel` on JAX, 2 devices
(issue #43): both modes normalise over the GLOBAL micro-batch, as plain
`fit` at the micro-batch size does under `DataParallel` (XLA computes the
batch statistics over the whole sharded batch).

The reference is Keras's own `gradient_accumulation_steps=4` with plain
`fit` at micro-batches of 8: it normalises each global micro-batch and
applies the mean gradient once per 4. Window mode is fed the same
micro-batches. In-step mode is fed big batches of 32: each device's share
(16 rows) is split into 4 micro-batches of 4 rows, so its global
micro-batch k is the union of every device's k-th slice, that is rows
`[4k, 4k + 4)` and `[16 + 4k, 16 + 4k + 4)` of the big batch
(`in_step_order`). Fed in that order, the reference, window mode and
in-step mode are the same run: weights and moving statistics agree to
float rounding.
"""

import sys
import threading

import jax
import keras
import numpy as np
import pytest

from keras_mgpu import GradientAccumulationModel
from keras_mgpu import compat
from tests.jax.test_jax_backend import compiled_collectives

DEVICES, ACCUM, MICRO = 2, 4, 8
BIG = ACCUM * MICRO
STEPS = 3  # optimizer steps
SAMPLES = STEPS * BIG
FEATURES = 6
IMAGE = (5, 5, 2)
# Float rounding (statistics and gradients are summed in another order,
# and Adam scales the noise of its smallest gradients up): the runs differ
# by up to 2e-6 here (`differences`), against 9e-4 to 0.2 when in-step mode
# normalised each device's share.
TOLERANCE = 1e-5


def data(shape=(FEATURES,)):
    rng = np.random.default_rng(0)
    # Away from zero mean and unit variance, so that the statistics matter.
    x = (2.0 * rng.normal(size=(SAMPLES, *shape)) + 1.5).astype("float32")
    flat = x.reshape(SAMPLES, -1)
    y = (np.tanh(flat @ rng.normal(size=(flat.shape[1], 1)) / 3)
         + 0.1 * rng.normal(size=(SAMPLES, 1))).astype("float32")
    return x, y


def in_step_order(samples=SAMPLES):
    """The permutation that puts the samples in in-step mode's global
    micro-batches: per big batch, for each micro-batch index k, every
    device's k-th slice of its share."""
    share, slice_ = BIG // DEVICES, BIG // DEVICES // ACCUM
    order = [start + device * share + k * slice_ + i
             for start in range(0, samples, BIG)
             for k in range(ACCUM)
             for device in range(DEVICES)
             for i in range(slice_)]
    assert sorted(order) == list(range(samples))
    return np.asarray(order)


def mlp(batch_norm=True):
    keras.utils.set_random_seed(5)

    def norm():
        return ([keras.layers.BatchNormalization(momentum=0.5)]
                if batch_norm else [])

    return keras.Sequential([
        keras.Input((FEATURES,)),
        # No bias before the normalization: its gradient is zero, and Adam
        # would scale rounding noise up to steps of the learning rate.
        keras.layers.Dense(16, use_bias=not batch_norm),
        *norm(),
        keras.layers.Activation("tanh"),
        keras.layers.Dense(8, use_bias=not batch_norm),
        *norm(),
        keras.layers.Activation("relu"),
        keras.layers.Dense(1),
    ])


def convnet():
    """BatchNormalization over the batch and both image axes."""
    keras.utils.set_random_seed(5)
    return keras.Sequential([
        keras.Input(IMAGE),
        keras.layers.Conv2D(4, 3, padding="same", use_bias=False),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.Activation("relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(1),
    ])


MODELS = {"mlp": (mlp, (FEATURES,)), "convnet": (convnet, IMAGE)}


OPTIMIZERS = {
    "sgd": lambda steps=None: keras.optimizers.SGD(
        0.1, gradient_accumulation_steps=steps),
    "adam": lambda steps=None: keras.optimizers.Adam(
        0.01, gradient_accumulation_steps=steps),
}


def run(optimizer, mode, order=None, model="mlp"):
    """The model's weights (moving statistics included) after `STEPS`
    optimizer steps on 2 devices: `mode` None is the reference."""
    build, shape = MODELS[model]
    x, y = data(shape)
    if order is not None:
        x, y = x[order], y[order]
    distribution = keras.distribution.DataParallel(devices=jax.devices()[:2])
    with distribution.scope():
        if mode is None:
            model = build()
            model.compile(OPTIMIZERS[optimizer](ACCUM), "mse")
        else:
            model = GradientAccumulationModel(build(), accum_steps=ACCUM,
                                              mode=mode)
            model.compile(OPTIMIZERS[optimizer](), "mse")
        model.fit(x, y, batch_size=BIG if mode == "in_step" else MICRO,
                  epochs=1, shuffle=False, verbose=0)
    if mode is not None:
        assert int(model.optimizer.iterations.numpy()) == STEPS
    inner = getattr(model, "inner", model)
    # Layer names differ between models: by position, moving or not.
    return [("moving_" in v.name, np.asarray(v.value, "float64"))
            for v in inner.weights]


def differences(a, b):
    """The largest difference of the trained weights and of the moving
    statistics: absolute, or relative to the values where they exceed 1
    (the moving variances reach 4)."""
    def largest(moving):
        return max(float(np.abs(u - v).max() / max(1.0, np.abs(v).max()))
                   for (kind, u), (_, v) in zip(a, b) if kind == moving)
    return largest(False), largest(True)


@pytest.fixture(scope="module")
def runs():
    cache = {}

    def get(optimizer, mode, order=None, model="mlp"):
        key = (optimizer, mode, order is not None, model)
        if key not in cache:
            cache[key] = run(optimizer, mode, order, model)
        return cache[key]

    return get


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_window_mode_normalises_the_global_micro_batch(runs, optimizer):
    reference = runs(optimizer, None)
    window = runs(optimizer, "window")
    weights, moving = differences(window, reference)
    assert weights < TOLERANCE and moving < TOLERANCE, (weights, moving)


# The statistics do not depend on the optimizer: Adam's run on the MLP
# is `make test-all`'s.
@pytest.mark.parametrize("optimizer, model", [
    pytest.param("adam", "mlp", marks=pytest.mark.exhaustive),
    ("sgd", "mlp"), ("sgd", "convnet")])
def test_in_step_mode_normalises_the_global_micro_batch(runs, optimizer,
                                                        model):
    reference = runs(optimizer, None, in_step_order(), model)
    in_step = runs(optimizer, "in_step", model=model)
    weights, moving = differences(in_step, reference)
    assert weights < TOLERANCE and moving < TOLERANCE, (weights, moving)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_the_modes_agree_on_the_same_micro_batches(runs, optimizer):
    # Window mode fed in-step's micro-batches is in-step mode.
    window = runs(optimizer, "window", in_step_order())
    in_step = runs(optimizer, "in_step")
    weights, moving = differences(window, in_step)
    assert weights < TOLERANCE and moving < TOLERANCE, (weights, moving)
    # The grouping matters: the statistics are not those of the data's
    # order (so the comparisons above are not blind to it).
    weights, moving = differences(runs(optimizer, "window"), in_step)
    assert moving > 1e-3, moving


def test_what_the_synchronised_statistics_cost(data_parallel):
    # One all-reduce per in-step window either way (gradient sums, count,
    # loss and the averaged moving statistics). Each BatchNormalization
    # adds, per micro-batch, one all-gather of its mean and variance and
    # one reduce-scatter of their gradient: in the program, once for the
    # first micro-batch and once in the loop's body.
    x, y = data()
    sharded = jax.sharding.NamedSharding(
        data_parallel.device_mesh.backend_mesh,
        jax.sharding.PartitionSpec(data_parallel.batch_dim_name))
    x, y = (jax.device_put(t[:BIG], sharded) for t in (x, y))
    counts = {}
    for batch_norm in (False, True):
        model = GradientAccumulationModel(mlp(batch_norm), accum_steps=ACCUM,
                                          mode="in_step")
        model.compile(keras.optimizers.Adam(0.01), "mse")
        model.fit(x, y, batch_size=BIG, verbose=0)
        counts[batch_norm] = compiled_collectives(model, x, y)
    assert counts[False] == {
        "all-reduce": 1, "all-gather": 0, "reduce-scatter": 0}, counts
    norms = 2  # BatchNormalization layers of `mlp`
    assert counts[True] == {"all-reduce": 1, "all-gather": 2 * norms,
                             "reduce-scatter": 2 * norms}, counts


def test_moments_over_the_batch_axis_cover_every_device(data_parallel):
    keras_moments = _keras_moments()
    mesh = data_parallel.device_mesh.backend_mesh
    name = data_parallel.batch_dim_name
    x = np.random.default_rng(1).normal(3.0, 2.0, (8, 3, 5)).astype("float32")

    def body(x):
        with compat.batch_moments_across(name):
            moments = [keras.ops.moments(x, axes=[0, 1]),
                       keras.ops.moments(x, axes=(-3,), keepdims=True),
                       # LayerNormalization-like: the batch axis kept.
                       keras.ops.moments(x, axes=-1),
                       keras.ops.moments(x.astype("float16"), axes=0)]
        # One copy per device (each is a device's value).
        return jax.tree.map(lambda t: t[None], moments)

    spec = jax.sharding.PartitionSpec(name)
    (mean, var), (kept_mean, kept_var), (row_mean, row_var), (
        half_mean, half_var) = jax.tree.map(np.asarray, jax.jit(jax.shard_map(
            body, mesh=mesh, in_specs=spec, out_specs=spec))(
                jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))))
    for device in range(DEVICES):
        np.testing.assert_allclose(mean[device], x.mean((0, 1)), atol=1e-6)
        np.testing.assert_allclose(var[device], x.var((0, 1)), rtol=1e-6)
        np.testing.assert_allclose(kept_mean[device],
                                   x.mean(0, keepdims=True), atol=1e-6)
        np.testing.assert_allclose(kept_var[device],
                                   x.var(0, keepdims=True), rtol=1e-6)
        halves = x.astype("float16").astype("float32")
        assert half_mean.dtype == half_var.dtype == np.float16
        np.testing.assert_allclose(half_mean[device], halves.mean(0),
                                   atol=2e-3)
        np.testing.assert_allclose(half_var[device], halves.var(0),
                                   rtol=2e-3)
    # Moments that keep the batch axis are each device's own.
    np.testing.assert_allclose(row_mean.reshape(8, 3), x.mean(-1), atol=1e-6)
    np.testing.assert_allclose(row_var.reshape(8, 3), x.var(-1), rtol=1e-6)
    # Keras's own is back after the block.
    assert _keras_moments() is keras_moments


def test_the_swap_is_only_for_the_block_and_its_thread():
    keras_moments = _keras_moments()
    x = np.arange(12.0, dtype="float32").reshape(4, 3)
    results = []
    with compat.batch_moments_across("not_bound_here"):
        assert _keras_moments() is not keras_moments
        # Another thread, outside any block: Keras's own moments (an axis
        # name unbound there would fail).
        thread = threading.Thread(target=lambda: results.append(
            keras.ops.moments(x, axes=[0])))
        thread.start()
        thread.join()
        with compat.batch_moments_across(None):  # no axis: nothing changed
            pass
    assert _keras_moments() is keras_moments
    np.testing.assert_allclose(results[0][0], x.mean(0))
    np.testing.assert_allclose(results[0][1], x.var(0))


def _keras_moments():
    return sys.modules["keras.src.backend.jax.nn"].moments
