"""Every public docstring `Example:` runs."""

import doctest
import importlib

import pytest

MODULES = ["keras_mgpu.strategy", "keras_mgpu.compat", "keras_mgpu.launcher",
           "keras_mgpu.accumulation"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0
