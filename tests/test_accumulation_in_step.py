"""GradientAccumulationModel(mode="in_step"): the window inside one step.

Each dataset batch is the big batch; the wrapper splits every replica's share
into `accum_steps` micro-batches inside the train step. Every result is
compared against plain `fit` on the big batch on one device.
"""

import functools

import numpy as np
import pytest
import keras
import tensorflow as tf

from keras_mgpu import GradientAccumulationModel
from tests import workers
from tests.conftest import mirrored
from tests.test_accumulation import (OPTIMIZERS, batches_dataset, float8_mlp,
                                     float8_parts, max_diff, micro_batches,
                                     on_replicas, train, weights_of)

# Five full big batches and a short last one: 20 samples split 5 per
# replica on 4 replicas, then into micro-batches of 1 + 2 + 2.
SIZES = [32] * 5 + [20]


def in_step(strategy, data, accum_steps=4, **kwargs):
    return train(strategy, data, accum_steps=accum_steps, mode="in_step",
                 **kwargs)


@functools.lru_cache(maxsize=None)
def reference(sizes=tuple(SIZES), weights=False, **kwargs):
    """Plain `fit` on the same big batches on one device (trained once per
    process: several tests compare against each)."""
    if "metrics" in kwargs:  # a tuple here, to be hashable
        kwargs["metrics"] = list(kwargs["metrics"])
    return train(mirrored(1), batches_dataset(micro_batches(sizes,
                                                            weights=weights)),
                 **kwargs)


# The optimizer takes in-step mode's summed gradient as window mode's
# (where every optimizer runs): what is in-step mode's own is each kind of
# clipping of that sum and the schedule's count (AdamW and momentum: `make
# test-all`).
IN_STEP_OPTIMIZERS = ("adam", "adam_clipnorm", "adam_clipvalue",
                      "adam_global_clipnorm", "sgd_schedule")


@pytest.mark.parametrize("optimizer, replicas",
                         on_replicas(OPTIMIZERS, (1, 2, 4), "adam",
                                     keep=IN_STEP_OPTIMIZERS))
def test_in_step_equals_big_batch_step(optimizer, replicas):
    big = micro_batches(SIZES)
    expected = reference(optimizer=optimizer)
    model = in_step(mirrored(replicas), batches_dataset(big),
                    optimizer=optimizer)
    assert int(model.optimizer.iterations.numpy()) == len(SIZES)
    assert int(expected.optimizer.iterations.numpy()) == len(SIZES)
    start = workers.initial_weights(workers.build_mlp())
    assert max_diff(weights_of(expected), start) > 1e-2
    assert max_diff(weights_of(model), weights_of(expected)) < 1e-5
    np.testing.assert_allclose(
        float(model.optimizer.learning_rate.numpy()),
        float(expected.optimizer.learning_rate.numpy()))
    assert model.update_count == len(SIZES) and model.micro_step == 0


# Both on 2 replicas, and steps_per_execution alone; the rest (XLA alone,
# 1 replica, and 4: XLA compiles the loop once per replica and per batch
# shape, the costliest case) run the same loop: `make test-all`.
@pytest.mark.parametrize("replicas, steps_per_execution, jit_compile", [
    pytest.param(replicas, steps, jit,
                 marks=() if replicas == 2 and steps == 4
                 else pytest.mark.exhaustive)
    for replicas in (1, 2)
    for steps, jit in ((4, False), (1, True), (4, True))
] + [pytest.param(4, 4, True, marks=pytest.mark.exhaustive)])
def test_in_step_with_steps_per_execution_and_xla(replicas,
                                                  steps_per_execution,
                                                  jit_compile):
    # 2 epochs of 6 batches: with steps_per_execution=4 the data ends
    # inside the second call of each epoch.
    big = micro_batches(SIZES)
    expected = reference(epochs=2, optimizer="adam_global_clipnorm")
    model = in_step(mirrored(replicas), batches_dataset(big), epochs=2,
                    optimizer="adam_global_clipnorm",
                    steps_per_execution=steps_per_execution,
                    jit_compile=jit_compile)
    assert int(model.optimizer.iterations.numpy()) == 2 * len(SIZES)
    assert max_diff(weights_of(model), weights_of(expected)) < 1e-5
    # Keras itself compiles nothing: only the micro-batch loop is.
    assert model.jit_compile is False
    assert model._loop_jit_compile is jit_compile


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_in_step_sample_weights_and_short_batches(replicas):
    # A 3-sample and a 1-sample batch leave some replicas an empty share.
    # (The first batch splits evenly: Keras's symbolic build averages it
    # over the replicas, for any model.)
    sizes = (32, 27, 3, 1)
    big = micro_batches(sizes, weights=True)
    expected = reference(sizes, weights=True, optimizer="sgd_momentum")
    model = in_step(mirrored(replicas), batches_dataset(big),
                    optimizer="sgd_momentum")
    assert int(model.optimizer.iterations.numpy()) == 4
    assert max_diff(weights_of(model), weights_of(expected)) < 1e-5
    assert all(np.all(np.isfinite(w)) for w in weights_of(model))


