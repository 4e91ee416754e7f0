"""The tested-models matrix's fixture: what `auto_strategy()` applies."""

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

