"""The checks every workaround goes through: the one lookup of a private
name (`_lookup`) and of a private module (`_import_module`), `_require` and
`_require_module` around them, `KerasInternalsError`, the tested Keras
versions and the shapes of the Keras functions keras-mgpu runs a copy of.

Each workaround is decided by what the installed Keras does, not by a
version range that could switch it off while the bug is still there: a
private name is looked up where it is first used (`KerasInternalsError`,
naming the Keras version, when it is missing or has another shape), and a
Keras outside the tested range (`TESTED_KERAS`) gets one warning
(`UntestedKerasWarning`) that says what is unverified on it. The version is
read when it is needed, so tests can simulate another Keras.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import threading
import warnings
from typing import Union

import keras
from packaging.version import Version

from keras_mgpu.compat.registry import _WORKAROUNDS

# Held while a workaround patches Keras, TensorFlow or KerasTuner.
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class VersionRange:
    """Keras versions from `low` to `high`, both included, and `nightlies`.

    Args:
        low: The oldest version, e.g. `"3.10.0"`.
        high: The newest version, e.g. `"3.15.1"`.
        nightlies: Development versions outside the range that are
            included one by one, e.g. `("3.16.0.dev2026102704",)`.
            Defaults to none.

    Example:

    >>> VersionRange("3.10.0", "3.15.1").contains("3.12.0")
    True
    """

    low: str
    high: str
    nightlies: tuple = ()

    def contains(self, version: Union[str, Version]) -> bool:
        """Whether `version` (a string or `Version`) lies in the range or
        is one of its nightlies."""
        version = _parse(str(version))
        return (_parse(self.low) <= version <= _parse(self.high)
                or version in map(_parse, self.nightlies))

    def __str__(self) -> str:
        nightlies = "".join(f" and the nightly {v}" for v in self.nightlies)
        return f"{self.low} to {self.high}{nightlies}"


@functools.lru_cache(maxsize=64)
def _parse(version: str) -> Version:
    # Checked on every private lookup (per logger record, say): parse once.
    return Version(version)


# What the suite has been run on (docs/compatibility.md, noxfile.py): the
# oldest pair's Keras, the newest release, and the newest keras-nightly the
# noxfile's `nightly` environment passed on.
TESTED_KERAS = VersionRange("3.10.0", "3.15.1",
                            nightlies=("3.16.0.dev2026102704",))
"""The Keras versions keras-mgpu's suite has run on (a `VersionRange`):
`warn_if_untested` warns outside it."""


class KerasInternalsError(RuntimeError):
    """A Keras internal that keras-mgpu relies on is missing or has changed."""


class UntestedKerasWarning(UserWarning):
    """The installed Keras is outside the versions keras-mgpu was tested on."""


def keras_version() -> Version:
    """The installed Keras version, read now (not at import).

    Example:

    >>> keras_version() >= Version("3.0")
    True
    """
    return _parse(keras.__version__)


_warned_versions: set[str] = set()


def warn_if_untested() -> bool:
    """Warns once per Keras version outside `TESTED_KERAS`; returns whether
    this Keras is untested.

    Example:

    >>> warn_if_untested() == (not TESTED_KERAS.contains(keras_version()))
    True
    """
    version = keras.__version__
    if TESTED_KERAS.contains(version):
        return False
    if version not in _warned_versions:
        _warned_versions.add(version)
        from keras_mgpu._version import __version__ as ours

        warnings.warn(
            f"keras-mgpu {ours} was tested with Keras {TESTED_KERAS}, but "
            f"Keras {version} is installed. Each Keras internal keras-mgpu "
            f"relies on is checked where it is first used (a missing or "
            f"reshaped one is refused with KerasInternalsError), but what "
            f"these do on Keras {version} is unverified: "
            f"{'; '.join(_WORKAROUNDS)}. "
            f"Run keras-mgpu's test suite on this Keras, or install "
            f"keras>={TESTED_KERAS.low},<={TESTED_KERAS.high}.",
            UntestedKerasWarning,
            stacklevel=3,
        )
    return True


def _internals_error(what: str, used_for: str) -> KerasInternalsError:
    from keras_mgpu._version import __version__ as ours

    return KerasInternalsError(
        f"keras-mgpu needs {what} for {used_for}, but Keras "
        f"{keras.__version__} does not have it. keras-mgpu {ours} was tested "
        f"with Keras {TESTED_KERAS}: install "
        f"keras>={TESTED_KERAS.low},<={TESTED_KERAS.high}, or a keras-mgpu "
        f"release that supports Keras {keras.__version__}."
    )


_MISSING = object()


def _lookup(owner, name: str):
    # The one read of a private name (tests take names away through it).
    return getattr(owner, name, _MISSING)


def _import_module(path: str):
    # The one import of a private module (tests take modules away here).
    return importlib.import_module(path)


def _module_if_present(path: str):
    """The private module `path`, or None: unchecked and unwarned, for a
    step whose failure the checked lookup (`_require_module`) reports
    later, where the feature is first used."""
    try:
        return _import_module(path)
    except ImportError:
        return None


def _require(owner, name: str, used_for: str, params=None):
    """`owner.name`, checked: raises `KerasInternalsError` if it is missing,
    or (with `params`) if its leading parameters are not `params`."""
    warn_if_untested()
    qualname = f"`{_owner_name(owner)}.{name}`"
    value = _lookup(owner, name)
    if value is _MISSING:
        raise _internals_error(qualname, used_for)
    if params is not None:
        try:
            found = tuple(inspect.signature(value).parameters)[: len(params)]
        except (TypeError, ValueError):
            found = None
        if found != tuple(params):
            raise _internals_error(
                f"{qualname} with parameters {tuple(params)} (found {found})",
                used_for,
            )
    return value


def _owner_name(owner) -> str:
    return getattr(owner, "__name__", None) or type(owner).__name__


def _require_module(path: str, used_for: str):
    """The private module `path` (e.g. `keras.src.saving.saving_lib`),
    checked: a Keras, TensorFlow or KerasTuner that moved it gets
    `KerasInternalsError`, not an `ImportError` from deep inside a fit."""
    warn_if_untested()
    try:
        return _import_module(path)
    except ImportError:
        raise _internals_error(f"the module `{path}`", used_for) from None


# --- Keras functions keras-mgpu runs a copy of -------------------------------
# A copy is right only for the original it was copied from, so the original
# is checked before the copy runs: its shape (its syntax tree without
# docstrings, comments or layout, hashed) must be one of those below. A
# Keras whose original changed is refused (`KerasInternalsError`) until the
# copy is checked against the new original and its shape added here.
# `python -m keras_mgpu.compat` prints the installed Keras's shapes.

# shape -> the variant of the original the copy knows, by function.
_KNOWN_SHAPES = {
    # The multi-step loop (`enable_multi_step_fit`) and the train function
    # the runtime's twin re-creates (`instrumented_train_function`). Up to
    # 3.15 every batch is fetched inside `multi_step_on_iterator`; in the
    # 3.16 nightlies (whose `steps_per_execution` paths keras-team/keras#23179
    # and #23305 change) a one-step call fetches its batch on the host.
    "_make_function": {
        "77e5711252cfdcbe": "graph_fetch",  # 3.10.0 to 3.11.3
        "86a5dfca54cf6ca3": "graph_fetch",  # 3.12.0 to 3.15.1
        "9c7b75ec53a7c04d": "host_fetch_one_step",  # 3.16.0.dev2026102704
    },
    # The symbolic build `enable_multi_worker_fit` does on one replica.
    "_maybe_symbolic_build": {
        "e69d77e6d0785be0": "reduce_first_batch",  # 3.10.0
        "fd64b7a638fde084": "reduce_first_batch",  # 3.11.0 to 3.16 nightly
    },
    # `weights_layout`/`weights_file` and `load_weights_file`: what these do
    # for a `.weights.h5` file, without the file.
    "save_weights_only": {
        "8f0c31d2d4fdf80f": "h5_store",  # 3.10.0 to 3.14.1
        "76642524f44a30e8": "h5_store",  # 3.15.0 to 3.16 nightly
    },
    "load_weights_only": {
        "efcd49864c49a7a2": "h5_store",  # 3.10.0 to 3.14.1
        "b254a1d3be333bcd": "h5_store",  # 3.15.0 to 3.15.1
        "9bac267aa6720ead": "h5_store",  # 3.16.0.dev2026102704
    },
}


@functools.lru_cache(maxsize=16)
def _shape_of(function) -> str:
    """A hash of `function`'s source as Python parses it: the same for the
    same code whatever its comments, docstrings, layout or Python version."""
    import ast
    import textwrap

    source = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
    return _shape_of_tree(ast.parse(source).body[0])


def _shape_of_tree(tree) -> str:
    import ast
    import hashlib

    def without_docstring(body):
        if (body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            return body[1:]
        return body

    def dump(node):
        if isinstance(node, list):
            return [dump(item) for item in node]
        if not isinstance(node, ast.AST):
            return repr(node)
        fields = []
        for name in node._fields:
            # Fields some Python versions add or fill in: not the code's.
            if name in ("type_params", "type_comment", "kind"):
                continue
            value = getattr(node, name, None)
            if name == "body" and isinstance(
                    node, (ast.FunctionDef, ast.AsyncFunctionDef,
                           ast.ClassDef)):
                value = without_docstring(value)
            fields.append((name, dump(value)))
        return [type(node).__name__, fields]

    return hashlib.sha256(repr(dump(tree)).encode()).hexdigest()[:16]


def _copied_variant(owner, name: str, used_for: str) -> str:
    """The known variant of Keras's `owner.name`, which keras-mgpu runs a
    copy of; `KerasInternalsError` if its shape is not a known one."""
    function = _require(owner, name, used_for)
    # Keras's own, where keras-mgpu has put its copy in its place.
    function = getattr(function, "keras_stock", function)
    key = f"{_owner_name(owner)}.{name}"
    known = _KNOWN_SHAPES[name]
    try:
        shape = _shape_of(function)
    except (OSError, TypeError, SyntaxError):
        shape = None
    if shape not in known:
        raise _internals_error(
            f"`{key}` as keras-mgpu copied it (its code on this Keras has "
            f"shape {shape}, not one of {sorted(known)}: keras-mgpu's copy "
            "may no longer do what Keras's own does)", used_for)
    return known[shape]
