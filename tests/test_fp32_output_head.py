"""FP32OutputHead: float32 output and loss from float32 logits, any policy."""


import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mgpu.callbacks import LossScaleMonitor
from keras_mgpu.layers import FP32OutputHead
from tests.conftest import mirrored

POLICIES = ["float32", "mixed_float16", "mixed_bfloat16"]
FEATURES, CLASSES = 4, 3


def head_model(activation="softmax", units=CLASSES, float32_matmul=False,
               hidden=True, name="head"):
    inputs = keras.Input((FEATURES,))
    x = keras.layers.Dense(8, activation="tanh")(inputs) if hidden else inputs
    outputs = FP32OutputHead(units, activation=activation, name=name,
                             float32_matmul=float32_matmul)(x)
    return keras.Model(inputs, outputs)


def huge_logit_data(units=CLASSES):
    """Inputs and a head kernel whose logits reach about +-80000.

    80000 is beyond float16's largest finite value (65504): computed in
    float16 these logits are inf, and softmax/CE of them NaN.
    """
    x = np.array([[1.0, 0.5, -0.5, 2.0], [-1.0, 1.5, 0.25, -2.0],
                  [0.5, -1.0, 1.0, 1.0], [2.0, 0.0, -1.5, 0.5]], "float32")
    kernel = np.linspace(-1, 1, FEATURES * units).reshape(FEATURES, units)
    kernel = (kernel * 20000.0).astype("float32")
    return x, kernel


@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES, indirect=True)
@pytest.mark.parametrize("activation", ["softmax", "sigmoid", None])
def test_output_is_float32_under_every_policy(policy, activation):
    model = head_model(activation=activation)
    assert model.outputs[0].dtype == "float32"
    assert model.layers[1].compute_dtype == policy.replace("mixed_", "")
    out = model(np.ones((2, FEATURES), "float32"))
    assert keras.backend.standardize_dtype(out.dtype) == "float32"


