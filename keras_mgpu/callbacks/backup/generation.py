"""What one generation holds: its files, the schema of its `state.json`,
and reading a committed one back (also outside `fit`: tests, tools)."""

from __future__ import annotations

import io
import json
import math

import numpy as np

from keras_mgpu import compat
from keras_mgpu.callbacks.backup import state as callback_state
from keras_mgpu.callbacks.backup.store import CorruptGeneration, GenerationStore

FORMAT_VERSION = 3
# Format 2 (before #31): callback states as {"class", "values"} and no
# callbacks.npz. Still read; an older keras-mgpu refuses format 3 by name.
READABLE_FORMATS = (2, FORMAT_VERSION)

WEIGHTS = "weights.weights.h5"
EXTRA = "variables.npz"
STATE = "state.json"
# What a generation must hold to be restored.
REQUIRED = frozenset({WEIGHTS, EXTRA, STATE})


def encode(weights: list, extra: list, state: dict, more_files: dict) -> dict:
    """A generation's files (name to bytes) from a host snapshot: the
    weights as `save_weights` writes them, the variables it leaves out,
    the state, and `more_files` (the callbacks' arrays)."""
    buffer = io.BytesIO()
    np.savez(buffer, *extra)
    return {
        WEIGHTS: compat.weights_file(weights),
        EXTRA: buffer.getvalue(),
        STATE: json.dumps(state, allow_nan=True).encode(),
        **more_files,
    }


def parse_state(files: dict) -> dict:
    """The state of a generation whose files verified, checked against its
    schema; `CorruptGeneration` if it is not what a save writes."""
    bad = CorruptGeneration
    try:
        state = json.loads(files[STATE])
    except RecursionError:
        # Deeper than a save writes: the walk that names the callback and
        # key does not recurse.
        raise bad(callback_state.too_deep_to_decode(files[STATE])) from None
    except ValueError as e:
        raise bad(f"{STATE} is not JSON ({e})") from None
    if not isinstance(state, dict):
        raise bad(f"{STATE} holds {type(state).__name__}, not an object")
    if state.get("format") not in READABLE_FORMATS:
        # Another version's layout: refused as such by the compatibility
        # check.
        return state
    checks = {
        "epoch": is_count, "step_in_epoch": is_count,
        "runtime": lambda v: isinstance(v, dict),
        "architecture": lambda v: isinstance(v, str),
        "training": lambda v: v is None or (
            isinstance(v, dict) and {"optimizer", "accum_steps"} <= set(v)
            and (v["optimizer"] is None or (
                isinstance(v["optimizer"], dict)
                and isinstance(v["optimizer"].get("class"), str)
                and "config" in v["optimizer"]))),
        # "values": the key of backups written before get_state/set_state.
        "callbacks": lambda v: isinstance(v, list) and all(
            isinstance(c, dict) and isinstance(c.get("class"), str)
            and isinstance(c.get("state", c.get("values")), dict) for c in v),
    }
    runtime = state.get("runtime")
    runtime_checks = {
        "global_step": is_count,
        "samples_seen": lambda v: v is None or is_amount(v),
        "epoch_samples": lambda v: v is None or is_amount(v),
        "updates_offset": lambda v: v is None or is_count(v),
        "input_wait_seconds": is_amount,
        "replicas": lambda v: is_count(v) and v >= 1,
        "resumes": lambda v: isinstance(v, list) and all(
            isinstance(e, dict) and set(e) == {
                "generation", "step", "epoch", "saved_replicas", "replicas"}
            and all(is_count(x) for x in e.values()) for e in v),
    }
    # Written since the runtime counts a data stream kept across epochs:
    # absent from older backups, where they mean 0.
    optional_runtime_checks = {
        "stream_before_epoch": is_count,
        "keras_count_before_epoch": is_count,
    }
    problems = [
        f"{key} {state.get(key, '(missing)')!r}"
        for key, valid in checks.items()
        if key not in state or not valid(state[key])
    ]
    if isinstance(runtime, dict):
        problems += [
            f"runtime.{key} {runtime.get(key, '(missing)')!r}"
            for key, valid in runtime_checks.items()
            if key not in runtime or not valid(runtime[key])
        ] + [
            f"runtime.{key} {runtime[key]!r}"
            for key, valid in optional_runtime_checks.items()
            if key in runtime and not valid(runtime[key])
        ]
    if problems:
        raise bad(f"{STATE} has an invalid {', '.join(problems)}")
    try:
        # Arrays of the callbacks' states: a missing one is this
        # generation's fault, as a missing file is.
        state["callbacks"] = callback_state.decode(
            state["callbacks"], files.get(callback_state.ARRAYS_FILE))
    except ValueError as e:
        raise bad(str(e)) from None
    return state


def is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_amount(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)


def generation_dir(directory: str, number: int) -> str:
    return GenerationStore(directory).path(number)


def generations(directory: str) -> list:
    """Committed generation numbers, newest first."""
    return GenerationStore(directory).generations()


def read_generation(directory: str, number: int):
    """(state, the other files) of a generation, verified."""
    files = GenerationStore(directory).read(number, REQUIRED)
    return parse_state(files), {k: v for k, v in files.items()
                                if k != STATE}
