"""Shared fixtures: logical-CPU strategies, the local cluster runner, small data.

The pytest process splits its CPU into `MAX_LOGICAL_CPUS` logical devices
before anything else touches TensorFlow, so mirrored strategies over 2 and 4
replicas are real `MirroredStrategy` objects.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_mgpu import launcher  # noqa: E402
from keras_mgpu import strategy as strategy_lib  # noqa: E402

MAX_LOGICAL_CPUS = 4
LOGICAL_CPUS = strategy_lib.configure_virtual_cpus(MAX_LOGICAL_CPUS)


def mirrored(n: int) -> tf.distribute.Strategy:
    """A MirroredStrategy over the first `n` logical CPUs (1: default strategy)."""
    if n == 1:
        return tf.distribute.get_strategy()
    return tf.distribute.MirroredStrategy(LOGICAL_CPUS[:n])


@pytest.fixture(params=[2, 4], ids=lambda n: f"{n}cpus")
def mirrored_strategy(request):
    return mirrored(request.param)


@pytest.fixture
def run_workers():
    """`launcher.run_local_workers` with a test-sized default timeout."""

    def run(target, num_workers=2, **kwargs):
        kwargs.setdefault("timeout", 240)
        kwargs.setdefault(
            "env", {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "-1"}
        )
        return launcher.run_local_workers(target, num_workers, **kwargs)

    return run
