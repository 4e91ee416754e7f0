"""Every public docstring `Example:` runs."""

import doctest
import importlib

import keras
import pytest

from tests.test_imports import package_modules


def _modules_with_examples() -> list:
    """Every module of the package (and the top-level ones) whose source
    has a doctest prompt that is not skipped."""
    found = []
    for name, path in sorted(package_modules().items()):
        if path.endswith(("__init__.py", "__main__.py")):
            continue
        with open(path) as f:
            prompts = [line for line in f if line.lstrip().startswith(">>> ")]
        if not all("doctest: +SKIP" in line for line in prompts):
            found.append(name)
    return found


MODULES = _modules_with_examples()


def test_the_documented_modules_are_found():
    # The walk finds the modules whose examples must run, not none.
    for name in ("keras_mgpu.strategy", "keras_mgpu.accumulation.model",
                 "keras_mgpu.data.reader", "keras_mgpu._args"):
        assert name in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    try:
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert result.attempted > 0
    assert result.failed == 0
