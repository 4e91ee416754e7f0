"""The import graph: one direction between modules, no module reaching for the
package root, and private upstream modules imported only under compat.

Read from the source (every `import` statement, at module level or inside a
function), so a lazy import counts as an edge too.
"""

import ast
import os
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def package_modules() -> dict:
    """Module name -> path, for every module of the package, found by
    walking the tree."""
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "keras_mgpu")):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _package_of(name: str, path: str) -> str:
    return name if path.endswith("__init__.py") else name.rpartition(".")[0]


def _imports(name: str, path: str, modules: dict) -> set:
    """The first-party modules `name` imports (`from p import m` is `p.m`
    where `m` is a module)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(name, path).split(".")
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict:
    modules = package_modules()
    return {name: _imports(name, path, modules)
            for name, path in modules.items()}


def _is_ancestor(package: str, module: str) -> bool:
    return module.startswith(package + ".")


def test_no_import_cycle():
    graph = _graph()
    # A package's __init__ importing its own submodules is how a package
    # exposes them, not a dependency of theirs on it.
    edges = {m: {d for d in deps if not _is_ancestor(m, d)}
             for m, deps in graph.items()}
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(edges[node]):
            if state.get(dep) == "open":
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(
        " -> ".join(c) for c in cycles)


def test_no_module_imports_the_package_root():
    importers = sorted(m for m, deps in _graph().items()
                       if "keras_mgpu" in deps and m != "keras_mgpu")
    assert not importers, (
        f"{importers} import the keras_mgpu package root; import the "
        "submodule that defines the name instead")


@pytest.mark.parametrize("prefix", ["keras.src", "tensorflow.python",
                                    "tensorflow.compiler", "keras_tuner.src"])
def test_private_upstream_modules_only_under_compat(prefix):
    outside = []
    for name, path in package_modules().items():
        if name == "keras_mgpu.compat" or name.startswith("keras_mgpu.compat."):
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names]
                     if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [])
            outside += [f"{name}: {n}" for n in names
                        if n == prefix or n.startswith(prefix + ".")]
    assert not outside, outside


def test_no_module_looks_into_frames_or_the_heap():
    # What the runtime and the backup need of a running `fit` is recorded
    # by compat.fit_context; reading frames or scanning the heap for it is
    # slow and breaks with any change to Keras's locals.
    banned = {"get_referrers", "get_referents", "get_objects", "_getframe",
              "currentframe", "f_locals", "f_back", "f_globals"}
    found = []
    for name, path in package_modules().items():
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            used = (node.attr if isinstance(node, ast.Attribute) else
                    node.id if isinstance(node, ast.Name) else None)
            if used in banned:
                found.append(f"{name}:{node.lineno}: {used}")
    assert not found, found


def _third_party(path: str) -> set:
    """The top-level names of what `path` imports from outside the
    standard library and keras-mgpu."""
    import sys

    with open(path) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add((node.module or "").split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names
            and not n.startswith("keras_mgpu") and n != "__future__"}


def test_the_launcher_stands_on_the_standard_library_alone():
    # `keras-mgpu launch` supervises without Keras or TensorFlow.
    modules, graph = package_modules(), _graph()
    cluster = {m for m in modules if m == "keras_mgpu.cluster"
               or _is_ancestor("keras_mgpu.cluster", m)}
    allowed = cluster | {"keras_mgpu._checks", "keras_mgpu._args"}
    for name in sorted(cluster | {"keras_mgpu.launcher", "keras_mgpu.slurm",
                                  "keras_mgpu._with_keras"}):
        # `_with_keras` names the backend seam, imported once Keras is.
        also = {"keras_mgpu.backend"} if name.endswith("_with_keras") else set()
        assert graph[name] <= allowed | also, (name, graph[name] - allowed)
        assert not _third_party(modules[name]), (name, _third_party(
            modules[name]))


def _python(code: str) -> str:
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_importing_the_package_and_the_launcher_imports_no_keras():
    out = _python(
        "import sys, keras_mgpu, keras_mgpu.launcher, keras_mgpu.slurm\n"
        "keras_mgpu.launcher.launch\n"
        "print(sorted(m for m in ('keras', 'tensorflow', 'jax') "
        "if m in sys.modules))")
    assert out.strip() == "[]"


@pytest.mark.parametrize("order", ["package first", "keras first"])
def test_keras_brings_the_core_whichever_comes_first(tmp_path, order):
    # Saved by one process, loaded by another that named no keras-mgpu
    # class: the classes are registered once Keras is imported; and a
    # logger made after `model.fit` was looked up still sees its fit.
    path = tmp_path / "model.keras"
    _python(textwrap.dedent(f"""
        import keras, keras_mgpu
        inputs = keras.Input((3,))
        outputs = keras_mgpu.layers.FP32OutputHead(2)(
            keras.layers.Dense(4)(inputs))
        keras.Model(inputs, outputs).save({str(path)!r})
    """))
    imports = ("import keras_mgpu\nimport keras" if order == "package first"
               else "import keras\nimport keras_mgpu")
    out = _python(imports + textwrap.dedent(f"""
        import numpy as np
        # `fit` records itself before anyone looks it up.
        print(hasattr(keras.Model.fit, "keras_stock"))
        model = keras.models.load_model({str(path)!r})
        print(type(model.layers[-1]).__name__)
        model.compile("sgd", "mse")
        log_dir = {str(tmp_path / "logs")!r}
        model.fit(np.ones((8, 3)), np.ones((8, 2)), verbose=0, epochs=1,
                  callbacks=[keras_mgpu.DistributedLogger(log_dir)])
        print(sum(1 for _ in open(log_dir + "/metrics.jsonl")) > 0)
    """))
    lines = out.splitlines()  # the logger prints its records between
    assert lines[:2] == ["True", "FP32OutputHead"] and lines[-1] == "True"

