"""Keras's weights file (keras/src/saving/saving_lib.py): the backup's
snapshot of the weights to host memory (`weights_layout`), its `.weights.h5`
bytes (`weights_file`) and their load (`load_weights_file`), with no file
in between.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import numpy as np

from keras_mgpu.compat._core import (
    _copied_variant, _internals_error, _require, _require_module)
from keras_mgpu.compat.registry import _BACKUP

_SAVING_LIB = "keras.src.saving.saving_lib"


class WeightsLayout:
    """Where `model.save_weights` puts each value: the objects Keras's own
    walk of the model saves (layers, optimizer, metrics), in its order and
    with its paths, found once.

    `read()` has each of them put its values into host memory now, as
    `save_weights` would: the training thread pays only for the reads
    (device-to-host copies; collectives for replica-local variables under
    MultiWorkerMirroredStrategy, in the same order on every worker), not
    for the walk (which inspects every attribute of every layer) or the
    file, which `weights_file(snapshot)` writes later, on any thread. Valid
    while the model saves the same objects: find it again after a
    recompile.
    """

    def __init__(self, saveables: list, store_class):
        self._saveables = saveables
        self._store_class = store_class

    def read(self, into: Optional[list] = None,
             to_host: Callable = np.asarray) -> list:
        """`[(path, metadata, [(key, array), ...])]`, for `weights_file`.

        `into`: an earlier `read()` whose arrays are no longer used: the
        values are copied into them (no new host memory to allocate and
        fault in, which costs more than the copy for large models).
        `to_host`: a value in host memory, from a variable (the backend's:
        on JAX it gathers shards other processes hold).
        """
        buffers = None if into is None else (
            array for _, _, values in into for _, array in values)
        store = self._store_class(buffers=buffers, to_host=to_host)
        for path, metadata, saveable, by_variables in self._saveables:
            entry = store.make(path, metadata=metadata)
            if by_variables:
                # The same entries, the variables given to `to_host`.
                for i, variable in enumerate(saveable.variables):
                    entry[str(i)] = variable
            else:
                saveable.save_own_variables(entry)
        return store.entries


def layout_key(model) -> tuple:
    """What `weights_layout(model)` depends on, cheap to compare (a walk
    costs about 0.1 s for a 2-layer transformer): the objects Keras's walk
    reaches are the model's layers (through their variables), its
    optimizer and its metrics; a recompile, a new optimizer or a layer
    added changes the key. An optimizer building its variables does not
    (`WeightsLayout.read` lists them at each read). Ids compare safely
    while the layout lives: it holds these objects, so none is freed for
    another to take its id."""
    return (id(getattr(model, "optimizer", None)),
            tuple(map(id, model.metrics)), tuple(map(id, model.weights)))


def _saves_through_numpy(saveable) -> bool:
    """Whether `saveable` saves with Keras's optimizer's own method, which
    stores `variable.numpy()` of each of its variables (upstream:
    keras/src/optimizers/base_optimizer.py, `save_own_variables`): on JAX
    that cannot read a variable split over devices of other processes.
    Remove when that method stores the variables, as layers' does."""
    import keras

    own = getattr(type(saveable), "save_own_variables", None)
    return own is not None and (
        own is keras.optimizers.Optimizer.save_own_variables)


def _no_values(store) -> None:
    pass


def _saving_lib():
    return _require_module(_SAVING_LIB, _BACKUP)


def _save_state():
    # What `save_weights_only` does for a `.weights.h5` file.
    _copied_variant(_saving_lib(), "save_weights_only", _BACKUP)
    return _require(
        _saving_lib(), "_save_state", _BACKUP,
        params=("saveable", "weights_store", "assets_store", "inner_path",
                "visited_saveables"))


def _load_state():
    # What `load_weights_only` does for a `.weights.h5` file.
    _copied_variant(_saving_lib(), "load_weights_only", _BACKUP)
    return _require(
        _saving_lib(), "_load_state", _BACKUP,
        params=("saveable", "weights_store", "assets_store", "inner_path"))


def _saveable_walk():
    # Keras's walk of an object's saveable children, and what it descends
    # into: `weights_layout` finds the objects of the paths with them.
    walk = _require(_saving_lib(), "_walk_saveable", _BACKUP)
    saveable_class = _require(
        _require_module("keras.src.saving.keras_saveable", _BACKUP),
        "KerasSaveable", _BACKUP)
    return walk, saveable_class


def _h5_store():
    return _require(_saving_lib(), "H5IOStore", _BACKUP)


