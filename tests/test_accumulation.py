"""GradientAccumulationModel: exactness, step counting, communication, options."""

import warnings

import numpy as np
import pytest
import keras
import tensorflow as tf

from keras_mgpu import GradientAccumulationModel, compat
from tests import workers
from tests.conftest import mirrored

OPTIMIZERS = workers.optimizers()


def weights_of(model):
    return [v.numpy() for v in model.trainable_variables]


def max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def batches_dataset(batches):
    """A dataset yielding exactly the given (x, y[, w]) batches, in order."""
    dataset = None
    for batch in batches:
        one = tf.data.Dataset.from_tensors(tuple(batch))
        dataset = one if dataset is None else dataset.concatenate(one)
    return dataset


def train(strategy, data, accum_steps=None, optimizer="adam", epochs=1,
          partial_window="apply", mode="window", callbacks=None,
          **compile_kwargs):
    """Fits `build_mlp` on `data` (a dataset of batches); returns the model."""
    with strategy.scope():
        inner = workers.build_mlp()
        if accum_steps is None:
            model = inner
        else:
            model = GradientAccumulationModel(
                inner, accum_steps=accum_steps, partial_window=partial_window,
                mode=mode)
        opt = OPTIMIZERS[optimizer]() if isinstance(optimizer, str) \
            else optimizer
        model.compile(opt, "mse", **compile_kwargs)
    model.history_ = model.fit(data, epochs=epochs, verbose=0, shuffle=False,
                               callbacks=callbacks)
    return model


def micro_batches(sizes, seed=0, weights=False):
    x, y = workers.regression_data(sum(sizes), seed=seed)
    rng = np.random.RandomState(seed + 7)
    out, start = [], 0
    for size in sizes:
        batch = [x[start:start + size], y[start:start + size]]
        if weights:
            batch.append(rng.uniform(0.1, 3.0, size).astype("float32"))
        out.append(batch)
        start += size
    return out


def merge(batches):
    """Concatenates micro-batches into one big batch."""
    return [np.concatenate(parts) for parts in zip(*batches)]


def on_replicas(names, counts, everywhere, label="{name}-{replicas}",
                keep=None):
    """`(name, replicas)` parameters: every name of `keep` (default all) on
    2 replicas, `everywhere` on each count, the other pairs marked
    `exhaustive` (`make test-all`): on 1 or 4 replicas the internals are
    the same for each name."""
    keep = names if keep is None else keep
    return [pytest.param(name, replicas,
                         id=label.format(name=name, replicas=replicas),
                         marks=() if (replicas == 2 and name in keep)
                         or name == everywhere else pytest.mark.exhaustive)
            for name in sorted(names) for replicas in counts]


@pytest.mark.parametrize("optimizer, replicas",
                         on_replicas(OPTIMIZERS, (1, 2, 4), "adam"))
def test_accumulated_step_equals_big_batch_step(optimizer, replicas):
    micro = micro_batches([8] * 24)
    big = [merge(micro[i:i + 4]) for i in range(0, 24, 4)]
    reference = train(mirrored(1), batches_dataset(big), optimizer=optimizer)
    model = train(mirrored(replicas), batches_dataset(micro), accum_steps=4,
                  optimizer=optimizer)
    assert int(model.optimizer.iterations.numpy()) == 6
    assert int(reference.optimizer.iterations.numpy()) == 6
    start = workers.initial_weights(workers.build_mlp())
    assert max_diff(weights_of(reference), start) > 1e-2
    assert max_diff(weights_of(model), weights_of(reference)) < 1e-5
    np.testing.assert_allclose(
        float(model.optimizer.learning_rate.numpy()),
        float(reference.optimizer.learning_rate.numpy()))


