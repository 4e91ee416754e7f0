"""The API reference `make docs` builds (mkdocs.yml, docs/_api_pages.py)
misses nothing: every name of every public module's `__all__` exists, has a
docstring and a page, every top-level module is either public or said to be
internal, and the site builds in strict mode."""

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")
griffe = pytest.importorskip("griffe")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_hook(root: str = ROOT, name: str = "_api_pages"):
    """docs/_api_pages.py of the tree at `root`, as a module."""
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(root, "docs", "_api_pages.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


hook = load_hook()


@pytest.fixture(scope="module")
def reference():
    return hook.reference()


def test_the_reference_has_no_problem(reference):
    # A public name without a docstring, missing from its module or
    # unresolvable; a module without `__all__` or a docstring.
    assert reference.problems == []


def test_every_top_level_module_is_public_or_internal():
    # A new module or subpackage is documented, or said to be internal.
    found = set()
    for entry in os.listdir(os.path.join(ROOT, "keras_mgpu")):
        name = entry[:-3] if entry.endswith(".py") else entry
        is_package = os.path.isfile(
            os.path.join(ROOT, "keras_mgpu", entry, "__init__.py"))
        if name.startswith("_") or not (entry.endswith(".py") or is_package):
            continue
        found.add(f"keras_mgpu.{name}")
    assert found == (set(hook.PUBLIC_MODULES) - {"keras_mgpu"}) | set(
        hook.INTERNAL_MODULES)
    assert not set(hook.PUBLIC_MODULES) & set(hook.INTERNAL_MODULES)


def test_every_public_name_exists_and_is_its_canonical_object(reference):
    # Read statically for the pages; imported here: the same names, and a
    # re-exported name is the very object its page documents.
    for module in reference.modules:
        imported = importlib.import_module(module.name)
        assert list(imported.__all__) == [n.name for n in module.names]
        for name in module.names:
            value = getattr(imported, name.name)
            canonical = importlib.import_module(name.canonical)
            assert getattr(canonical, name.name) is value, name.path


def test_every_public_name_has_a_page_in_the_nav(reference):
    pages = reference.pages()
    in_nav = set()

    def walk(items):
        for item in items:
            if isinstance(item, str):
                in_nav.add(item)
            else:
                for value in item.values():
                    walk([value] if isinstance(value, str) else value)

    walk(reference.nav())
    assert set(pages) == in_nav
    for module in reference.modules:
        assert module.page in pages
        for name in module.names:
            assert f"::: {name.path}\n" in pages[name.page]
            link = os.path.relpath(name.page, os.path.dirname(module.page))
            assert f"[`{name.name}`]({link})" in pages[module.page]
    # Each object has one page.
    documented = [n.target for n in reference.documented()]
    assert len(documented) == len(set(documented))


def test_the_root_links_to_the_canonical_pages(reference):
    root = reference.modules[0]
    assert root.name == "keras_mgpu"
    canonical = {n.name: n.canonical for n in root.names}
    assert canonical["DistributedLogger"] == "keras_mgpu.callbacks"
    assert canonical["auto_strategy"] == "keras_mgpu.strategy"
    assert canonical["quiet_tensorflow"] == "keras_mgpu.quiet"
    assert canonical["__version__"] == "keras_mgpu"
    # Defined in keras_mgpu.callbacks' tree, re-exported by two modules.
    by_path = {f"{n.module}.{n.name}": n for n in reference.names()}
    assert by_path["keras_mgpu.mixed_precision.LossScaleMonitor"].canonical \
        == "keras_mgpu.callbacks"
    assert by_path["keras_mgpu.tuner.ScaledSchedule"].canonical == \
        "keras_mgpu.schedules"
    assert by_path["keras_mgpu.strategy.ClusterInfo"].canonical == \
        "keras_mgpu.cluster"


def test_a_name_without_a_docstring_is_reported(tmp_path):
    # The check that fails the build, on a copy with one docstring removed.
    shutil.copytree(os.path.join(ROOT, "keras_mgpu"), tmp_path / "keras_mgpu",
                    ignore=shutil.ignore_patterns("__pycache__"))
    os.makedirs(tmp_path / "docs")
    shutil.copy(os.path.join(ROOT, "docs", "_api_pages.py"), tmp_path / "docs")
    spec = tmp_path / "keras_mgpu" / "data" / "spec.py"
    text = spec.read_text()
    docstring = ('"""The name of the feature spec `write_tfrecords` saves '
                 'next to the shards."""\n')
    assert docstring in text
    spec.write_text(text.replace(docstring, ""))
    problems = load_hook(str(tmp_path), "_api_pages_copy").reference(
    ).problems
    assert len(problems) == 1, problems
    assert problems[0].startswith(
        "keras_mgpu.data.SPEC_FILE (keras_mgpu/data/spec.py:")
    assert problems[0].endswith("): a public name without a docstring")


def test_docstrings_are_made_markdown():
    text = ("Lists:\n- one\n- two\n\nExample:\n\n>>> f(1)  # doctest: +SKIP\n"
            "[1][2]\n\n```python\n>>> kept\n```")
    assert hook.docstring_markdown(text) == (
        "Lists:\n\n- one\n- two\n\nExample:\n\n```pycon\n>>> f(1)\n[1][2]\n"
        "```\n\n```python\n>>> kept\n```")


def test_the_readme_links_become_site_links():
    text = ("[docs/cli.md](docs/cli.md), [x](docs/strategy.md#slurm), "
            "[examples/README.md](examples/README.md), [t](examples/t.py), "
            "[w](https://x.org)\n```python\nm[0](x)\n```\n")
    assert hook.readme_page(text) == (
        "[docs/cli.md](cli.md), [x](strategy.md#slurm), "
        "`examples/README.md`, t (`examples/t.py`), "
        "[w](https://x.org)\n```python\nm[0](x)\n```\n")


def test_the_site_builds_in_strict_mode(tmp_path):
    # About 10 s: warnings (a broken link or anchor, a docstring griffe
    # cannot parse) fail it.
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-6000:]
    page = (site / "api" / "keras_mgpu.callbacks" /
            "DistributedLogger.html").read_text()
    assert 'id="keras_mgpu.callbacks.DistributedLogger"' in page
    assert "update_freq" in page and "Parameters:" in page
    assert (site / "index.html").is_file()
    assert (site / "search" / "search_index.js").is_file()