@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES, indirect=True)
def test_float32_matmul_runs_the_dense_in_float32(policy):
    model = head_model(float32_matmul=True)
    head = model.layers[-1]
    assert head.dense.compute_dtype == "float32"
    assert model.outputs[0].dtype == "float32"


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
@pytest.mark.parametrize("loss,activation,labels", [
    ("sparse_categorical_crossentropy", "softmax", [0, 1, 2, 1]),
    ("categorical_crossentropy", "softmax", np.eye(3)[[0, 1, 2, 1]]),
    ("binary_crossentropy", "sigmoid", [[1, 0, 1], [0, 0, 1], [1, 1, 0],
                                        [0, 1, 0]]),
])
def test_overflowing_logits_give_finite_loss_and_float32_gradients(
        policy, loss, activation, labels):
    x, kernel = huge_logit_data()
    y = np.asarray(labels, "float32")
    model = head_model(activation=activation, float32_matmul=True,
                       hidden=False)
    model.layers[-1].dense.set_weights([kernel, np.zeros(CLASSES, "float32")])
    keras.mixed_precision.set_global_policy("float32")
    reference = keras.Sequential([keras.Input((FEATURES,)),
                                  keras.layers.Dense(CLASSES)])
    reference.set_weights([kernel, np.zeros(CLASSES, "float32")])
    loss_class = {
        "sparse_categorical_crossentropy":
            keras.losses.SparseCategoricalCrossentropy,
        "categorical_crossentropy": keras.losses.CategoricalCrossentropy,
        "binary_crossentropy": keras.losses.BinaryCrossentropy,
    }[loss]
    # The head's loss is the default from_logits=False, as users write it.
    loss_fn = loss_class()
    reference_loss_fn = loss_class(from_logits=True)

    @tf.function
    def loss_and_grads(m, fn, scale):
        with tf.GradientTape() as tape:
            value = fn(y, m(x, training=True))
            scaled = value * scale
        return value, tape.gradient(scaled, m.trainable_variables)

    # The loss scale a LossScaleOptimizer starts with under mixed_float16.
    scale = 2.0 ** 15
    value, grads = loss_and_grads(model, loss_fn, scale)
    ref_value, ref_grads = loss_and_grads(reference, reference_loss_fn, 1.0)
    assert np.isfinite(value.numpy()) and value.numpy() > 1000.0
    # Everything from the logits on is float32 in both, and scaling by a
    # power of two is exact in float32 (no overflow: |grad| <= 4 * 2**15),
    # so the two agree to float32 rounding of the loss sum.
    np.testing.assert_allclose(value.numpy(), ref_value.numpy(), rtol=1e-6)
    for g, ref in zip(grads, ref_grads):
        g = g.numpy() / scale
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, ref.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_plain_float16_softmax_head_gets_clipped_loss_where_head_does_not(
        policy):
    """The baseline the head fixes: same weights, float16 Dense(softmax)."""
    x, kernel = huge_logit_data()
    y = np.array([0, 1, 2, 1], "float32")
    plain = keras.Sequential([keras.Input((FEATURES,)),
                              keras.layers.Dense(CLASSES,
                                                 activation="softmax")])
    plain.set_weights([kernel, np.zeros(CLASSES, "float32")])
    plain.compile("sgd", "sparse_categorical_crossentropy")
    headed = head_model(float32_matmul=True, hidden=False)
    headed.layers[-1].dense.set_weights([kernel, np.zeros(CLASSES)])
    headed.compile("sgd", "sparse_categorical_crossentropy")
    logits = x @ kernel
    true_loss = np.mean(
        np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1))
        + logits.max(-1) - logits[np.arange(4), y.astype(int)])
    assert true_loss > 1000.0
    plain_loss = plain.evaluate(x, y, verbose=0, return_dict=True)["loss"]
    # Probabilities clipped to [1e-7, 1 - 1e-7]: the loss is capped at
    # -log(1e-7) ~ 16 (or NaN), whatever the logits.
    assert not np.isfinite(plain_loss) or plain_loss < 17.0
    headed_loss = headed.evaluate(x, y, verbose=0, return_dict=True)["loss"]
    np.testing.assert_allclose(headed_loss, true_loss, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_fit_step_matches_float32_reference(policy):
    """One fit step under a LossScaleOptimizer equals the float32 step."""
    x, kernel = huge_logit_data()
    y = np.array([0, 1, 2, 1], "float32")
    model = head_model(float32_matmul=True, hidden=False)
    model.layers[-1].dense.set_weights([kernel, np.zeros(CLASSES)])
    model.compile(keras.optimizers.SGD(1e-3), "sparse_categorical_crossentropy")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    keras.mixed_precision.set_global_policy("float32")
    reference = head_model(float32_matmul=True, hidden=False)
    reference.layers[-1].dense.set_weights([kernel, np.zeros(CLASSES)])
    reference.compile(keras.optimizers.SGD(1e-3),
                      "sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    reference.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    assert int(model.optimizer.iterations.numpy()) == 1  # not skipped
    for w, ref in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(w, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES, indirect=True)
def test_predict_returns_probabilities(policy):
    model = head_model()
    probs = model.predict(np.random.RandomState(0).randn(5, FEATURES),
                          verbose=0)
    assert probs.dtype == np.float32
    assert np.all(probs >= 0)
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=1e-5)
    sig = head_model(activation="sigmoid", name="sig").predict(
        np.ones((2, FEATURES)), verbose=0)
    assert np.all((sig > 0) & (sig < 1))


@pytest.mark.gpu
@pytest.mark.parametrize("replicas", [1, 2])
def test_nonfinite_counts_show_in_fit_logs(replicas):
    x = np.random.RandomState(1).randn(16, FEATURES).astype("float32")
    y = np.zeros(16, "float32")
    # Two poisoned samples, in different batches, both on the first replica
    # under 2: Keras 3.15's LossScaleOptimizer takes its finite check from
    # the first replica's (not yet all-reduced) gradients only, so a NaN on
    # another replica would be applied and poison the weights.
    # NaN, not inf: an inf feature gives inf or NaN logits depending on the
    # signs of the initial kernel, and softmax then leaves 1 or 3 of the
    # outputs non-finite; a NaN reaches every output, whatever the weights.
    x[3, 1] = np.nan
    x[9, 0] = np.nan
    keras.utils.set_random_seed(0)
    strategy = mirrored(replicas)
    with strategy.scope():
        model = head_model(hidden=False)
        # The loss-scale optimizer skips the poisoned steps (non-finite
        # gradients), so the weights stay finite and only poisoned samples
        # produce non-finite outputs: a forward-pass problem, told apart.
        model.compile(keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD()), "sparse_categorical_crossentropy")
    head = model.get_layer("head")
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                        shuffle=False, callbacks=[LossScaleMonitor()])
    # One bad feature per poisoned sample reaches the head's input; every
    # one of its CLASSES outputs is then non-finite.
    assert history.history["head_nonfinite_inputs"] == [2, 2]
    assert history.history["head_nonfinite_outputs"] == [6, 6]
    # The head's own totals, over both epochs and all replicas.
    assert head.nonfinite_counts == {"inputs": 4, "outputs": 12}
    # Not a metric of the model: Keras neither logs nor resets it.
    assert "head_nonfinite_inputs" not in [m.name for m in model.metrics]
    plain = model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    assert sorted(plain.history) == ["loss"]
    assert head.nonfinite_counts == {"inputs": 6, "outputs": 18}

    seen = []

    class Batches(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(logs.get("head_nonfinite_inputs"))

    clean = np.nan_to_num(x, nan=0.0, posinf=0.0)
    history = model.fit(clean, y, batch_size=8, epochs=1, verbose=0,
                        callbacks=[LossScaleMonitor(), Batches()])
    # Nothing non-finite in this fit: nothing logged.
    assert seen == [None, None]
    assert "head_nonfinite_inputs" not in history.history
    late = clean.copy()
    late[9, 0] = np.nan
    history = model.fit(late, y, batch_size=8, epochs=1, verbose=0,
                        shuffle=False,
                        callbacks=[LossScaleMonitor(), Batches()])
    # Logged from the first batch with a non-finite value on, as the
    # epoch's running total, summed over replicas.
    assert seen[2:] == [None, 1]
    assert history.history["head_nonfinite_outputs"] == [3]
    head.reset_nonfinite_counts()
    assert head.nonfinite_counts == {"inputs": 0, "outputs": 0}


def test_config_round_trip():
    head = FP32OutputHead(5, activation="sigmoid", float32_matmul=True,
                          use_bias=False, kernel_initializer="zeros",
                          name="out")
    config = head.get_config()
    again = FP32OutputHead.from_config(config)
    assert again.get_config() == config
    assert (again.units, again.float32_matmul, again.name) == (5, True, "out")
    assert again.dense.use_bias is False
    assert keras.saving.get_registered_name(FP32OutputHead) == \
        "keras_mgpu>FP32OutputHead"


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"],
                         indirect=True)