@pytest.mark.parametrize("mode", ["window", "in_step"])
def test_float64_model_across_replicas(float64, mode):
    """A float64 model's gradients go into the all-reduce with the float32
    sample count (one all-reduce per dtype): the big-batch step, to
    float64's precision."""
    micro = [[a.astype("float64") for a in batch]
             for batch in micro_batches([8] * 8)]
    big = [merge(micro[i:i + 4]) for i in range(0, 8, 4)]
    reference = train(mirrored(1), batches_dataset(big),
                      optimizer="sgd_momentum")
    model = train(mirrored(2), batches_dataset(
        micro if mode == "window" else big), accum_steps=4,
        optimizer="sgd_momentum", mode=mode)
    assert {w.dtype for w in weights_of(model)} == {np.dtype("float64")}
    assert int(model.optimizer.iterations.numpy()) == 2
    assert max_diff(weights_of(model), weights_of(reference)) < 1e-12


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_sample_weights_and_unequal_micro_batches(replicas):
    sizes = [8, 6, 8, 5, 8, 8, 7, 4]
    micro = micro_batches(sizes, weights=True)
    big = [merge(micro[:4]), merge(micro[4:])]
    reference = train(mirrored(1), batches_dataset(big),
                      optimizer="sgd_momentum")
    model = train(mirrored(replicas), batches_dataset(micro), accum_steps=4,
                  optimizer="sgd_momentum")
    assert int(model.optimizer.iterations.numpy()) == 2
    assert max_diff(weights_of(model), weights_of(reference)) < 1e-5
    # An unweighted average of micro-batch means would be measurably off.
    naive = [[b[0], b[1], b[2] * len(sizes) * 8 / sum(sizes)] for b in micro]
    wrong = train(mirrored(1), batches_dataset(naive), accum_steps=4,
                  optimizer="sgd_momentum")
    assert max_diff(weights_of(wrong), weights_of(reference)) > 1e-4


@pytest.mark.parametrize("mode, reference_groups, updates", [
    # 10 micro-batches of 8 per epoch, 2 epochs, accum_steps=4.
    ("apply", [(0, 4), (4, 8), (8, 10)] * 2, 6),
    ("drop", [(0, 4), (4, 8)] * 2, 4),
    ("carry", None, 5),
])
def test_partial_window_at_epoch_end(mode, reference_groups, updates):
    micro = micro_batches([8] * 10)
    if mode == "carry":
        # The window that epoch 1 leaves open continues into epoch 2.
        stream = micro + micro
        big = [merge(stream[i:i + 4]) for i in range(0, 20, 4)]
    else:
        big = [merge(micro[a:b]) for a, b in reference_groups]
    reference = train(mirrored(1), batches_dataset(big),
                      optimizer="sgd_momentum")
    model = train(mirrored(2), batches_dataset(micro), accum_steps=4,
                  partial_window=mode, epochs=2, optimizer="sgd_momentum")
    assert int(model.optimizer.iterations.numpy()) == updates
    assert int(reference.optimizer.iterations.numpy()) == updates
    assert max_diff(weights_of(model), weights_of(reference)) < 1e-5
    assert model.micro_step == 0


def test_has_updated_says_which_micro_batch_closed_a_window():
    """7 micro-batches, windows of 3: the 3rd and 6th close one; the 7th
    opens a window the epoch's end applies ("apply")."""
    with mirrored(2).scope():
        model = GradientAccumulationModel(workers.build_mlp(), accum_steps=3)
        model.compile(OPTIMIZERS["sgd_momentum"](), "mse")
    assert model.has_updated is False
    seen = []
    model.fit(batches_dataset(micro_batches([8] * 7)), epochs=1, verbose=0,
              shuffle=False, callbacks=[keras.callbacks.LambdaCallback(
                  on_train_batch_end=lambda batch, logs: seen.append(
                      (batch, model.has_updated)),
                  on_epoch_end=lambda epoch, logs: seen.append(
                      ("end", model.has_updated)))])
    assert seen == [(0, False), (1, False), (2, True), (3, False),
                    (4, False), (5, True), (6, False), ("end", True)]


def test_partial_window_is_applied_before_validation():
    micro = micro_batches([8] * 6)
    seen = {}

    class Spy(keras.callbacks.Callback):
        def on_test_begin(self, logs=None):
            seen["iterations"] = int(self.model.optimizer.iterations.numpy())

    with mirrored(2).scope():
        model = GradientAccumulationModel(workers.build_mlp(), accum_steps=4)
        model.compile("sgd", "mse")
    model.fit(batches_dataset(micro), validation_data=batches_dataset(micro),
              epochs=1, verbose=0, callbacks=[Spy()])
    assert seen["iterations"] == 2