def weights_layout(model) -> WeightsLayout:
    """Finds where `model.save_weights` would put each of its values."""
    save_state = _save_state()
    store_class = _recording_store_class(_h5_store())
    # Keras's walk gives the store each saveable's path, then marks the
    # saveable visited: that pairs the path with the object (found by the
    # same walk, `_saveables_of`), without looking into Keras's frames.
    visits = _Visits()
    finder = store_class(visits=visits)
    objects = _saveables_of(model)
    # Only the paths are wanted: no optimizer reads its variables (which
    # on JAX fails for one split over several processes).
    quiet = {key: o for key, o in objects.items() if _saves_through_numpy(o)}
    for saveable in quiet.values():
        saveable.save_own_variables = _no_values
    try:
        save_state(model, weights_store=finder, assets_store=None,
                   inner_path="", visited_saveables=visits)
    finally:
        for saveable in quiet.values():
            del saveable.save_own_variables
    if len(visits.made) != len(finder.entries):
        raise _internals_error(
            f"`{_SAVING_LIB}._save_state` marking each saveable visited "
            "after its entry", _BACKUP)
    saveables = []
    for (path, metadata, _), key in zip(finder.entries, visits.made):
        name = (metadata or {}).get("name")
        if key not in objects or (
                name is not None and objects[key].name != name):
            raise _internals_error(
                f"`{_SAVING_LIB}._walk_saveable` reaching the object saved "
                f"at {path!r} as `_save_state` does", _BACKUP)
        # Whether it saves through `.numpy()`: found once here, not at
        # every save.
        saveables.append((path, metadata, objects[key], key in quiet))
    return WeightsLayout(saveables, store_class)


class _Visits(set):
    """`_save_state`'s `visited_saveables`: the ids of the objects it gave
    the store an entry to (`made`, in order), told apart from the others by
    `mark_entry` (called by the store as it makes an entry)."""

    def __init__(self):
        super().__init__()
        self.made = []
        self._entry_pending = False

    def mark_entry(self) -> None:
        self._entry_pending = True

    def add(self, key) -> None:
        super().add(key)
        if self._entry_pending:
            self.made.append(key)
            self._entry_pending = False


def _saveables_of(model) -> dict:
    """`{id: object}` of every saveable Keras's walk of `model` reaches."""
    walk, saveable_class = _saveable_walk()
    # Every object seen, kept alive: a container made by a property on each
    # read must not free its id for another while the walk goes on.
    seen, found, pending = {}, {}, [model]
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen[id(item)] = item
        if isinstance(item, saveable_class):
            found[id(item)] = item
            pending.extend(child for _, child in walk(item))
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
    return found


def weights_file(snapshot: list) -> memoryview:
    """The bytes of the `.weights.h5` file `model.save_weights` would have
    written when `snapshot` (`WeightsLayout.read()`) was taken, made by
    Keras's own HDF5 store (in memory), so that `model.load_weights` reads
    it. A view of the buffer they were written to, not a copy."""
    import io

    buffer = io.BytesIO()
    store = _h5_store()(buffer, mode="w")
    try:
        for path, metadata, values in snapshot:
            entry = store.make(path, metadata=metadata)
            for key, value in values:
                entry[key] = value
    finally:
        store.close()
    return buffer.getbuffer()


def load_weights_file(model, data: bytes) -> None:
    """`model.load_weights` of a `.weights.h5` file given as its bytes (read
    and verified by the caller), so that exactly those bytes are loaded,
    not whatever the file on disk holds by the time it is opened again.

    What `keras.saving.saving_lib.load_weights_only` does with a path, from
    an in-memory file (upstream: keras/src/saving/saving_lib.py; remove when
    `Model.load_weights` accepts a file object).
    """
    import io

    load_state = _load_state()
    store = _h5_store()(io.BytesIO(data), mode="r")
    failed: set[int] = set()
    errors: dict[int, tuple[Any, Any]] = {}
    try:
        load_state(model, store, None, "", visited_saveables=set(),
                   failed_saveables=failed, error_msgs=errors)
    finally:
        store.close()
    if failed:
        saveable, error = next(iter(errors.values()))
        raise ValueError(
            f"{len(errors)} objects could not be loaded from the backup's "
            f"weights, e.g. {saveable}: {error}")


@functools.lru_cache(maxsize=4)
def _recording_store_class(h5_store):
    # A subclass: Keras's walk accepts only its own store types. Which
    # class is known at run time only.
    class _RecordingStore(h5_store):  # type: ignore[misc, valid-type]
        def __init__(self, visits=None, buffers=None, to_host=np.asarray):
            # No file is set up: nothing of the parent's state is used.
            self.entries = []
            self._to_host = to_host
            self._visits = visits
            self._values: Optional[list] = None
            self._buffers = iter(buffers or ())

        def __bool__(self):
            return True

        def make(self, path, metadata=None):
            if self._visits is not None:
                # `_save_state` marks the saveable visited next.
                self._visits.mark_entry()
            self._values = []
            self.entries.append((path, metadata, self._values))
            return self

        def __setitem__(self, key, value):
            if self._visits is not None:
                return
            # A copy (the variables train on while the file is written),
            # into the earlier read's array where there is one: memory in
            # use already, where a new array per save is faulted in page
            # by page.
            source = self._to_host(value)
            buffer = next(self._buffers, None)
            if (buffer is not None and buffer.shape == source.shape
                    and buffer.dtype == source.dtype):
                np.copyto(buffer, source)
            else:
                buffer = np.array(source)
            # `make` (which Keras calls first) set it.
            assert self._values is not None
            self._values.append((key, buffer))

    return _RecordingStore
