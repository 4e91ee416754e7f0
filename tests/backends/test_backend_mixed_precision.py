"""The float32 head and the mixed-precision audit on the active Keras
backend, 2 replicas, under both half-precision policies."""

import numpy as np
import pytest
import keras

from keras_mgpu import mixed_precision
from keras_mgpu.layers import FP32OutputHead

FEATURES = 6


def classifier(head):
    keras.utils.set_random_seed(5)
    return keras.Sequential([
        keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"),
        head])


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"],
                         indirect=True)
def test_the_head_outputs_float32_and_the_audit_sees_why(two_replicas, policy):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, FEATURES)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    with two_replicas():
        plain = classifier(keras.layers.Dense(2, activation="softmax"))
        headed = classifier(FP32OutputHead(2, activation="softmax"))
        for model in (plain, headed):
            model.compile("adam", "sparse_categorical_crossentropy")
    # The plain model's half-precision output and softmax are findings;
    # the head leaves none.
    problems = {f.problem.split(":")[0] for f in mixed_precision.audit(plain)}
    assert any(p.startswith("output is") for p in problems), problems
    assert any(p.startswith("softmax computed in") for p in problems), problems
    assert mixed_precision.audit(headed) == []
    with two_replicas():
        history = headed.fit(x, y, batch_size=16, epochs=2, verbose=0)
        probabilities = headed.predict(x, batch_size=16, verbose=0)
    assert keras.backend.standardize_dtype(probabilities.dtype) == "float32"
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)
    assert np.isfinite(history.history["loss"]).all()
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert headed.layers[-1].nonfinite_counts == {"inputs": 0, "outputs": 0}


# --- The head's loss is the loss of its float32 logits ----------------------
# Every sample's true answer is 40 logits below the winner: its loss is
# 40.000 from the logits, but -ln(1e-7) = 16.118 from probabilities
# clipped to [1e-7, 1 - 1e-7] (with no gradient through the clip). Every
# value here is exact in float16 and bfloat16.

CLASSES = 4
GAP = 40.0
LR = 0.1
HALF_POLICIES = ["mixed_bfloat16", "mixed_float16"]


def gap_example(loss_name):
    """(x, y, head kernel, the head's activation): one sample per class;
    sample k has logit 40 at class k (every other logit 0, or -40 for the
    sigmoid), and a label that makes every loss term 40."""
    x = np.eye(CLASSES, dtype="float32")
    winners = np.arange(CLASSES)
    if loss_name == "binary_crossentropy":
        # Logit +40 with label 0 and -40 with label 1: 40 per output.
        kernel = GAP * (2 * np.eye(CLASSES, dtype="float32") - 1)
        return x, 1.0 - np.eye(CLASSES, dtype="float32"), kernel, "sigmoid"
    kernel = GAP * np.eye(CLASSES, dtype="float32")
    labels = (winners + 1) % CLASSES
    if loss_name == "categorical_crossentropy":
        labels = np.eye(CLASSES, dtype="float32")[labels]
    return x, labels, kernel, "softmax"


def logit_loss_and_step(x, y, kernel, loss_name):
    """The float32 from-logits loss (float64 NumPy), and the kernel and
    bias after one SGD step on its batch mean."""
    logits = x.astype("float64") @ kernel
    if loss_name == "binary_crossentropy":
        terms = np.logaddexp(0, -logits) * y + np.logaddexp(0, logits) * (1 - y)
        loss = terms.mean()
        dlogits = (1 / (1 + np.exp(-logits)) - y) / y.size
    else:
        onehot = y if y.ndim == 2 else np.eye(CLASSES)[y]
        top = logits.max(-1, keepdims=True)
        log_p = logits - top - np.log(np.exp(logits - top).sum(-1,
                                                               keepdims=True))
        loss = -(onehot * log_p).sum(-1).mean()
        dlogits = (np.exp(log_p) - onehot) / len(x)
    return loss, (kernel - LR * x.T @ dlogits, -LR * dlogits.sum(0))


def loss_forms(loss_name):
    """The loss as `compile` takes it: its name, its class, its function."""
    cls = {"sparse_categorical_crossentropy":
           keras.losses.SparseCategoricalCrossentropy,
           "categorical_crossentropy": keras.losses.CategoricalCrossentropy,
           "binary_crossentropy": keras.losses.BinaryCrossentropy}[loss_name]
    return {"name": loss_name, "class": cls(),
            "function": getattr(keras.losses, loss_name)}


def gap_model(kernel, activation):
    model = keras.Sequential([
        keras.Input((CLASSES,)),
        FP32OutputHead(CLASSES, activation=activation, name="head")])
    model.get_layer("head").dense.set_weights(
        [kernel, np.zeros(CLASSES, "float32")])
    return model


def assert_one_logit_step(head, x, y, kernel, loss_name):
    _, (want_kernel, want_bias) = logit_loss_and_step(x, y, kernel, loss_name)
    got_kernel, got_bias = head.dense.get_weights()
    # Clipped probabilities give no gradient at all (a step of 0, not
    # 0.025); half precision rounds the step by far less than 1e-3.
    np.testing.assert_allclose(got_kernel, want_kernel, atol=1e-3)
    np.testing.assert_allclose(got_bias, want_bias, atol=1e-3)


