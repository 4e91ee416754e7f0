"""Every public docstring `Example:` runs."""

import doctest
import importlib

import keras
import pytest

MODULES = ["keras_mgpu.strategy", "keras_mgpu.compat", "keras_mgpu.launcher",
           "keras_mgpu.accumulation", "keras_mgpu.mixed_precision",
           "keras_mgpu.layers.fp32_output_head",
           "keras_mgpu.callbacks.backup_and_restore",
           "keras_mgpu.callbacks.callback_state",
           "keras_mgpu.callbacks.distributed_logger", "keras_mgpu.data",
           "keras_mgpu._doctor", "keras_mgpu._bench", "keras_mgpu.runtime",
           "keras_mgpu.callbacks._backup_lock",
           "keras_mgpu.callbacks.loss_scale_monitor", "keras_mgpu.schedules",
           "keras_mgpu_cli"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    try:
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert result.attempted > 0
    assert result.failed == 0