def test_save_and_load_under_mirrored(policy, tmp_path):
    strategy = mirrored(2)
    x = np.random.RandomState(2).randn(16, FEATURES).astype("float32")
    y = (np.arange(16) % CLASSES).astype("float32")
    with strategy.scope():
        model = head_model(float32_matmul=True)
        model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    with strategy.scope():
        loaded = keras.models.load_model(path)
    head = loaded.layers[-1]
    assert isinstance(head, FP32OutputHead) and head.float32_matmul
    assert head.compute_dtype == policy.replace("mixed_", "")
    np.testing.assert_allclose(loaded.predict(x, verbose=0),
                               model.predict(x, verbose=0), rtol=1e-6)
    history = loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert sorted(history.history) == ["loss"]
    assert head.nonfinite_counts == {"inputs": 0, "outputs": 0}


def test_counts_stay_out_of_fit_logs_under_multi_worker(run_workers):
    # The head counts under MultiWorkerMirroredStrategy (its counters are
    # replica-local variables); with nothing non-finite, fit's logs are
    # Keras's own.
    from tests import workers

    results = run_workers(workers.multi_worker_fp32_head)
    for r in results:
        assert sorted(r.result) == ["loss"]
        assert len(r.result["loss"]) == 2


@pytest.mark.parametrize("units", [2.7, 3.0, True, 0, -1, "3", None])
def test_units_must_be_a_positive_integer(units):
    # int(2.7) used to build a 2-unit head without a word.
    with pytest.raises(ValueError, match="units must be a positive integer") \
            as info:
        FP32OutputHead(units)
    assert f"got {units!r}." in str(info.value)
    assert "Pass an int" in str(info.value)


def test_numpy_integer_units_are_accepted_as_int():
    head = FP32OutputHead(np.int64(4))
    assert head.units == 4 and type(head.units) is int
    assert head.get_config()["units"] == 4


@pytest.mark.parametrize("value", ["False", 0, None])
def test_float32_matmul_must_be_a_bool(value):
    # bool("False") used to turn the float32 matmul on.
    with pytest.raises(TypeError, match=(
            f"float32_matmul must be True or False, got {value!r}")):
        FP32OutputHead(3, float32_matmul=value)
    assert FP32OutputHead(3, float32_matmul=np.bool_(True)).float32_matmul


def test_unknown_activation_names_the_value_and_the_choices():
    with pytest.raises(ValueError, match=(
            r"activation must be the name of a Keras activation \(e\.g\. "
            r"'softmax'.*got 'softmx'\.")):
        FP32OutputHead(3, activation="softmx")
