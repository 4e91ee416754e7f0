"""GradientAccumulationModel under mixed precision."""

import numpy as np
import pytest
import keras

from tests import workers
from tests.conftest import mirrored
from tests.test_accumulation import (batches_dataset, max_diff, micro_batches,
                                     train, weights_of)


def loss_scaled(strategy, data, initial_scale=2.0 ** 15, growth_steps=2000):
    with strategy.scope():
        optimizer = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.05), initial_scale=initial_scale,
            dynamic_growth_steps=growth_steps)
    return train(strategy, data, accum_steps=4, optimizer=optimizer)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
@pytest.mark.parametrize("replicas", [1, 2])
def test_overflow_drops_the_whole_window(policy, replicas):
    micro = micro_batches([8] * 12)
    poisoned = [list(b) for b in micro]
    # One NaN label in window 2: it lands on one replica only.
    poisoned[5][1] = poisoned[5][1].copy()
    poisoned[5][1][7] = np.nan
    strategy = mirrored(replicas)
    model = loss_scaled(strategy, batches_dataset(poisoned))
    optimizer = model.optimizer
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert int(optimizer.iterations.numpy()) == 2
    assert float(optimizer.dynamic_scale.numpy()) == 2.0 ** 14
    assert model.micro_step == 0
    for accumulator in model._accumulators:
        assert not np.any(accumulator.numpy())
    # Windows 1 and 3 applied, window 2 skipped whole.
    clean = loss_scaled(strategy, batches_dataset(micro[:4] + micro[8:]))
    assert max_diff(weights_of(model), weights_of(clean)) < 1e-6
    for variable in model.trainable_variables:
        copies = strategy.experimental_local_results(variable.value)
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy.numpy(), copies[0].numpy())


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_loss_scale_grows_once_per_window(policy):
    micro = micro_batches([8] * 16)
    model = loss_scaled(mirrored(2), batches_dataset(micro),
                        initial_scale=2.0 ** 10, growth_steps=2)
    assert int(model.optimizer.iterations.numpy()) == 4
    # 4 finite windows, growth every 2: two doublings (per micro-batch it
    # would have been eight).
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0 ** 12


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"],
                         indirect=True)
def test_mixed_policies_track_the_float32_run(policy):
    micro = micro_batches([8] * 12)
    model = train(mirrored(2), batches_dataset(micro), accum_steps=4,
                  optimizer="sgd_momentum")
    assert model.inner.layers[0].compute_dtype == policy.split("_")[1]
    expected = keras.optimizers.LossScaleOptimizer \
        if policy == "mixed_float16" else keras.optimizers.SGD
    assert isinstance(model.optimizer, expected)
    assert int(model.optimizer.iterations.numpy()) == 3
    keras.mixed_precision.set_global_policy("float32")
    reference = train(mirrored(2), batches_dataset(micro), accum_steps=4,
                      optimizer="sgd_momentum")
    start = workers.initial_weights(workers.build_mlp())
    moved = max_diff(weights_of(reference), start)
    # Half-precision activations: 11 (float16) or 8 (bfloat16) significant
    # bits, so each step's gradient is off by ~1e-3 or ~1e-2 relative.
    tolerance = {"mixed_float16": 2e-3, "mixed_bfloat16": 2e-2}[policy]
    assert max_diff(weights_of(model), weights_of(reference)) < \
        tolerance * max(moved, 1.0)


@pytest.mark.gpu
def test_the_loss_scale_stops_at_its_floor():
    """160 overflowing windows would halve the scale from 4 to 0; the next
    finite window would then divide a zero gradient by it (NaN weights)."""
    import tensorflow as tf
    from keras_mgpu.accumulation import MIN_LOSS_SCALE, GradientAccumulationModel

    x, y = workers.regression_data(4 * 200)
    y[:4 * 160] = np.nan
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    model = GradientAccumulationModel(workers.build_mlp(), accum_steps=1)
    model.compile(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=4.0), "mse")
    model.fit(dataset.take(160), verbose=0)
    assert float(model.optimizer.dynamic_scale.numpy()) == MIN_LOSS_SCALE
    model.fit(dataset.skip(160), verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 40
    assert all(np.isfinite(w).all() for w in model.get_weights())
