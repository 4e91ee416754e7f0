"""Callback state saved with each `BackupAndRestore` generation.

A callback whose state decides what happens after a restart (the best value
seen so far, a patience counter, the best weights) has it saved with every
generation and restored when a rerun resumes, so the resumed `fit` goes on
as the uninterrupted one would have. A callback takes part in one of two
ways:

- it has the methods `get_state() -> dict` and `set_state(state: dict)`
  (the names of KerasTuner's `Stateful` objects; Lightning calls them
  `state_dict` and `load_state_dict`);
- its class (or a base class) is registered with
  `register_callback_state(cls, get_state, set_state)`, for callbacks whose
  code is not yours. keras-mgpu registers Keras's `EarlyStopping`
  (including `best_weights`), `ReduceLROnPlateau` and `ModelCheckpoint`.

Its own methods win over a registered class.
"""

from __future__ import annotations

import io
import json
import re
import warnings
from functools import partial
from typing import Any, Callable, Optional

import keras
import numpy as np

# The file of a generation that holds the arrays of the callbacks' states.
ARRAYS_FILE = "callbacks.npz"

# Stands for an array in the JSON part of a state: {"__ndarray__": "a0"}.
_ARRAY_KEY = "__ndarray__"

# The most levels of dicts and lists inside one another in a callback state,
# its own dict the first. Saving, checking and reading one back walk every
# level, and Python's JSON recurses once per level: a deeper state (or one
# that contains itself) would end in a RecursionError naming nothing.
MAX_STATE_DEPTH = 100

_registry: dict[type, tuple[Callable[[Any], dict],
                           Callable[[Any, dict], None]]] = {}


def register_callback_state(
    cls: type,
    get_state: Callable[[Any], dict],
    set_state: Callable[[Any, dict], None],
) -> None:
    """Saves and restores the state of every `cls` callback with the backup.

    For callbacks whose code is not yours (a library's); a callback of your
    own can have `get_state()` and `set_state(state)` methods instead. A
    subclass of `cls` is covered too, unless it has those methods itself.
    Registering a class again replaces its functions.

    The state is a dict of JSON values (`None`, bool, int, float, str,
    lists, dicts with string keys) and NumPy arrays and scalars, nested up
    to `MAX_STATE_DEPTH` (100) levels of dicts and lists, the state's own
    dict the first; tuples come back as lists. A deeper state, or one that
    contains itself, is refused when the backup saves, naming the callback
    and the key. Arrays and NumPy scalars are not put
    through JSON: they go, bit for bit and with their dtype, into a file of
    the generation (`callbacks.npz`), checksummed like the weights. A state
    is copied when the backup saves, so `get_state` may return the
    callback's own arrays.

    `set_state` is called as the first resumed epoch begins, after every
    callback's `on_train_begin` (Keras's callbacks reset their state there),
    with the dict `get_state` returned at the save.

    Args:
        cls: The callback class.
        get_state: `get_state(callback) -> dict`.
        set_state: `set_state(callback, state)`.

    Example:

    >>> import keras
    >>> from keras_mgpu.callbacks import register_callback_state
    >>> class Counter(keras.callbacks.Callback):  # say, from a library
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.epochs_seen = 0
    ...     def on_epoch_end(self, epoch, logs=None):
    ...         self.epochs_seen += 1
    >>> register_callback_state(
    ...     Counter,
    ...     lambda c: {"epochs_seen": c.epochs_seen},
    ...     lambda c, state: setattr(c, "epochs_seen", state["epochs_seen"]))
    """
    if not isinstance(cls, type):
        raise TypeError(
            f"register_callback_state needs a callback class, got {cls!r}.")
    for name, function in (("get_state", get_state),
                           ("set_state", set_state)):
        if not callable(function):
            raise TypeError(
                f"register_callback_state({cls.__name__}, ...): {name} must "
                f"be a function, got {function!r}.")
    _registry[cls] = (get_state, set_state)


def _attributes(*names: str):
    """get_state and set_state for a callback whose state is attributes."""

    def get_state(callback) -> dict:
        return {name: getattr(callback, name, None) for name in names}

    def set_state(callback, state: dict) -> None:
        for name in names:
            if name in state:  # a backup written before the name was saved
                setattr(callback, name, state[name])

    return get_state, set_state


# Attributes that decide what these do after a restart. EarlyStopping's
# `best_weights` is a list of arrays (`restore_best_weights=True`), or None.
register_callback_state(
    keras.callbacks.EarlyStopping,
    *_attributes("wait", "stopped_epoch", "best", "best_epoch",
                 "best_weights"))
register_callback_state(
    keras.callbacks.ReduceLROnPlateau,
    *_attributes("best", "wait", "cooldown_counter"))
register_callback_state(
    keras.callbacks.ModelCheckpoint, *_attributes("best"))


# --- used by BackupAndRestore --------------------------------------------------