def test_accum_steps_1_is_plain_fit():
    micro = micro_batches([16] * 8)
    for replicas in (1, 2):
        plain = train(mirrored(replicas), batches_dataset(micro))
        model = train(mirrored(replicas), batches_dataset(micro),
                      accum_steps=1)
        assert int(model.optimizer.iterations.numpy()) == 8
        assert max_diff(weights_of(model), weights_of(plain)) < 1e-6
        a = model.evaluate(batches_dataset(micro), verbose=0)
        b = plain.evaluate(batches_dataset(micro), verbose=0)
        assert a == pytest.approx(b, rel=1e-5)


def test_log_window_logs_gradient_norm_and_progress():
    micro = micro_batches([8] * 8)
    # The first update's gradient: the mean-loss gradient of the first 32
    # samples, at the initial weights.
    inner = workers.build_mlp()
    x, y = merge(micro[:4])
    with tf.GradientTape() as tape:
        loss = keras.losses.mean_squared_error(y, inner(x))
        loss = tf.reduce_mean(loss)
    expected_norm = float(tf.linalg.global_norm(
        tape.gradient(loss, inner.trainable_variables)))
    logged = []

    class Collect(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            logged.append((float(logs["accum_step"]), float(logs["grad_norm"])))

    with mirrored(2).scope():
        model = GradientAccumulationModel(workers.build_mlp(), accum_steps=4,
                                          log_window=True)
        model.compile(keras.optimizers.SGD(0.1, global_clipnorm=1e-3), "mse")
    model.fit(batches_dataset(micro), epochs=1, verbose=0,
              callbacks=[Collect()])
    assert [step for step, _ in logged] == [1, 2, 3, 0, 1, 2, 3, 0]
    assert [norm for _, norm in logged[:3]] == [0.0, 0.0, 0.0]
    # Reported before clipping.
    assert logged[3][1] == pytest.approx(expected_norm, rel=1e-5)
    assert logged[3][1] > 1e-2


class CountingAllReduce(tf.distribute.ReductionToOneDevice):
    """Counts reductions whose payload includes a gradient-shaped tensor."""

    def __init__(self, gradient_shape):
        super().__init__()
        self.gradient_shape = tuple(gradient_shape)
        self.calls = 0
        self.in_batch = False

    def _count(self, values):
        for value in values:
            for v in getattr(value, "values", (value,)):
                if tuple(v.shape) == self.gradient_shape:
                    self.calls += 1
                    return

    def reduce_implementation(self, reduce_op, per_replica_value,
                              destinations, options):
        if not self.in_batch:
            self._count([per_replica_value])
        return super().reduce_implementation(reduce_op, per_replica_value,
                                             destinations, options)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs,
                                    options):
        # One batched reduction is one all-reduce, however it is carried out.
        self._count([v for v, _ in value_destination_pairs])
        self.in_batch = True
        try:
            return super().batch_reduce_implementation(
                reduce_op, value_destination_pairs, options)
        finally:
            self.in_batch = False


@pytest.mark.parametrize("run_eagerly", [True, False])
def test_one_all_reduce_per_optimizer_step(run_eagerly):
    # With exact clipping on (auto_strategy applies it), a clipped plain
    # `fit` all-reduces before it clips, and only then; the wrapper, which
    # reduces itself, is left alone.
    compat.enable_exact_clipping()
    micro = micro_batches([8] * 12)
    kernel_shape = (workers.FEATURES, 16)
    counts = {}
    for name, accum_steps, optimizer in (
            ("plain", None, "adam"),
            ("clipped", None, "adam_global_clipnorm"),
            ("accumulated", 4, "adam_global_clipnorm")):
        ops = CountingAllReduce(kernel_shape)
        cls = type("CountingMirrored", (tf.distribute.MirroredStrategy,),
                   {"_collective_key_base": 50_000})
        strategy = cls(["/cpu:0", "/cpu:1"], cross_device_ops=ops)
        model = train(strategy, batches_dataset(micro),
                      accum_steps=accum_steps, optimizer=optimizer,
                      run_eagerly=run_eagerly)
        counts[name] = ops.calls
        expected_steps = 12 if accum_steps is None else 3
        assert int(model.optimizer.iterations.numpy()) == expected_steps
    if run_eagerly:
        # Python runs every step: the count is the executed all-reduces.
        assert counts == {"plain": 12, "clipped": 12, "accumulated": 3}
    else:
        # Traced once: one all-reduce in the graph, inside the branch that
        # runs on a window's last micro-batch only (the eager case above
        # shows the branch is not taken on the others).
        assert counts == {"plain": 1, "clipped": 1, "accumulated": 1}


