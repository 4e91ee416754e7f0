"""Hides the optional packages named in `KERAS_MGPU_TESTS_HIDE` from a
test's child processes (tests/conftest.py puts this folder on their
`PYTHONPATH` and sets the variable).

TensorFlow imports jax, and Keras imports matplotlib and scikit-learn, at
import time whenever they are installed, which the test environment does
for the tests that use them (the JAX backend, `--plot`, the demo, the
Bayesian tuner). That is about 2 s of CPU in each of the suite's hundreds
of TensorFlow child processes, 40% of their import. Hidden, a child runs
as on a core install without those extras (each import of theirs is
guarded upstream). A test whose children need one of them starts them
with `tests.conftest.allow_in_children(env, name)`.
"""

import importlib.abc
import os
import sys

_HIDDEN = frozenset(filter(None, os.environ.get(
    "KERAS_MGPU_TESTS_HIDE", "").split(",")))


class _HideOptional(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _HIDDEN:
            raise ModuleNotFoundError(
                f"No module named {name!r}: hidden from this test's child "
                "processes (tests/_child_site/sitecustomize.py); a test "
                "allows it with tests.conftest.allow_in_children.", name=name)
        return None


if _HIDDEN:
    sys.meta_path.insert(0, _HideOptional())
