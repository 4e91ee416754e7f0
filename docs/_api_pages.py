"""MkDocs hook (mkdocs.yml `hooks:`): the API reference, generated at build
time, and the README as the home page.

The public API is the `__all__` of each module in `PUBLIC_MODULES`: a page
per module (its docstring and a table of its names) and a page per name,
rendered by mkdocstrings (`::: keras_mgpu.callbacks.DistributedLogger`). A
name re-exported by several modules (`LossScaleMonitor` by
`keras_mgpu.callbacks`, `keras_mgpu.mixed_precision` and the root) has one
page, under its canonical module: the public module that holds the module
defining it (`keras_mgpu.callbacks.loss_scale_monitor` is in
`keras_mgpu.callbacks`), else the first in `PUBLIC_MODULES` that exports it;
the others link to it. Nothing here is committed as Markdown: the pages
are rebuilt from the source on every build.

The modules are read statically with griffe (no TensorFlow import), but
the root package's `__all__`, which is computed: `import keras_mgpu` is
cheap (neither Keras nor TensorFlow). The build fails (`PluginError`,
naming them) where a public name has no docstring, is missing from its
module, or cannot be resolved.

`tests/test_api_docs.py` calls `reference()` without building the site.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import sys
from typing import Optional

import griffe
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "keras_mgpu"
API_DIR = "api"
NAV_TITLE = "API reference"

# The modules users import from, in the reference's order (the prose
# pages' order: strategy, accumulation, precision, callbacks and the
# goodput their logs give, data, tuning, the launcher; then the lower
# layers).
PUBLIC_MODULES = (
    "keras_mgpu",
    "keras_mgpu.strategy",
    "keras_mgpu.accumulation",
    "keras_mgpu.layers",
    "keras_mgpu.mixed_precision",
    "keras_mgpu.schedules",
    "keras_mgpu.callbacks",
    "keras_mgpu.goodput",
    "keras_mgpu.data",
    "keras_mgpu.tuner",
    "keras_mgpu.launcher",
    "keras_mgpu.slurm",
    "keras_mgpu.cluster",
    "keras_mgpu.runtime",
    "keras_mgpu.compat",
    "keras_mgpu.quiet",
)
# The package's other top-level modules without a leading underscore, and
# why they have no API pages. (The submodules of a public package, like
# `keras_mgpu.callbacks.backup`, are its implementation: the package
# re-exports their public names.)
INTERNAL_MODULES = {
    "keras_mgpu.backend": "the backend seam: keras-mgpu's own modules reach "
    "a Keras backend's training and communication code through it; users "
    "ask `keras_mgpu.strategy`, which answers through it",
    "keras_mgpu.cli": "the `keras-mgpu` command (docs/cli.md), whose "
    "interface is its command line, not Python names",
}


@dataclasses.dataclass
class Name:
    """One name of a public module's `__all__`."""

    module: str  # the public module exporting it
    name: str
    canonical: str = ""  # the public module whose page documents it
    target: str = ""  # the path of the object it names
    kind: str = ""  # "class", "function", "attribute"
    summary: str = ""  # the docstring's first paragraph, on one line
    where: str = ""  # file:line of the object

    @property
    def path(self) -> str:
        """The documented path: `keras_mgpu.callbacks.DistributedLogger`."""
        return f"{self.canonical}.{self.name}"

    @property
    def page(self) -> str:
        return f"{API_DIR}/{self.canonical}/{self.name}.md"

    @property
    def is_canonical(self) -> bool:
        return self.canonical == self.module


@dataclasses.dataclass
class Module:
    """A public module: its docstring's summary and its names."""

    name: str
    summary: str = ""
    names: list = dataclasses.field(default_factory=list)

    @property
    def page(self) -> str:
        return f"{API_DIR}/{self.name}/index.md"


