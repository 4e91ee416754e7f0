"""The tested-models matrix's fixtures: what `auto_strategy()` applies, and
float64."""

import keras
import pytest


@pytest.fixture(autouse=True)
def sparse_gradients_merged():
    """What `auto_strategy()` applies (the fixtures' strategies are made
    without it): on TensorFlow an embedding's sparse gradient is clipped and
    applied as its dense equivalent, so plain `fit` is a reference."""
    if keras.backend.backend() == "tensorflow":
        from keras_mgpu import compat

        compat.enable_exact_clipping()


@pytest.fixture
def float64():
    """float64 as Keras's float type, float32 again afterwards: where
    float32 rounding is amplified past what a check can tell from a bug
    (see test_model_training.py). On JAX also JAX's 64-bit mode, and
    Keras's type promotion kept at float64: on backends other than
    TensorFlow it turns a promoted float64 into float32
    (keras/src/backend/common/dtypes.py, `BIT64_TO_BIT32_DTYPE`), so
    BatchNormalization, which promotes its inputs with float32, would
    compute in float32 in a float64 model."""
    previous = keras.config.floatx()
    keras.config.set_floatx("float64")
    if keras.backend.backend() == "jax":
        import jax
        from keras.src.backend.common import dtypes

        x64 = jax.enable_x64(True)
        demoted = dtypes.BIT64_TO_BIT32_DTYPE["float64"]
        dtypes.BIT64_TO_BIT32_DTYPE["float64"] = "float64"
    else:
        import contextlib

        x64, dtypes = contextlib.nullcontext(), None
    try:
        with x64:
            yield
    finally:
        keras.config.set_floatx(previous)
        if dtypes is not None:
            dtypes.BIT64_TO_BIT32_DTYPE["float64"] = demoted