def test_in_step_logs_what_plain_fit_logs_one_batch_per_step():
    big = micro_batches(SIZES)
    batches = []
    counter = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batches.append(batch))
    expected = reference(epochs=2, metrics=("mae",))
    model = in_step(mirrored(2), batches_dataset(big), epochs=2,
                    metrics=["mae"], callbacks=[counter])
    assert batches == list(range(len(SIZES))) * 2
    ours, theirs = model.history_.history, expected.history_.history
    assert set(ours) == set(theirs) == {"loss", "mae"}
    for key in theirs:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-5)
    evaluation = model.evaluate(batches_dataset(big), verbose=0)
    np.testing.assert_allclose(
        evaluation, expected.evaluate(batches_dataset(big), verbose=0),
        rtol=1e-5)


def test_in_step_float8_matches_window_mode():
    """Scales and amax histories: the maximum over the same micro-batches,
    whichever mode runs them."""
    micro = micro_batches([8] * 8)
    big = [np.concatenate(parts) for parts in zip(*micro[:4])], [
        np.concatenate(parts) for parts in zip(*micro[4:])]
    results = {}
    for mode, data in (("window", micro), ("in_step", list(big))):
        model = GradientAccumulationModel(float8_mlp(), accum_steps=4,
                                          mode=mode)
        model.compile(keras.optimizers.SGD(0.1), "mse")
        model.fit(batches_dataset(data), verbose=0, shuffle=False)
        results[mode] = float8_parts(model)
    (overwrite_w, regular_w), (overwrite_s, regular_s) = (
        results["window"], results["in_step"])
    assert len(overwrite_s) == 12
    assert max_diff(overwrite_s, overwrite_w) == 0.0
    assert max_diff(regular_s, regular_w) < 1e-6


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("replicas", [1, 2])
def test_in_step_overflow_skips_the_whole_step(mixed_float16, replicas):
    big = micro_batches([32] * 3)
    poisoned = [list(b) for b in big]
    # One NaN label in the second batch's last micro-batch: one replica.
    poisoned[1][1] = poisoned[1][1].copy()
    poisoned[1][1][30] = np.nan
    strategy = mirrored(replicas)

    def run(data):
        with strategy.scope():
            optimizer = keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.05))
        return in_step(strategy, batches_dataset(data), optimizer=optimizer)

    model = run(poisoned)
    assert int(model.optimizer.iterations.numpy()) == 2
    assert model.update_count == 3
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0 ** 14
    clean = run([big[0], big[2]])
    assert max_diff(weights_of(model), weights_of(clean)) < 1e-6
    for variable in model.trainable_variables:
        copies = strategy.experimental_local_results(variable.value)
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy.numpy(), copies[0].numpy())


def test_in_step_keeps_no_accumulators_and_round_trips(tmp_path):
    big = micro_batches(SIZES)
    model = in_step(mirrored(1), batches_dataset(big))
    assert model._accumulators == []
    assert model.get_config()["mode"] == "in_step"
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.mode == "in_step"
    assert max_diff(weights_of(loaded), weights_of(model)) == 0.0
    assert loaded.update_count == len(SIZES)
    window = GradientAccumulationModel(workers.build_mlp(), accum_steps=4)
    window.compile("adam", "mse")
    weights = str(tmp_path / "in_step.weights.h5")
    model.save_weights(weights)
    with pytest.raises(ValueError, match="same mode"):
        window.load_weights(weights)


def test_in_step_refuses_synchronized_batch_norm():
    inner = keras.Sequential([
        keras.Input((workers.FEATURES,)),
        keras.layers.Dense(16),
        keras.layers.BatchNormalization(synchronized=True, name="sync_bn"),
        keras.layers.Dense(1),
    ])
    model = GradientAccumulationModel(inner, accum_steps=2, mode="in_step")
    with pytest.raises(ValueError, match="'sync_bn' is BatchNormalization"
                                         r"\(synchronized=True\)"):
        model.compile("adam", "mse")


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "inside"}, r"mode must be one of \('window', 'in_step'\), "
                         "got 'inside'"),
    ({"mode": "in_step", "partial_window": "carry"},
     "partial_window='carry' applies to mode='window'"),
])
def test_in_step_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradientAccumulationModel(workers.build_mlp(), accum_steps=2,
                                  **kwargs)


# Across workers, what is in-step mode's own (as on one process): each
# kind of clipping of the all-reduced sum, the schedule's count, and the
# loop compiled with steps_per_execution; the other optimizers and
# steps_per_execution or XLA alone: `make test-all`.
IN_STEP_MULTI_WORKER = ("adam_clipnorm", "adam_clipvalue",
                        "adam_global_clipnorm", "sgd_schedule",
                        "spe4-jitTrue")


@pytest.mark.parametrize("names", [
    pytest.param(IN_STEP_MULTI_WORKER, id="clipping-schedule-xla"),
    pytest.param(tuple(name for name in workers.in_step_configs()
                       if name not in IN_STEP_MULTI_WORKER),
                 id="the-rest", marks=pytest.mark.exhaustive)])
def test_in_step_multi_worker_matches_one_process(run_workers, names):
    results = run_workers(workers.multi_worker_in_step,
                          kwargs={"names": list(names)})
    reference = workers.in_step_runs(tf.distribute.get_strategy(), names,
                                     reference=True)
    for r in results:
        assert r.result.keys() == reference.keys() == set(names)
        for name, run in r.result.items():
            assert run["iterations"] == reference[name]["iterations"], name
            assert max_diff([np.asarray(w) for w in run["weights"]],
                            [np.asarray(w) for w in reference[name]["weights"]]
                            ) < 1e-5, name
