"""The suite's child processes start without the optional packages
TensorFlow and Keras import whenever installed (tests/_child_site/), and a
test gets them back for its children with `allow_in_children`."""

import os
import subprocess
import sys

import keras

from tests.conftest import HIDDEN_FROM_CHILDREN, allow_in_children

PROBE = """
import importlib, sys
import keras, tensorflow
print("loaded:", sorted(m for m in %r if m in sys.modules))
try:
    importlib.import_module(%r)
    print("imported")
except ModuleNotFoundError as e:
    print("refused:", e)
"""


def probe(env, name):
    proc = subprocess.run([sys.executable, "-c",
                           PROBE % (HIDDEN_FROM_CHILDREN, name)],
                          env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_children_load_none_of_them_and_are_told_where_to_ask():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = probe(env, "sklearn")
    # jax stays for children on the JAX backend.
    loaded = ["jax"] if keras.backend.backend() == "jax" else []
    assert f"loaded: {loaded}" in out, out
    assert "refused: No module named 'sklearn': hidden" in out, out
    assert "allow_in_children" in out, out


def test_a_test_gives_its_children_one_back():
    env = allow_in_children(dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
                            "sklearn")
    out = probe(env, "sklearn")
    assert "imported" in out, out
