"""keras-mgpu's Keras half, imported as soon as Keras is.

`import keras_mgpu` imports neither Keras nor TensorFlow, so the command
line, the launcher and `quiet_tensorflow()` start at the speed of Python.
What must still happen before a user's model exists happens once Keras is
imported, before or after this package: its serializable classes are
registered with Keras (so `keras.models.load_model` finds them) and `fit`
records itself (`model.fit(x, callbacks=[DistributedLogger(...)])` looks
`fit` up before it makes the callback). Standard library only.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import threading

# Importing these registers every serializable class and wraps `fit`.
CORE = ("accumulation", "callbacks", "compat", "data", "layers",
        "mixed_precision", "schedules", "strategy")

_lock = threading.RLock()
_loading = 0  # keras_mgpu modules being executed now
_pending = False  # Keras is imported, the core is not yet
_done = False


def load() -> None:
    """Imports the core now (once): where the first use of a component
    comes before any `import keras`."""
    global _done
    with _lock:
        if _done:
            return
        _done = True
        _finder.remove()
        from keras_mgpu import backend

        try:
            backend.active()
        except ImportError:
            # A Keras backend keras-mgpu has no module for: `import keras`
            # must not fail for it; each component says so when used.
            return
        for name in CORE:
            importlib.import_module(f"keras_mgpu.{name}")


class _Loader(importlib.abc.Loader):
    """Runs a module as its own loader would, then loads the core when
    Keras has been imported and no keras_mgpu module is half-made (which
    the core would import half-made)."""

    def __init__(self, loader, name: str):
        self._loader, self._name = loader, name

    def __getattr__(self, name):
        # get_source, get_resource_reader, ...: the module's own loader's.
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        global _loading, _pending
        ours = self._name != "keras"
        with _lock:
            _loading += ours
        try:
            self._loader.exec_module(module)
        finally:
            with _lock:
                _loading -= ours
                _pending = _pending or self._name == "keras"
                ready = _pending and not _loading and not _done
        if ready:
            load()


class _Finder(importlib.abc.MetaPathFinder):
    """Gives Keras's top module and keras_mgpu's modules a `_Loader`
    while the core is not loaded."""

    def find_spec(self, name, path, target=None):
        if name != "keras" and not name.startswith("keras_mgpu."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader,
                                                       "exec_module"):
                    spec.loader = _Loader(spec.loader, name)
                return spec
        return None

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


_finder = _Finder()


def install() -> None:
    """Loads the core now if Keras is already imported, else when it is."""
    if "keras" in sys.modules:
        load()
    else:
        _finder.install()
