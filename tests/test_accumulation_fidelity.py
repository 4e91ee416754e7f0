"""GradientAccumulationModel against the scenarios of andreped/GradientAccumulator.

That project's tests (`tests/` of github.com/andreped/GradientAccumulator)
train MNIST models for epochs and compare evaluation results to a few
decimals. The same scenarios are rebuilt here on tiny seeded models and
generated data, and compared numerically: `accum_steps` micro-batches of B
against plain Keras on batches of `accum_steps * B`, weights after training
to a tight tolerance. Scenarios already covered elsewhere:

- `test_expected_result`, `test_optimizer_invariance` (SGD, Adam),
  `test_model_distribute`, `test_optimizer_distribute`:
  `test_accumulation.py::test_accumulated_step_equals_big_batch_step` (6
  optimizers, 1, 2 and 4 replicas) and `test_sample_weights_and_unequal_...`;
- `test_param_count`: `test_accumulation.py::test_count_params_and_summary_...`;
- `test_mixed_precision` (overflow and loss scale):
  `test_accumulation_mixed_precision.py`;
- two outputs keyed by name: `test_accumulation.py::test_losses_metrics_...`.

Not applicable: adaptive gradient clipping (`use_agc`, not a feature here),
`AccumBatchNormalization` and the pretrained-BN swap (BatchNormalization
sees micro-batches here, as `test_batch_norm_sees_micro_batches` pins).
"""

import numpy as np
import pytest
import keras
import tensorflow as tf

from keras_mgpu import GradientAccumulationModel
from tests import workers
from tests.conftest import mirrored
from tests.test_accumulation import batches_dataset, max_diff, weights_of


def seeded(model, seed=1):
    """Sets deterministic weights (kept: BatchNormalization's ones/zeros)."""
    rng = np.random.RandomState(seed)
    model.set_weights([
        w if "normalization" in v.path else
        (0.3 * rng.randn(*w.shape)).astype(w.dtype)
        for v, w in zip(model.weights, model.get_weights())])
    return model


def split(data, size):
    """Micro-batches of `size` samples of (possibly nested) `data`."""
    count = len(tf.nest.flatten(data)[0])
    return [tf.nest.map_structure(lambda a: a[i:i + size], data)
            for i in range(0, count, size)]


def fit(build, data, batch, optimizer, accum_steps=None, stock_steps=None,
        replicas=1, epochs=1, **compile_kwargs):
    """Trains `build()` on `data` in batches of `batch`; returns the model.

    `accum_steps`: wrap it in a GradientAccumulationModel; `stock_steps`:
    Keras's own `gradient_accumulation_steps` on the optimizer instead.
    """
    with mirrored(replicas).scope():
        model = build()
        if accum_steps is not None:
            model = GradientAccumulationModel(model, accum_steps=accum_steps)
        model.compile(optimizer(stock_steps), **compile_kwargs)
    model.fit(batches_dataset(split(data, batch)), epochs=epochs, verbose=0,
              shuffle=False)
    return model


def images(n, seed=0, classes=10):
    """Tiny "images" whose class is the brightest quadrant-row, plus noise."""
    rng = np.random.RandomState(seed)
    x = rng.rand(n, 6, 6, 1).astype("float32")
    labels = rng.randint(0, classes, n)
    x[np.arange(n), labels % 6, :, 0] += 1.0
    return x, labels.astype("int32")


def classifier():
    return seeded(keras.Sequential([
        keras.Input((6, 6, 1)),
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(10),
    ]))


def sgd(steps=None):
    return keras.optimizers.SGD(0.05, gradient_accumulation_steps=steps)


CLASSIFY = dict(
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=[keras.metrics.SparseCategoricalAccuracy()],
)