@dataclasses.dataclass
class Reference:
    """The API reference: the public modules, and what is wrong with it."""

    modules: list
    problems: list

    def names(self) -> list:
        return [n for m in self.modules for n in m.names]

    def documented(self) -> list:
        """The names with a page: each public object once."""
        return [n for n in self.names() if n.is_canonical]

    def exported_as(self, name: Name) -> list:
        return [f"{n.module}.{n.name}" for n in self.names()
                if n.target == name.target and not n.is_canonical]

    def pages(self) -> dict:
        """Every generated page: its path under docs/ -> its Markdown."""
        pages = {f"{API_DIR}/index.md": self._index_page()}
        for module in self.modules:
            pages[module.page] = self._module_page(module)
            for name in module.names:
                if name.is_canonical:
                    pages[name.page] = self._name_page(name)
        return pages

    def nav(self) -> list:
        """The "API reference" section of the nav: a section per module,
        its page first, then its names' pages."""
        nav = [f"{API_DIR}/index.md"]
        for module in self.modules:
            nav.append({module.name: [module.page] + [
                {n.name: n.page} for n in module.names if n.is_canonical]})
        return nav

    def _index_page(self) -> str:
        rows = "\n".join(
            f"| [`{m.name}`]({m.name}/index.md) | {_cell(m.summary)} |"
            for m in self.modules)
        return f"""# API reference

The public modules of keras-mgpu and the names each exports (its
`__all__`), from their docstrings. A name several modules export has one
page, under the module that defines it; the others link to it.
`keras_mgpu.backend` (the backend seam) and the submodules of these
packages are internal: their public names are re-exported here.

| Module | |
| --- | --- |
{rows}
"""

    def _module_page(self, module: Module) -> str:
        rows = []
        for name in module.names:
            link = os.path.relpath(name.page, os.path.dirname(module.page))
            note = "" if name.is_canonical else f" (from `{name.canonical}`)"
            rows.append(f"| [`{name.name}`]({link}) | {name.kind} | "
                        f"{_cell(name.summary)}{note} |")
        table = "\n".join(rows)
        return f"""# {module.name}

::: {module.name}
    options:
      show_root_heading: false
      members: false

## Names

| Name | Kind | |
| --- | --- | --- |
{table}
"""

    def _name_page(self, name: Name) -> str:
        also = self.exported_as(name)
        text = f"::: {name.path}\n    options:\n      heading_level: 1\n"
        text += (f"\nImport: `from {name.canonical} import {name.name}`")
        if also:
            text += "; also as " + ", ".join(f"`{a}`" for a in also)
        return text + ".\n"


def _cell(text: str) -> str:
    """`text` for a Markdown table cell."""
    return text.replace("|", "\\|")


def _summary(docstring: Optional[griffe.Docstring]) -> str:
    if docstring is None:
        return ""
    return " ".join(docstring.value.strip().split("\n\n")[0].split())


def _exports(module: griffe.Module) -> Optional[list]:
    if module.exports is None:
        return None
    return [str(getattr(e, "name", e)) for e in module.exports]


def _root_all() -> list:
    """The root package's `__all__` (computed from its lazy names)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    return list(importlib.import_module(PACKAGE).__all__)


def _resolve(module: griffe.Module, name: str, problems: list):
    """The object `module.name` names, or None (with the problem told)."""
    member = module.members.get(name)
    if member is None:
        problems.append(f"{module.path}.{name}: in __all__ but not defined "
                        "or imported there")
        return None
    try:
        return member.final_target if member.is_alias else member
    except (griffe.AliasResolutionError, griffe.CyclicAliasError) as e:
        problems.append(f"{module.path}.{name}: cannot be resolved ({e})")
        return None


def _where(obj) -> str:
    path = os.path.relpath(str(obj.filepath), ROOT)
    return f"{path}:{obj.lineno}" if obj.lineno else path


def reference() -> Reference:
    """The API reference of the source tree, read statically."""
    package = griffe.load(PACKAGE, search_paths=[ROOT],
                          try_relative_path=False, allow_inspection=False,
                          resolve_aliases=False, docstring_parser="google")
    problems = []
    modules = []
    for path in PUBLIC_MODULES:
        try:
            gmodule = package if path == PACKAGE else package[
                path[len(PACKAGE) + 1:]]
        except KeyError:
            problems.append(f"{path}: no such module")
            continue
        module = Module(path, _summary(gmodule.docstring))
        if not module.summary:
            problems.append(f"{path}: the module has no docstring")
        exports = _root_all() if path == PACKAGE else _exports(gmodule)
        if exports is None:
            problems.append(f"{path}: no literal __all__ list")
            exports = []
        if len(set(exports)) != len(exports):
            problems.append(f"{path}: __all__ names a name twice")
        for name in exports:
            if name.startswith("_") and not name.startswith("__"):
                problems.append(f"{path}.{name}: a private name in __all__")
            module.names.append(Name(path, name))
        modules.append((module, gmodule))

    # Each exported name's object: from its module, or, for the root's
    # lazy names (`__getattr__`), from the public module that exports it.
    exporters = {}
    for module, gmodule in modules:
        for entry in module.names:
            if module.name == PACKAGE and entry.name not in gmodule.members:
                continue
            obj = _resolve(gmodule, entry.name, problems)
            if obj is None:
                continue
            entry.target, entry.kind = obj.path, obj.kind.value
            entry.summary, entry.where = _summary(obj.docstring), _where(obj)
            if entry.kind == "module":
                problems.append(f"{module.name}.{entry.name}: a module in "
                                "__all__")
            elif not entry.summary:
                problems.append(f"{module.name}.{entry.name} ({entry.where}): "
                                "a public name without a docstring")
            if module.name != PACKAGE:
                exporters.setdefault(entry.target, []).append(module.name)
    for module, _ in modules:
        for entry in module.names:
            if entry.target:
                continue
            found = {n.target: n for m, _ in modules if m.name != PACKAGE
                     for n in m.names if n.name == entry.name and n.target}
            if len(found) != 1:
                problems.append(
                    f"{module.name}.{entry.name}: exported by "
                    f"{len(found)} public modules' __all__ as different "
                    "objects" if found else
                    f"{module.name}.{entry.name}: in no public module's "
                    "__all__ (the root re-exports public names only)")
                continue
            source = next(iter(found.values()))
            entry.target, entry.kind = source.target, source.kind
            entry.summary, entry.where = source.summary, source.where

    # The canonical module of each object: the public module holding its
    # definition, else the first exporting it, else (the root's own
    # `__version__`) the module itself.
    for module, _ in modules:
        for entry in module.names:
            candidates = exporters.get(entry.target, [])
            holding = [m for m in candidates
                       if entry.target.startswith(m + ".")]
            entry.canonical = (max(holding, key=len) if holding
                               else candidates[0] if candidates
                               else module.name)

    reference = Reference([m for m, _ in modules], problems)
    seen = {}
    for name in reference.documented():
        key = name.page.lower()
        if key in seen:
            problems.append(f"{name.path} and {seen[key]}: pages differing "
                            "only in case")
        seen[key] = name.path
    return reference


# The README's links, made links of the site: docs/x.md is x.md; a file
# outside docs/ (examples/README.md) is no page, so it becomes its path as
# code. Fenced code blocks are left alone.
_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)", re.M)


def _site_link(match: re.Match) -> str:
    bang, text, target = match.groups()
    if re.match(r"[a-z]+:|#", target):
        return match.group(0)
    if target.startswith("docs/"):
        return f"{bang}[{text}]({target[len('docs/'):]})"
    if bang:
        return text
    shown = text.strip("`")
    return f"`{target}`" if shown == target else f"{text} (`{target}`)"


def readme_page(text: str) -> str:
    """README.md as the site's home page (index.md)."""
    parts = re.split(r"(^```.*?^```[ \t]*$)", text, flags=re.M | re.S)
    return "".join(part if _FENCE.match(part) else _LINK.sub(_site_link, part)
                   for part in parts)


