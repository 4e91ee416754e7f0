"""Every private Keras, TensorFlow and KerasTuner name keras-mgpu requires,
taken away in turn: the run is refused with `KerasInternalsError` before
its first training step, naming the name, the Keras version and what to
install (tests/mutation_workers.py runs them)."""

import ast
import json
import os
import pathlib
import re
import subprocess
import sys

import keras
import pytest

from keras_mgpu import compat

ROOT = pathlib.Path(__file__).parents[1]
COMPAT = ROOT / "keras_mgpu" / "compat"
# Python's own private names compat uses (`ast`).
PYTHONS_OWN = {"_fields"}
PRIVATE_MODULES = ("keras.src", "keras_tuner.src", "tensorflow.python",
                   "tensorflow.compiler")


@pytest.fixture(scope="module")
def runs():
    """The reports of tests/mutation_workers.py: the recording runs, then
    one per mutation."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join(
                   [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.mutation_workers",
             "--timeout", "240"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"tests.mutation_workers did not finish in 900 s:\n"
                    f"{(error.stderr or b'')[-4000:]}")
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("DONE"), (
        f"exit code {proc.returncode}\n{proc.stderr[-4000:]}")
    reports = [json.loads(line) for line in proc.stdout.splitlines()
               if line.startswith("{")]
    return ([r for r in reports if r["mutation"] is None],
            [r for r in reports if r["mutation"] is not None])


def _compat_trees(named=False) -> list:
    """The syntax tree of each module of the compat package (with its path
    where `named`)."""
    paths = sorted(COMPAT.rglob("*.py"))
    assert paths, f"no modules under {COMPAT}"
    trees = [(path, ast.parse(path.read_text())) for path in paths]
    return trees if named else [tree for _, tree in trees]


def _required_names(modules=lambda path: not path.name.startswith("jax_")
                    ) -> set:
    """Every attribute name the compat package passes to `_require` (or
    `_copied_variant`) and every module path to `_require_module`, as
    literals, in the compat modules `modules` selects by path: by default
    all but the JAX backend's (`jax_*.py`, whose names
    tests/jax/test_jax_backend.py takes away under the JAX backend)."""
    position = {"_require": 1, "_copied_variant": 1, "_require_module": 0}
    names = set()
    trees = [tree for path, tree in _compat_trees(named=True) if modules(path)]
    for node in (node for tree in trees for node in ast.walk(tree)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in position
                and len(node.args) > position[node.func.id]):
            arg = node.args[position[node.func.id]]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.add(arg.value)
    return names


def test_every_lookup_comes_before_the_first_training_step(runs):
    controls, _ = runs
    for control in controls:
        assert control["error"] is None, control["error"]
        late = {key: seen for key, seen in control["looked_up"].items()
                if seen["steps"] != 0}
        assert not late, (
            f"phase {control['phase']} first looks these up after training "
            f"steps: {late}")
        for key, seen in control["looked_up"].items():
            assert seen["used_for"] in (None, *compat._WORKAROUNDS), (
                f"{key} is used for {seen['used_for']!r}, which is not a "
                "record of compat.WORKAROUNDS")


def test_the_runs_look_up_every_required_name(runs):
    controls, _ = runs
    looked_up = {key for c in controls for key in c["looked_up"]}
    seen = looked_up | {key.rsplit(".", 1)[-1] for key in looked_up}
    missed = sorted(_required_names() - seen)
    assert not missed, (
        f"no run of tests/mutation_workers.py looks these up, so nothing "
        f"shows they are refused clearly: {missed}")


def test_each_name_taken_away_is_refused_before_training(runs):
    _, mutations = runs
    assert len(mutations) >= 60
    kinds = {kind for kind, _ in (r["mutation"] for r in mutations)}
    assert kinds == {"missing", "signature", "reshaped"}
    failures = []
    for report in mutations:
        kind, key = report["mutation"]
        error = report["error"] or {}
        message = error.get("message", "")
        refused = (error.get("type") == "KerasInternalsError"
                   or (error.get("type") == "TrialFailed"
                       and "KerasInternalsError" in message))
        named = (key if key.startswith(PRIVATE_MODULES)
                 and kind == "missing" and "." not in key[len("keras."):]
                 else key.rsplit(".", 1)[-1])
        if not (refused and error.get("steps") == 0
                and named in message
                and f"Keras {keras.__version__}" in message
                and f"install keras>={compat.TESTED_KERAS.low}" in message):
            failures.append(f"{report['phase']}: {kind} {key}: "
                            f"{error.get('type')} after {error.get('steps')} "
                            f"steps: {message[:300]}")
    assert not failures, "\n".join(failures)


def test_private_names_are_reached_only_through_the_checks():
    # Outside compat, no module imports a private module; inside it, every
    # private module is imported through `_require_module` and every
    # private attribute read or set is one `_require` checks somewhere.
    for path in (ROOT / "keras_mgpu").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            module = (node.module if isinstance(node, ast.ImportFrom)
                      else None)
            names = ([a.name for a in node.names]
                     if isinstance(node, ast.Import) else [module or ""])
            for name in names:
                assert not name.startswith(PRIVATE_MODULES), (
                    f"{path.relative_to(ROOT)}:{node.lineno} imports "
                    f"{name}: go through compat._require_module")
    required = _required_names(modules=lambda path: True)
    nodes = [(path, node) for path, tree in _compat_trees(named=True)
             for node in ast.walk(tree)]
    ours = {node.name for _, node in nodes
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    unchecked = set()
    for path, node in nodes:
        if (isinstance(node, ast.Attribute)
                and re.match(r"_[a-z]", node.attr)
                and not (isinstance(node.value, ast.Name)
                         and node.value.id in ("self", "cls"))
                and node.attr not in ours
                and node.attr not in PYTHONS_OWN
                and node.attr not in required):
            unchecked.add(f"{node.attr} ({path.name}, line {node.lineno})")
    assert not unchecked, (
        f"compat reaches these private names without `_require`: "
        f"{sorted(unchecked)}")