@pytest.mark.parametrize("replicas", [1, 2])
def test_expected_result_through_save_and_load(replicas, tmp_path):
    """GradientAccumulator's test_expected_result and test_model_distribute:
    a classifier trained 2 epochs on 2 x 16 equals 32, also once saved,
    loaded and evaluated."""
    data = images(64)
    reference = fit(classifier, data, 32, sgd, epochs=2, **CLASSIFY)
    model = fit(classifier, data, 16, sgd, accum_steps=2, replicas=replicas,
                epochs=2, **CLASSIFY)
    assert int(model.optimizer.iterations.numpy()) == 4
    assert max_diff(weights_of(model), weights_of(reference)) < 1e-6
    path = str(tmp_path / "classifier.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    test = batches_dataset(split(images(32, seed=1), 16))
    expected = reference.evaluate(test, verbose=0, return_dict=True)
    result = loaded.evaluate(test, verbose=0, return_dict=True)
    assert result == pytest.approx(expected, rel=1e-5)


def regression():
    return workers.regression_data(96)


OPTIMIZERS = {
    # Not in test_accumulation.OPTIMIZERS (SGD with momentum, Adam, AdamW,
    # clipnorm, global_clipnorm, a schedule).
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "lion": lambda: keras.optimizers.Lion(0.003),
    "adafactor": lambda: keras.optimizers.Adafactor(0.05),
    "lamb": lambda: keras.optimizers.Lamb(0.01),
    "adam_clipvalue": lambda: keras.optimizers.Adam(0.01, clipvalue=0.02),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_invariance(name):
    """GradientAccumulator's test_optimizer_invariance: 3 windows of 4 x 8
    equal 3 steps of 32, for each optimizer's update rule."""
    data = regression()
    make = OPTIMIZERS[name]
    reference = fit(workers.build_mlp, data, 32, lambda _: make(), loss="mse")
    model = fit(workers.build_mlp, data, 8, lambda _: make(), accum_steps=4,
                loss="mse")
    assert int(model.optimizer.iterations.numpy()) == 3
    start = workers.initial_weights(workers.build_mlp())
    assert max_diff(weights_of(reference), start) > 1e-3
    assert max_diff(weights_of(model), weights_of(reference)) < 1e-6


def multitask():
    image = keras.Input((6, 6, 1), name="image")
    vector = keras.Input((36,), name="vector")
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(image)
    reconstructor = keras.layers.Conv2D(1, 3, padding="same",
                                        name="reconstructor")(x)
    y = keras.layers.Dense(16, activation="relu")(vector)
    classifier_out = keras.layers.Dense(10, name="classifier")(y)
    return seeded(keras.Model((image, vector),
                              [reconstructor, classifier_out]))


def test_multitask(tmp_path):
    """GradientAccumulator's test_multitask: two inputs, a reconstruction
    and a classification output, losses and metrics keyed by output name."""
    x, labels = images(64)
    data = ((x, x.reshape(64, 36)), {"reconstructor": x,
                                     "classifier": labels})
    kwargs = dict(
        loss={"classifier": keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), "reconstructor": "mse"},
        loss_weights={"classifier": 1.0, "reconstructor": 2.0},
        metrics={"classifier": [keras.metrics.SparseCategoricalAccuracy()]},
    )
    reference = fit(multitask, data, 32, sgd, **kwargs)
    model = fit(multitask, data, 16, sgd, accum_steps=2, **kwargs)
    assert max_diff(weights_of(model), weights_of(reference)) < 1e-6
    path = str(tmp_path / "multitask.keras")
    model.save(path)
    test = batches_dataset(split(data, 32))
    expected = reference.evaluate(test, verbose=0, return_dict=True)
    assert set(expected) >= {"classifier_loss", "reconstructor_loss",
                             "classifier_sparse_categorical_accuracy"}
    result = keras.models.load_model(path).evaluate(test, verbose=0,
                                                    return_dict=True)
    assert result == pytest.approx(expected, rel=1e-5)


def bn_mlp(synchronized=False):
    # No bias before BatchNormalization: its gradient is zero, and Adam
    # would turn the rounding noise in it into full-size steps.
    return seeded(keras.Sequential([
        keras.Input((workers.FEATURES,)),
        keras.layers.Dense(16, use_bias=False),
        keras.layers.BatchNormalization(synchronized=synchronized),
        keras.layers.Activation("relu"),
        keras.layers.Dense(1),
    ]))


def all_weights(model):
    """Trainable weights and BatchNormalization's moving statistics."""
    return [v.numpy() for v in getattr(model, "inner", model).weights]


def test_batch_norm_sees_micro_batches():
    """GradientAccumulator's test_batch_norm, as this wrapper defines it.

    BatchNormalization normalizes each micro-batch with that micro-batch's
    statistics and updates its moving averages once per micro-batch, as
    plain Keras with `gradient_accumulation_steps` does; so the result is
    not the big batch's (whose statistics cover all its samples).
    """
    data = regression()
    adam = lambda steps: keras.optimizers.Adam(0.01,  # noqa: E731
                                               gradient_accumulation_steps=steps)
    stock = fit(bn_mlp, data, 8, adam, stock_steps=4, loss="mse")
    model = fit(bn_mlp, data, 8, adam, accum_steps=4, loss="mse")
    big = fit(bn_mlp, data, 32, adam, loss="mse")
    assert int(model.optimizer.iterations.numpy()) == 3
    assert max_diff(all_weights(model), all_weights(stock)) < 1e-6
    assert max_diff(all_weights(model), all_weights(big)) > 1e-3
    # Synchronized BatchNormalization over 2 replicas' halves of each
    # micro-batch is the 1-replica micro-batch.
    synced = fit(lambda: bn_mlp(True), data, 8, adam, accum_steps=4,
                 replicas=2, loss="mse")
    assert max_diff(all_weights(synced), all_weights(model)) < 1e-5


def replica_statistics(model):
    """Each replica's moving mean and variance (lists over replicas)."""
    strategy = model.distribute_strategy
    return [[t.numpy() for t in strategy.experimental_local_results(v.value)]
            for v in model.inner.non_trainable_variables]


@pytest.mark.parametrize("mode, partial_window", [
    ("window", "apply"), ("window", "carry"), ("window", "drop"),
    ("in_step", "apply")])
def test_batch_norm_moving_statistics_are_the_replicas_mean(mode,
                                                            partial_window):
    """Stock Keras under `MirroredStrategy` leaves each replica's moving
    statistics apart; the wrapper averages them at every window's end and
    at an epoch's end mid-window: the mean of stock Keras's replicas, fed
    the same micro-batches (learning rate 0, so the weights the statistics
    come from stay the same), and one value on every replica."""
    data = regression()
    sgd = lambda steps: keras.optimizers.SGD(0.0)  # noqa: E731
    # 10 micro-batches of 8: two windows of 4 and 2 left for the epoch's end.
    micro = split(tuple(a[:80] for a in data), 8)
    if mode == "in_step":
        # A big batch's k-th micro-batch: each replica's k-th rows.
        micro, big = micro[:8], []
        for window in (micro[:4], micro[4:]):
            halves = [[b[i][:4] for b in window] + [b[i][4:] for b in window]
                      for i in range(2)]
            big.append(tuple(np.concatenate(h) for h in halves))
        feed = big
    else:
        feed = micro
    stock = fit(bn_mlp, tuple(np.concatenate(a) for a in zip(*micro)), 8,
                sgd, replicas=2, loss="mse")
    with mirrored(2).scope():
        model = GradientAccumulationModel(
            bn_mlp(), accum_steps=4, mode=mode, partial_window=partial_window)
        model.compile(sgd(None), "mse")
    model.fit(batches_dataset(feed), verbose=0, shuffle=False)
    strategy = stock.distribute_strategy
    for ours, theirs in zip(replica_statistics(model), [
            [t.numpy() for t in strategy.experimental_local_results(v.value)]
            for v in stock.non_trainable_variables]):
        assert max_diff([theirs[0]], [theirs[1]]) > 1e-2  # stock: apart
        assert max_diff([ours[0]], [ours[1]]) == 0.0
        assert max_diff([ours[0]], [(theirs[0] + theirs[1]) / 2]) < 1e-6


def test_the_statistics_ride_on_the_window_all_reduce():
    """Averaging the moving statistics adds no collective: one all-reduce
    per window still (run eagerly, every one executed is counted; the
    (16,)-shaped statistics would show as a second)."""
    from tests.test_accumulation import CountingAllReduce

    ops = CountingAllReduce((16,))
    cls = type("CountingMirrored", (tf.distribute.MirroredStrategy,),
               {"_collective_key_base": 60_000})
    with cls(["/cpu:0", "/cpu:1"], cross_device_ops=ops).scope():
        model = GradientAccumulationModel(bn_mlp(), accum_steps=4)
        model.compile("sgd", "mse", run_eagerly=True)
    model.fit(batches_dataset(split(regression(), 8)), verbose=0,
              shuffle=False)
    assert int(model.optimizer.iterations.numpy()) == 3
    assert ops.calls == 3
    for copies in replica_statistics(model):
        assert max_diff([copies[0]], [copies[1]]) == 0.0


def test_a_save_mid_window_keeps_the_replicas_mean(tmp_path):
    """A backup taken mid-window (replicas' moving statistics apart) keeps
    their mean: a run stopped after it and resumed ends where the
    uninterrupted run ends, statistics included (one saving the first
    replica's copy ends 4e-3 away)."""
    from keras_mgpu.callbacks import BackupAndRestore

    x, y = regression()

    class Stop(Exception):
        pass

    def run(backup_dir=None, stop_after=None):
        def on_batch_end(batch, logs):
            if batch + 1 == stop_after:
                raise Stop()

        callbacks = [keras.callbacks.LambdaCallback(on_batch_end=on_batch_end)]
        if backup_dir:
            # Saves after batches 3 and 6: mid-window (accum_steps=2).
            callbacks.insert(0, BackupAndRestore(backup_dir, save_freq=3))
        with mirrored(2).scope():
            model = GradientAccumulationModel(bn_mlp(), accum_steps=2)
            model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
        try:
            model.fit(x[:40], y[:40], batch_size=8, shuffle=False, verbose=0,
                      callbacks=callbacks)
        except Stop:
            pass
        return model

    full = run()
    run(str(tmp_path / "backup"), stop_after=5)  # resumes after batch 3
    resumed = run(str(tmp_path / "backup"))
    assert int(resumed.optimizer.iterations.numpy()) == 3
    for ours, theirs in zip(replica_statistics(resumed),
                            replica_statistics(full)):
        assert max_diff([ours[0]], [ours[1]]) == 0.0
        assert max_diff([ours[0]], [theirs[0]]) < 1e-6
    assert max_diff(weights_of(resumed), weights_of(full)) < 1e-6


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def mixed_mlp(batch_norm=False):
    layers = [keras.Input((workers.FEATURES,)),
              keras.layers.Dense(16, use_bias=not batch_norm)]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization())
    layers += [keras.layers.Activation("relu"),
               keras.layers.Dense(1, dtype="float32")]
    return seeded(keras.Sequential(layers))


