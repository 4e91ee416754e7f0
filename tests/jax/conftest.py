"""The JAX backend's fixtures (this folder is collected only under
KERAS_BACKEND=jax, with 2 forced host devices)."""

import jax
import keras
import pytest


@pytest.fixture
def data_parallel():
    """A `DataParallel` distribution over 2 host devices, in effect for the
    test."""
    distribution = keras.distribution.DataParallel(devices=jax.devices()[:2])
    with distribution.scope():
        yield distribution
