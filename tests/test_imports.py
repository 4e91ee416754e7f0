"""The import graph: one direction between modules, no module reaching for the
package root, and private upstream modules imported only under compat.

Read from the source (every `import` statement, at module level or inside a
function), so a lazy import counts as an edge too.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def package_modules() -> dict:
    """Module name -> path, for the package and the top-level
    `keras_mgpu_*.py` modules, found by walking the tree."""
    found = {f[:-3]: os.path.join(ROOT, f) for f in os.listdir(ROOT)
             if f.startswith("keras_mgpu_") and f.endswith(".py")}
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