def test_steps_per_execution_and_jit_compile():
    micro = micro_batches([8] * 12)
    reference = train(mirrored(1), batches_dataset(micro), accum_steps=4)
    for kwargs in ({"steps_per_execution": 3}, {"steps_per_execution": 5},
                   {"jit_compile": True}):
        model = train(mirrored(1), batches_dataset(micro), accum_steps=4,
                      **kwargs)
        assert int(model.optimizer.iterations.numpy()) == 3, kwargs
        assert max_diff(weights_of(model), weights_of(reference)) < 1e-5
    # Several replicas: Keras's own multi-step loop fails there; the compat
    # fix the wrapper applies runs it.
    for steps in (3, 5):
        model = train(mirrored(2), batches_dataset(micro), accum_steps=4,
                      steps_per_execution=steps)
        assert int(model.optimizer.iterations.numpy()) == 3, steps
        assert max_diff(weights_of(model), weights_of(reference)) < 1e-5


def test_synchronized_batch_norm_under_mirrored():
    x, y = workers.regression_data(64)
    with mirrored(2).scope():
        inner = keras.Sequential([
            keras.Input((workers.FEATURES,)),
            keras.layers.Dense(16),
            keras.layers.BatchNormalization(synchronized=True),
            keras.layers.Activation("relu"),
            keras.layers.Dense(1),
        ])
        model = GradientAccumulationModel(inner, accum_steps=2)
        model.compile("adam", "mse")
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                        shuffle=False)
    assert int(model.optimizer.iterations.numpy()) == 8
    assert np.all(np.isfinite(history.history["loss"]))
    moving_mean = inner.layers[1].moving_mean.numpy()
    assert np.abs(moving_mean).max() > 0


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


