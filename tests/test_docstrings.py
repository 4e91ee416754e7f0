"""Every public docstring `Example:` runs."""

import doctest
import importlib
import os

import keras
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules_with_examples() -> list:
    """Every module of the package (and the top-level ones) whose source
    has a doctest prompt that is not skipped, found by walking the tree."""
    paths = [os.path.join(ROOT, f) for f in os.listdir(ROOT)
             if f.startswith("keras_mgpu_") and f.endswith(".py")]
    for folder, _, files in os.walk(os.path.join(ROOT, "keras_mgpu")):
        paths += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    found = []
    for path in sorted(paths):
        with open(path) as f:
            prompts = [line for line in f if line.lstrip().startswith(">>> ")]
        if all("doctest: +SKIP" in line for line in prompts):
            continue
        parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
        if parts[-1] in ("__init__", "__main__"):
            continue
        found.append(".".join(parts))
    return found


MODULES = _modules_with_examples()


def test_the_documented_modules_are_found():
    # The walk finds the modules whose examples must run, not none.
    for name in ("keras_mgpu.strategy", "keras_mgpu.accumulation.model",
                 "keras_mgpu.data.reader", "keras_mgpu_args"):
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