def stateful_callbacks(callbacks) -> list:
    """(name, get_state, set_state) of each callback whose state is saved,
    in list order; `get_state()` and `set_state(state)` take no callback."""
    found = []
    for callback in callbacks:
        own_get = getattr(callback, "get_state", None)
        own_set = getattr(callback, "set_state", None)
        if callable(own_get) and callable(own_set):
            found.append((type(callback).__name__, own_get, own_set))
            continue
        if callable(own_get) != callable(own_set):
            has, missing = (("get_state", "set_state") if callable(own_get)
                            else ("set_state", "get_state"))
            raise TypeError(
                f"The callback {type(callback).__name__} has {has} but no "
                f"{missing}: BackupAndRestore saves the state of a "
                "callback that has both get_state() -> dict and "
                "set_state(state). Add the missing method, or rename the "
                "other if it is not meant for the backup."
            )
        for cls in type(callback).__mro__:
            if cls in _registry:
                get_state, set_state = _registry[cls]
                found.append((
                    type(callback).__name__,
                    lambda c=callback, f=get_state: f(c),
                    lambda state, c=callback, f=set_state: f(c, state),
                ))
                break
    return found


def snapshot(callbacks) -> tuple:
    """The states of `callbacks` as saved: (entries for the generation's
    JSON state, the bytes of `ARRAYS_FILE` or None when no state holds an
    array)."""
    entries: list[dict] = []
    arrays: dict[str, Any] = {}
    for name, get_state, _ in stateful_callbacks(callbacks):
        state = get_state()
        where = f"{name}.get_state()"
        if not isinstance(state, dict):
            raise TypeError(
                f"{where} must return a dict, got {type(state).__name__}.")
        entries.append({"class": name,
                        "state": _encode(state, arrays, name, [], {})})
    if not arrays:
        return entries, None
    buffer = io.BytesIO()
    # Copied here, on the training thread: the callback may change its
    # arrays in place while the generation is written.
    np.savez(buffer, **arrays)
    return entries, buffer.getvalue()


def _encode(value, arrays: dict, name: str, keys: list, enclosing: dict):
    """`value`, found at `keys` in the state of the callback class `name`,
    as saved. `enclosing`: the id of each dict and list that holds it, and
    how many keys lead to it."""
    # Where the value is, in messages: formatted only for one.
    where = partial(_where, name, keys)
    if isinstance(value, (dict, list, tuple)):
        if id(value) in enclosing:
            inside = _where(name, keys[:enclosing[id(value)]])
            raise ValueError(
                f"{where()} is {inside} itself, which contains it: a "
                "callback state that contains itself cannot be saved (it is "
                "saved as JSON, a tree). Have get_state() return a copy "
                "without the reference, e.g. an index or key in its place."
            )
        if len(keys) >= MAX_STATE_DEPTH:
            raise ValueError(
                f"{where()} is nested more than {MAX_STATE_DEPTH} levels "
                "deep (dicts and lists inside one another, the state's own "
                "dict the first), the most BackupAndRestore saves. Have "
                f"{name}.get_state() return it flatter, e.g. a dict of "
                "arrays, or a NumPy array for a table."
            )
        enclosing = {**enclosing, id(value): len(keys)}
    if isinstance(value, (np.ndarray, np.generic)):
        if value.dtype.hasobject:
            raise TypeError(
                f"{where()} holds a NumPy array of Python objects, which "
                "BackupAndRestore does not save (it would need pickle). Use "
                "arrays of numbers, or JSON values.")
        # "s": a scalar (`get_weights` gives one for a 0-d variable), read
        # back as a scalar of its dtype.
        key = f"{'a' if isinstance(value, np.ndarray) else 's'}{len(arrays)}"
        arrays[key] = value
        return {_ARRAY_KEY: key}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_encode(v, arrays, name, keys + [i], enclosing)
                for i, v in enumerate(value)]
    if isinstance(value, dict):
        encoded = {}
        for key, v in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{where()} has the key {key!r}: the keys of a callback "
                    "state must be strings (it is saved as JSON).")
            if key == _ARRAY_KEY:
                raise ValueError(
                    f"{where()} has the key {_ARRAY_KEY!r}, which "
                    "BackupAndRestore reserves for the arrays of a state. "
                    "Rename it.")
            encoded[key] = _encode(v, arrays, name, keys + [key], enclosing)
        return encoded
    raise TypeError(
        f"{where()} is of type {type(value).__name__} ({value!r:.80}), which "
        "BackupAndRestore cannot save. A callback state holds JSON values "
        "(None, bool, int, float, str, lists, dicts with string keys) and "
        "NumPy arrays.")


def _where(name: str, keys: list) -> str:
    """Where `keys` lead in the state of the callback class `name`, e.g.
    `EarlyStopping.get_state()['best_weights'][0]`; the middle of a long
    path left out."""
    steps = [f"[{k!r}]" for k in keys]
    if len(steps) > 8:
        steps = steps[:4] + ["..."] + steps[-2:] + [f" ({len(keys)} keys)"]
    return f"{name}.get_state(){''.join(steps)}"