def functional():
    inputs = keras.Input((workers.FEATURES,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


@pytest.mark.parametrize("kind", ["sequential_unbuilt", "functional",
                                  "subclassed"])
def test_wraps_any_model(kind, tmp_path):
    build = {
        "sequential_unbuilt": lambda: keras.Sequential(
            [keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]),
        "functional": functional,
        "subclassed": Subclassed,
    }[kind]
    x, y = workers.regression_data(64)
    with mirrored(2).scope():
        inner = build()
        model = GradientAccumulationModel(inner, accum_steps=2)
        model.compile("adam", "mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4
    # The logs of the wrapped model, nothing more (log_window=False).
    assert set(history.history) == {"loss", "mae"}
    assert model.inner is inner
    np.testing.assert_allclose(model.predict(x, verbose=0),
                               inner.predict(x, verbose=0), atol=1e-6)
    model.summary(print_fn=lambda *a, **k: None)

    weights_path = str(tmp_path / "w.weights.h5")
    model.save_weights(weights_path)
    with mirrored(2).scope():
        again = GradientAccumulationModel(build(), accum_steps=2)
        again.build((None, workers.FEATURES))
        again.compile("adam", "mse", metrics=["mae"])
    again.load_weights(weights_path)
    np.testing.assert_allclose(again.predict(x, verbose=0),
                               model.predict(x, verbose=0), atol=1e-6)


def test_save_and_load_model_round_trip(tmp_path):
    x, y = workers.regression_data(64)
    model = GradientAccumulationModel(functional(), accum_steps=3,
                                      partial_window="carry")
    model.compile("adam", "mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # 8 micro: 2 left
    assert model.micro_step == 2
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, GradientAccumulationModel)
    assert (loaded.accum_steps, loaded.partial_window) == (3, "carry")
    assert loaded.micro_step == 2
    assert loaded.compiled
    assert int(loaded.optimizer.iterations.numpy()) == 2
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(loaded.predict(x, verbose=0),
                               model.predict(x, verbose=0), atol=1e-6)
    for a, b in zip(loaded._accumulators, model._accumulators):
        np.testing.assert_allclose(a.numpy(), b.numpy())
    assert np.abs(loaded._accumulators[0].numpy()).max() > 0
    # The inner model exports on its own.
    inner_path = str(tmp_path / "inner.keras")
    loaded.inner.save(inner_path)
    np.testing.assert_allclose(
        keras.models.load_model(inner_path).predict(x, verbose=0),
        model.predict(x, verbose=0), atol=1e-6)


@pytest.mark.parametrize("replicas", [1, 2])
def test_half_finished_window_survives_save_and_restore(tmp_path, replicas):
    micro = micro_batches([8] * 12)
    strategy = mirrored(replicas)
    full = train(strategy, batches_dataset(micro), accum_steps=4,
                 partial_window="carry", optimizer="sgd_momentum")

    first = train(strategy, batches_dataset(micro[:6]), accum_steps=4,
                  partial_window="carry", optimizer="sgd_momentum")
    assert first.micro_step == 2
    path = str(tmp_path / "mid_window.weights.h5")
    first.save_weights(path)
    with strategy.scope():
        resumed = GradientAccumulationModel(workers.build_mlp(), accum_steps=4,
                                            partial_window="carry")
        resumed.compile(OPTIMIZERS["sgd_momentum"](), "mse")
        resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(path)
    assert resumed.micro_step == 2
    resumed.fit(batches_dataset(micro[6:]), epochs=1, verbose=0,
                shuffle=False)
    assert int(resumed.optimizer.iterations.numpy()) == 3
    assert max_diff(weights_of(resumed), weights_of(full)) < 1e-6


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "4", 2**31, 2**70])
def test_bad_accum_steps(bad):
    with pytest.raises(ValueError, match=f"got {bad!r}") as info:
        GradientAccumulationModel(workers.build_mlp(), accum_steps=bad)
    assert "an integer from 1 to 2147483647 (2**31 - 1)" in str(info.value)


@pytest.mark.parametrize("mode", ["window", "in_step"])
def test_largest_accum_steps_trains(mode):
    # One window longer than any epoch: applied (partial) at its end.
    model = train(mirrored(1), batches_dataset(micro_batches([8, 8])),
                  accum_steps=2**31 - 1, mode=mode)
    assert int(model.optimizer.iterations.numpy()) == (
        1 if mode == "window" else 2)


def test_bad_partial_window():
    with pytest.raises(ValueError, match="got 'keep'"):
        GradientAccumulationModel(workers.build_mlp(), partial_window="keep")


def test_wrapping_twice_is_an_error():
    inner = workers.build_mlp()
    wrapper = GradientAccumulationModel(inner, accum_steps=2)
    with pytest.raises(ValueError, match="already a GradientAccumulationModel"):
        GradientAccumulationModel(wrapper, accum_steps=2)
    with pytest.raises(ValueError, match="already wrapped"):
        GradientAccumulationModel(inner, accum_steps=2)
    del wrapper
    import gc

    gc.collect()
    GradientAccumulationModel(inner, accum_steps=2)


def test_optimizer_with_its_own_accumulation_is_an_error():
    model = GradientAccumulationModel(workers.build_mlp(), accum_steps=2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4"):
        model.compile(keras.optimizers.Adam(gradient_accumulation_steps=4),
                      "mse")


def test_compiling_the_inner_model_is_an_error():
    inner = workers.build_mlp()
    inner.compile("adam", "mse")
    with pytest.raises(ValueError, match="Compile the GradientAccumulation"):
        GradientAccumulationModel(inner)
    inner = workers.build_mlp()
    model = GradientAccumulationModel(inner, accum_steps=2)
    model.compile("adam", "mse")
    inner.compile("adam", "mse")
    x, y = workers.regression_data(16)
    with pytest.raises(ValueError, match="was compiled itself"):
        model.fit(x, y, verbose=0)


def test_multi_worker_matches_mirrored(run_workers):
    results = run_workers(workers.multi_worker_accumulation)
    reference = workers.accumulation_run(mirrored(2))
    for r in results:
        assert r.result["iterations"] == reference["iterations"] == 6
        assert max_diff([np.asarray(w) for w in r.result["weights"]],
                        [np.asarray(w) for w in reference["weights"]]) < 1e-5


# --- Issue #16: output names, float8, parameter count, logs -----------------


def two_output_model(outputs="list"):
    inputs = keras.Input((workers.FEATURES,), name="features")
    hidden = keras.layers.Dense(16, activation="tanh", name="hidden")(inputs)
    a = keras.layers.Dense(1, name="a")(hidden)
    b = keras.layers.Dense(2, name="b")(hidden)
    model = keras.Model(inputs, [a, b] if outputs == "list" else
                        {"a": a, "b": b})
    model.set_weights(workers.initial_weights(model))
    return model


def two_output_data(sizes, seed=0):
    """Micro-batches (x, {"a": ..., "b": ...}) and their concatenation."""
    x, y = workers.regression_data(sum(sizes), seed=seed)
    b = np.concatenate([np.sin(x[:, :1]), y * x[:, 1:2]], axis=1)
    out, start = [], 0
    for size in sizes:
        part = slice(start, start + size)
        out.append((x[part], {"a": y[part], "b": b[part]}))
        start += size
    big = (x, {"a": y, "b": b})
    return out, big


NAME_KEYED = dict(loss={"a": "mse", "b": "mae"},
                  loss_weights={"a": 1.0, "b": 0.5},
                  metrics={"a": ["mae"]})


@pytest.mark.parametrize("outputs", ["list", "dict"])
def test_losses_metrics_and_targets_keyed_by_output_name(outputs, tmp_path):
    micro, big = two_output_data([8] * 4)
    reference = two_output_model(outputs)
    reference.compile(keras.optimizers.SGD(0.1, momentum=0.9), **NAME_KEYED)
    expected = reference.fit(batches_dataset([big]), verbose=0).history
    model = GradientAccumulationModel(two_output_model(outputs), accum_steps=4)
    assert model.output_names == model.inner.output_names == ["a", "b"]
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), **NAME_KEYED)
    history = model.fit(batches_dataset(micro), verbose=0).history
    assert int(model.optimizer.iterations.numpy()) == 1
    assert max_diff(weights_of(model), weights_of(reference)) < 1e-6
    # The same logs, and (one window, all at the initial weights) values.
    assert set(history) == set(expected)
    for key in expected:
        assert history[key] == pytest.approx(expected[key], rel=1e-5), key

    path = str(tmp_path / "two_outputs.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.output_names == ["a", "b"]
    for m in (model, loaded, reference):
        m.fit(batches_dataset(micro if m is not reference else [big]),
              verbose=0)
    assert max_diff(weights_of(loaded), weights_of(model)) < 1e-6
    assert max_diff(weights_of(model), weights_of(reference)) < 1e-6


def float8_mlp():
    model = workers.build_mlp()
    with warnings.catch_warnings():
        # "Layer InputLayer does not have a `quantize` method implemented."
        warnings.simplefilter("ignore", UserWarning)
        model.quantize("float8")
    return model


def float8_parts(model):
    """(scale and amax-history variables, the other weights) of a model."""
    overwrite, regular = [], []
    for v in getattr(model, "inner", model).trainable_variables:
        (overwrite if v.overwrite_with_gradient else regular).append(
            v.numpy())
    return overwrite, regular


def test_float8_scales_follow_keras_accumulation():
    """Keras's `gradient_accumulation_steps` keeps the maximum of the
    window's new scales and amax histories, unweighted; one step (N=1) is
    plain `fit`."""
    micro = micro_batches([8] * 8)
    runs = {}
    for name, steps in (("stock", 4), ("plain", None)):
        model = float8_mlp()
        model.compile(keras.optimizers.SGD(0.1,
                                           gradient_accumulation_steps=steps),
                      "mse")
        model.fit(batches_dataset(micro), verbose=0, shuffle=False)
        runs[name] = float8_parts(model)
    for name, accum_steps in (("stock", 4), ("plain", 1)):
        model = GradientAccumulationModel(float8_mlp(),
                                          accum_steps=accum_steps)
        model.compile(keras.optimizers.SGD(0.1), "mse")
        model.fit(batches_dataset(micro), verbose=0, shuffle=False)
        overwrite, regular = float8_parts(model)
        expected_overwrite, expected_regular = runs[name]
        assert len(overwrite) == 12
        # Scales moved off their initial 1.0 after the first window; before
        # the fix they were divided by the window's sample count.
        assert all(0 < v.max() < 0.1 for v in overwrite if v.shape == ())
        assert max_diff(overwrite, expected_overwrite) == 0.0, name
        assert max_diff(regular, expected_regular) < 1e-6, name


def test_float8_under_mirrored_matches_one_replica():
    micro = micro_batches([8] * 8)
    results = {}
    for replicas in (1, 2):
        strategy = mirrored(replicas)
        with strategy.scope():
            model = GradientAccumulationModel(float8_mlp(), accum_steps=4)
            model.compile(keras.optimizers.SGD(0.1), "mse")
        model.fit(batches_dataset(micro), verbose=0, shuffle=False)
        results[replicas] = float8_parts(model)
        for v in model.trainable_variables:
            copies = strategy.experimental_local_results(v.value)
            for copy in copies[1:]:
                np.testing.assert_array_equal(copy.numpy(), copies[0].numpy())
    (overwrite_1, regular_1), (overwrite_2, regular_2) = results[1], results[2]
    # The amax histories are the maximum over all replicas' samples.
    for a, b in zip(overwrite_2, overwrite_1):
        np.testing.assert_allclose(a, b, rtol=1e-4)
    # Keras's float8 Dense casts its bias to bfloat16, so the bias gradient
    # is summed in bfloat16: 4-row and 8-row sums round differently (plain
    # Keras under MirroredStrategy differs from one device as much).
    assert max_diff(regular_2, regular_1) < 1e-3


def test_count_params_and_summary_show_the_wrapped_model_only(tmp_path):
    inner = workers.build_mlp()
    model = GradientAccumulationModel(inner, accum_steps=4,
                                      partial_window="carry")
    assert model.count_params() == inner.count_params() == 161
    assert len(model.weights) == len(inner.weights)
    for a, b in zip(model.get_weights(), inner.get_weights()):
        np.testing.assert_array_equal(a, b)
    lines = []
    model.summary(print_fn=lambda line, *a, **k: lines.append(line))
    text = "\n".join(lines)
    assert "Total params: 161 " in text
    assert "Non-trainable params: 0 " in text

    # The window is still saved with the weights.
    micro = micro_batches([8] * 2)
    model.compile("sgd", "mse")
    model.fit(batches_dataset(micro), verbose=0, shuffle=False)
    assert model.micro_step == 2
    path = str(tmp_path / "mid_window.weights.h5")
    model.save_weights(path)
    again = GradientAccumulationModel(workers.build_mlp(), accum_steps=4,
                                      partial_window="carry")
    again.load_weights(path)
    assert again.micro_step == 2
    for a, b in zip(again._accumulators, model._accumulators):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert np.abs(again._accumulators[0].numpy()).max() > 0


def test_fit_logs_what_the_wrapped_model_logs():
    micro = micro_batches([8] * 4)
    keys = {}
    for name, log_window in (("plain", None), ("wrapper", False),
                             ("log_window", True)):
        model = workers.build_mlp()
        if log_window is not None:
            model = GradientAccumulationModel(model, accum_steps=2,
                                              log_window=log_window)
        model.compile("sgd", "mse", metrics=["mae"])
        seen = []

        class Collect(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                seen.append(set(logs))

        history = model.fit(batches_dataset(micro), verbose=0,
                            callbacks=[Collect()])
        keys[name] = seen[-1] | set(history.history)
    assert keys["wrapper"] == keys["plain"] == {"loss", "mae"}
    assert keys["log_window"] == {"loss", "mae", "grad_norm", "accum_step"}
    config = GradientAccumulationModel(workers.build_mlp(),
                                       log_window=True).get_config()
    assert config["log_window"] is True
    with pytest.raises(ValueError, match="log_window must be True or False"):
        GradientAccumulationModel(workers.build_mlp(), log_window="yes")