@pytest.mark.parametrize("policy", HALF_POLICIES, indirect=True)
@pytest.mark.parametrize("loss_name", ["sparse_categorical_crossentropy",
                                       "categorical_crossentropy",
                                       "binary_crossentropy"])
def test_the_head_loss_is_the_loss_of_its_float32_logits(
        two_replicas, policy, loss_name):
    x, y, kernel, activation = gap_example(loss_name)
    want, _ = logit_loss_and_step(x, y, kernel, loss_name)
    assert abs(want - GAP) < 1e-6
    for form, loss in loss_forms(loss_name).items():
        with two_replicas():
            model = gap_model(kernel, activation)
            model.compile(keras.optimizers.SGD(LR), loss)
        # Outside the scope: under a TensorFlow strategy Keras's losses
        # divide by the replicas, for a sum over them.
        computed = float(model.compute_loss(x, y, model(x)))
        assert abs(computed - GAP) < 1e-3, (form, computed)
        if form != "name":
            continue
        with two_replicas():
            evaluated = model.evaluate(x, y, batch_size=4, verbose=0)
            assert abs(evaluated - GAP) < 1e-3, (form, evaluated)
            model.fit(x, y, batch_size=4, epochs=1, shuffle=False,
                      verbose=0)
        assert_one_logit_step(model.get_layer("head"), x, y, kernel,
                              loss_name)
    assert mixed_precision.audit(model) == []


@pytest.mark.parametrize("policy", HALF_POLICIES, indirect=True)
@pytest.mark.parametrize("mode,loss_name,form", [
    ("window", "sparse_categorical_crossentropy", "name"),
    ("in_step", "sparse_categorical_crossentropy", "class"),
    ("in_step", "binary_crossentropy", "function"),
])
def test_accumulation_gets_the_head_logits_too(two_replicas, policy, mode,
                                               loss_name, form):
    from keras_mgpu import GradientAccumulationModel

    x, y, kernel, activation = gap_example(loss_name)
    with two_replicas():
        model = GradientAccumulationModel(gap_model(kernel, activation),
                                          accum_steps=2, mode=mode)
        model.compile(keras.optimizers.SGD(LR), loss_forms(loss_name)[form])
        evaluated = model.evaluate(x, y, batch_size=4, verbose=0)
        assert abs(evaluated - GAP) < 1e-3, evaluated
        # One optimizer step: two steps of 2 samples (window), or one of
        # 4 split in two (in_step).
        model.fit(x, y, batch_size=2 if mode == "window" else 4, epochs=1,
                  shuffle=False, verbose=0)
    assert_one_logit_step(model.inner.get_layer("head"), x, y, kernel,
                          loss_name)
    assert mixed_precision.audit(model) == []


@pytest.mark.parametrize("policy", HALF_POLICIES, indirect=True)
def test_the_audit_flags_every_output_whose_loss_clips(two_replicas, policy):
    half = policy.split("_")[1]

    def clipping(model):
        return [f.layer for f in mixed_precision.audit(model)
                if f.problem.startswith("loss gets")]

    with two_replicas():
        dense = keras.Sequential([
            keras.Input((CLASSES,)),
            keras.layers.Dense(CLASSES, activation="softmax", name="probs")])
        head = gap_model(*gap_example("binary_crossentropy")[2:])
        # A float32 softmax after a half-precision layer: on TensorFlow
        # Keras's softmax attaches its logits; on JAX nothing reads them.
        split = keras.Sequential([
            keras.Input((CLASSES,)), keras.layers.Dense(CLASSES),
            keras.layers.Activation("softmax", dtype="float32",
                                    name="float32_softmax")])
        dense.compile("sgd", "sparse_categorical_crossentropy")
        head.compile("sgd", keras.losses.binary_crossentropy)
        split.compile("sgd", keras.losses.CategoricalCrossentropy())
    assert clipping(dense) == ["probs"]
    assert [f for f in mixed_precision.audit(dense)
            if f.problem.startswith(f"loss gets {half} probabilities")]
    assert clipping(head) == []
    clips = keras.backend.backend() == "jax"
    assert clipping(split) == (["float32_softmax"] if clips else [])
    # Measured, not assumed: the loss of that softmax on this backend.
    x, y, kernel, _ = gap_example("categorical_crossentropy")
    split.layers[0].set_weights([kernel, np.zeros(CLASSES, "float32")])
    loss = float(split.compute_loss(x, y, split(x)))
    np.testing.assert_allclose(loss, 16.118 if clips else GAP, atol=1e-3)


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_a_head_whose_logits_the_losses_drop_is_flagged(policy, monkeypatch):
    from keras_mgpu import compat

    monkeypatch.setattr(compat, "attached_logits_problem",
                        lambda: "Keras 9's losses read no logits")
    with pytest.warns(compat.UntestedKerasWarning,
                      match="Keras 9's losses read no logits"):
        head = gap_model(*gap_example("sparse_categorical_crossentropy")[2:])
    head.compile("sgd", "sparse_categorical_crossentropy")
    [finding] = mixed_precision.audit(head)
    assert finding.layer == "head"
    assert "Keras 9's losses read no logits" in finding.problem
    assert "from_logits=True" in finding.fix
