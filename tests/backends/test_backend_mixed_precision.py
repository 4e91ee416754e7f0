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