_reference: Optional[Reference] = None


def on_config(config):
    global _reference
    _reference = reference()
    if _reference.problems:
        raise PluginError(
            "The API reference is incomplete (docs/_api_pages.py):\n  "
            + "\n  ".join(_reference.problems))
    for i, item in enumerate(config.nav or []):
        if isinstance(item, dict) and NAV_TITLE in item:
            config.nav[i] = {NAV_TITLE: _reference.nav()}
            break
    else:
        raise PluginError(f"mkdocs.yml's nav has no {NAV_TITLE!r} entry "
                          "for docs/_api_pages.py to fill")
    return config


def on_files(files, config):
    generated = dict(_reference.pages())
    with open(os.path.join(ROOT, "README.md")) as f:
        generated["index.md"] = readme_page(f.read())
    for src_uri, content in generated.items():
        if files.get_file_from_path(src_uri) is not None:
            raise PluginError(f"docs/{src_uri} exists; docs/_api_pages.py "
                              "generates that page")
        files.append(File.generated(config, src_uri, content=content))
    return files


# Keras's docstring style, as GitHub renders it, read by Python-Markdown.
# Doctest examples come unindented after an `Example:` line, which is no
# Google section to griffe (its content is not indented), so they would
# reach Markdown as text (`>>>` is a blockquote); and a list may follow its
# paragraph's last line, where Python-Markdown wants a blank line first.
# This griffe extension (mkdocs.yml's `extensions:`) fences each run of
# doctest lines as a `pycon` block, without the `# doctest:` directives,
# and puts the blank line before such a list, leaving fenced code alone.
_DOCTEST_DIRECTIVE = re.compile(r"\s*#\s*doctest:.*$")
_LIST_ITEM = re.compile(r"([-*+]|\d+\.) +\S")


def docstring_markdown(text: str) -> str:
    """`text` (a docstring) with its unfenced doctest examples fenced, and
    a blank line before a list that follows a paragraph line."""
    out, fenced, lines, i = [], False, text.split("\n"), 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif (not fenced and _LIST_ITEM.match(line) and out
              and out[-1].strip() and not out[-1][0].isspace()
              and not _LIST_ITEM.match(out[-1])):
            out.append("")
        elif not fenced and line.startswith(">>>"):
            if out and out[-1].strip():
                out.append("")
            out.append("```pycon")
            while i < len(lines) and lines[i].strip():
                line = lines[i]
                if line.startswith((">>>", "...")):
                    line = _DOCTEST_DIRECTIVE.sub("", line)
                out.append(line)
                i += 1
            out.append("```")
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


class KerasDocstrings(griffe.Extension):
    """Every docstring griffe loads, as `docstring_markdown` makes it."""

    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = docstring_markdown(obj.docstring.value)