def _too_deep_saved(name: str, keys: list) -> str:
    return (f"the saved {_where(name, keys)} is nested more than "
            f"{MAX_STATE_DEPTH} levels deep, which BackupAndRestore never "
            "saves: the generation's state.json was changed after the save")


def decode(entries: list, arrays_file: Optional[bytes]) -> list:
    """`entries` as saved by `snapshot`, their arrays read back from
    `arrays_file`. Raises ValueError naming an array that is missing, or a
    state nested deeper than a save writes, with its callback and key (the
    backup takes either as its generation's fault)."""
    arrays = {}
    if arrays_file is not None:
        with np.load(io.BytesIO(arrays_file), allow_pickle=False) as loaded:
            arrays = {key: loaded[key] for key in loaded.files}
    decoded = []
    for entry in entries:
        # "values": the key of backups written before get_state/set_state.
        state = entry["state"] if "state" in entry else entry["values"]
        decoded.append({"class": entry["class"],
                        "state": _decode(state, arrays, entry["class"], [])})
    return decoded


def _decode(value, arrays: dict, name: str, keys: list):
    if isinstance(value, (dict, list)) and len(keys) >= MAX_STATE_DEPTH:
        raise ValueError(_too_deep_saved(name, keys))
    if isinstance(value, dict):
        if set(value) == {_ARRAY_KEY}:
            key = value[_ARRAY_KEY]
            if key not in arrays:
                raise ValueError(f"a callback state's array {key!r} is not "
                                 f"in its {ARRAYS_FILE}")
            return arrays[key][()] if key.startswith("s") else arrays[key]
        return {k: _decode(v, arrays, name, keys + [k])
                for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, arrays, name, keys + [i])
                for i, v in enumerate(value)]
    return value


# A JSON string, or one of the characters that open, close and separate.
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[][{},:]')


def too_deep_to_decode(raw: bytes) -> str:
    """Why a generation's state.json that Python's JSON decoder gave up on
    (`RecursionError`) is unusable: the callback and key where its state
    nests deeper than a save writes, found by a walk of the text that does
    not recurse; or the keys to the first level that deep elsewhere."""
    # The state.json object, its "callbacks" list and an entry hold each
    # callback state's dict.
    above = 3
    keys, classes = _first_too_deep(raw.decode("utf-8", "replace"),
                                    above + MAX_STATE_DEPTH)
    if keys is None:
        return "state.json is nested too deep to decode"
    if (len(keys) > above and keys[0] == "callbacks"
            and keys[2] in ("state", "values")
            and isinstance(classes[2], str)):
        return _too_deep_saved(classes[2], keys[above:])
    return (f"state.json is nested more than {above + MAX_STATE_DEPTH} "
            f"levels deep, at {''.join(f'[{k!r}]' for k in keys[:8])}"
            f"{'...' if len(keys) > 8 else ''}, which a save never writes")


def _first_too_deep(text: str, limit: int) -> tuple:
    """(the keys to the first dict or list of the JSON `text` nested more
    than `limit` levels deep, the `"class"` string of each dict on the way)
    or (None, None)."""
    # Per open dict or list: [is a dict, its current key or index, the
    # string value of its "class" key].
    open_: list[list[Any]] = []
    want_key = False
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        top = open_[-1] if open_ else None
        if token[0] == '"':
            if top is not None and top[0]:
                string = json.loads(token)
                if want_key:
                    top[1], want_key = string, False
                elif top[1] == "class":
                    top[2] = string
        elif token in "[{":
            if len(open_) >= limit:
                return [o[1] for o in open_], [o[2] for o in open_]
            open_.append([token == "{", None if token == "{" else 0, None])
            want_key = token == "{"
        elif token in "]}":
            if top is None:
                break  # not JSON: nothing deeper to find
            open_.pop()
            want_key = False
        elif token == "," and top is not None:
            if top[0]:
                want_key = True
            else:
                top[1] += 1
    return None, None


def restore(callbacks, entries: list) -> None:
    """Gives each stateful callback its saved state.

    The k-th stateful callback of a class gets the state of the k-th one of
    that class in the backed-up run: other callbacks may come and go
    between runs. A class whose number of callbacks differs gets nothing,
    with a warning.
    """
    current: dict[str, list[Callable[[dict], None]]] = {}
    for name, _, set_state in stateful_callbacks(callbacks):
        current.setdefault(name, []).append(set_state)
    saved: dict[str, list[dict]] = {}
    for entry in entries:
        saved.setdefault(entry["class"], []).append(entry["state"])
    differ = sorted(name for name in set(current) | set(saved)
                    if len(current.get(name, ())) != len(saved.get(name, ())))
    if differ:
        counts = ", ".join(
            f"{name}: {len(saved.get(name, ()))} saved, "
            f"{len(current.get(name, ()))} now" for name in differ)
        warnings.warn(
            "BackupAndRestore: the run has other stateful callbacks than "
            f"the backed-up run ({counts}); the state of these was not "
            "restored.",
            stacklevel=3,
        )
    for name, setters in current.items():
        if name in differ:
            continue
        for set_state, state in zip(setters, saved[name]):
            set_state(state)