@pytest.mark.gpu
def test_mixed_precision_with_and_without_batch_norm(mixed_float16,
                                                     tmp_path):
    """GradientAccumulator's test_mixed_precision and test_mp_batch_norm:
    Adam under a loss scale, float32 output layer, mixed_float16."""
    data = regression()
    adam = lambda steps: keras.optimizers.Adam(0.01,  # noqa: E731
                                               gradient_accumulation_steps=steps)
    reference = fit(mixed_mlp, data, 32, adam, loss="mse")
    model = fit(mixed_mlp, data, 8, adam, accum_steps=4, loss="mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    # float16 activations: 11 significant bits, in every micro-batch's
    # forward and backward pass.
    assert max_diff(weights_of(model), weights_of(reference)) < 2e-3
    path = str(tmp_path / "mixed.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, keras.optimizers.LossScaleOptimizer)
    np.testing.assert_allclose(loaded.predict(data[0], verbose=0),
                               model.predict(data[0], verbose=0), atol=1e-6)

    stock = fit(lambda: mixed_mlp(True), data, 8, adam, stock_steps=4,
                loss="mse")
    model = fit(lambda: mixed_mlp(True), data, 8, adam, accum_steps=4,
                loss="mse")
    assert max_diff(all_weights(model), all_weights(stock)) < 2e-3


def embedding_model(one_hot=False):
    """Embedding (sparse gradient), or the same model as a one-hot matmul
    (dense gradient), with the same weights."""
    lookup = [keras.layers.Lambda(lambda ids: keras.ops.one_hot(ids, 50)),
              keras.layers.Dense(4, use_bias=False)] if one_hot else [
        keras.layers.Embedding(50, 4)]
    return seeded(keras.Sequential([
        keras.Input((5,), dtype="int32"), *lookup, keras.layers.Flatten(),
        keras.layers.Dense(1, activation="sigmoid"),
    ]))


def test_sparse_embedding_gradients():
    """GradientAccumulator's test_sparse_optimizer: an Embedding's gradient
    is `tf.IndexedSlices`, accumulated densely here.

    The reference is the big batch with a dense gradient (the same model as
    a one-hot matmul), and Keras's own accumulation (dense too). Plain Keras
    on the big batch differs: its Adam squares each slice of an
    `IndexedSlices` gradient separately (`ops.square` is sparse-aware), so
    an id that occurs twice in a batch adds the sum of its squared slices
    to the second moment, not the square of their sum.
    """
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 50, (96, 5)).astype("int32")
    labels = (ids.sum(axis=1, keepdims=True) % 2).astype("float32")
    model = embedding_model()
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.binary_crossentropy(
            labels, model(ids)))
    assert isinstance(tape.gradient(loss, model.trainable_variables)[0],
                      tf.IndexedSlices)
    adam = lambda steps: keras.optimizers.Adam(  # noqa: E731
        0.01, gradient_accumulation_steps=steps)
    data = (ids, labels)
    dense = fit(lambda: embedding_model(one_hot=True), data, 32, adam,
                loss="binary_crossentropy")
    stock = fit(embedding_model, data, 8, adam, stock_steps=4,
                loss="binary_crossentropy")
    accumulated = fit(embedding_model, data, 8, adam, accum_steps=4,
                      loss="binary_crossentropy")
    assert max_diff(weights_of(accumulated), weights_of(dense)) < 1e-6
    assert max_diff(weights_of(accumulated), weights_of(stock)) < 1e-6
