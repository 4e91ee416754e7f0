"""The float32 head's logits on Keras's JAX backend (compat/jax_nn.py):
what the wrapped cross-entropy matches (the very output object, its
activation, the last axis), that nothing outlives an output, and a Keras
without the JAX module or functions it wraps: the head warns, naming the
name, and the audit flags it."""

import gc

import jax.numpy as jnp
import keras
import numpy as np
import pytest

from keras_mgpu import compat, mixed_precision
from keras_mgpu.compat import jax_nn
from keras_mgpu.compat import mixed_precision as compat_mixed
from keras_mgpu.layers import FP32OutputHead

LOGITS = jnp.array([[20.0, -20.0]])
# The loss of class 1 (40 logits below class 0): from the logits, and from
# probabilities clipped to 1e-7.
FROM_LOGITS, CLIPPED = 40.0, 16.118


@pytest.fixture(autouse=True)
def measured_again():
    """Each test measures the losses afresh, and leaves them measured
    afresh (with the installed Keras restored)."""
    compat_mixed.attached_logits_problem.cache_clear()
    yield
    compat_mixed.attached_logits_problem.cache_clear()


def softmax_of(logits):
    output = keras.activations.softmax(logits)
    assert compat.attach_logits(output, logits, "softmax")
    return output


def test_only_the_remembered_object_with_its_activation_gets_its_logits():
    assert compat.attached_logits_problem() is None
    target = jnp.array([1])
    output = softmax_of(LOGITS)
    loss = keras.losses.sparse_categorical_crossentropy
    assert float(loss(target, output)[0]) == pytest.approx(FROM_LOGITS)
    # The same values in another array: Keras's own loss.
    assert float(loss(target, output + 0.0)[0]) == pytest.approx(
        CLIPPED, abs=1e-3)
    # Sigmoid logits are not softmax logits, and the binary loss does not
    # take a softmax's.
    assert compat.remembered_logits(output, "sigmoid") is None
    both = jnp.array([[0.0, 1.0]])
    assert float(keras.losses.binary_crossentropy(both, output)[0]) == (
        pytest.approx(float(keras.losses.binary_crossentropy(
            both, output + 0.0)[0])))
    # from_logits=True: the output is taken as the logits, as asked.
    assert float(loss(target, output, from_logits=True)[0]) == (
        pytest.approx(float(loss(target, output + 0.0, from_logits=True)[0])))
    # The softmax was over the last axis: over another, Keras's own.
    assert float(keras.ops.categorical_crossentropy(
        jnp.array([[0.0, 1.0]]).T, output.T, axis=0)[0]) == pytest.approx(
            CLIPPED, abs=1e-3)


def test_nothing_is_kept_for_an_output_that_is_gone():
    compat.enable_logits_losses()
    before = len(jax_nn._remembered)
    outputs = [softmax_of(LOGITS * i) for i in range(5)]
    assert len(jax_nn._remembered) == before + 5
    del outputs
    gc.collect()
    assert len(jax_nn._remembered) == before


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_a_float32_head_of_a_plain_float32_model_gets_its_logits_too(policy):
    # The head is the head under any policy; here its model computes in
    # float16 but its output, like a float32 model's, is float32.
    model = keras.Sequential([keras.Input((2,)), FP32OutputHead(
        2, activation="softmax", use_bias=False, name="head")])
    model.get_layer("head").dense.set_weights([np.array(
        [[20.0, -20.0], [0.0, 0.0]], "float32")])
    model.compile("sgd", "sparse_categorical_crossentropy")
    x, y = np.array([[1.0, 0.0]], "float32"), np.array([1])
    assert float(model.compute_loss(x, y, model(x))) == pytest.approx(
        FROM_LOGITS)


def _jax_nn_names():
    """The names compat/jax_nn.py passes to `_require`, and its module."""
    from tests.test_compat_mutations import _required_names

    return sorted(_required_names(
        modules=lambda path: path.name == "jax_nn.py")) + [jax_nn._JAX_NN]


def test_the_names_taken_away_here_are_those_jax_nn_requires():
    assert _jax_nn_names() == [
        "binary_crossentropy", "categorical_crossentropy",
        "sparse_categorical_crossentropy", "keras.src.backend.jax.nn"]


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
@pytest.mark.parametrize("name,kind", [
    (name, kind) for name in _jax_nn_names()
    for kind in ("missing", "signature")
    if kind == "missing" or not name.startswith("keras.")])
def test_a_keras_without_what_the_head_needs_is_told_and_audited(
        policy, name, kind, monkeypatch):
    if name.startswith("keras."):
        real = compat._core._import_module

        def import_module(path):
            if path == name:
                raise ImportError(f"No module named {path!r}")
            return real(path)

        monkeypatch.setattr(compat._core, "_import_module", import_module)
    else:
        module = compat._require_module(jax_nn._JAX_NN, "a test")
        if kind == "missing":
            # Keras's own, where keras-mgpu has wrapped it: what a Keras
            # without the name would leave behind is taken away.
            monkeypatch.delattr(module, name)
        else:
            monkeypatch.setattr(module, name, lambda labels, outputs: None)
    with pytest.warns(compat.UntestedKerasWarning) as warned:
        model = keras.Sequential([keras.Input((2,)), FP32OutputHead(
            2, activation="softmax", name="head")])
    message = str(warned[0].message)
    assert name.rsplit(".", 1)[-1] in message
    assert f"Keras {keras.__version__}" in message
    assert f"install keras>={compat.TESTED_KERAS.low}" in message
    model.compile("sgd", "sparse_categorical_crossentropy")
    [finding] = mixed_precision.audit(model)
    assert finding.layer == "head"
    assert finding.problem.startswith("loss gets the head's probabilities")
    assert name.rsplit(".", 1)[-1] in finding.problem
