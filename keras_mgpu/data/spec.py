"""`spec.json`: the feature spec `write_tfrecords` saves beside its shards,
read and checked."""

from __future__ import annotations

import json
import os
import stat
from functools import partial
from typing import Any, Optional

import tensorflow as tf

from keras_mgpu import _fs
from keras_mgpu._checks import (
    file_kind,
    is_integer,
    is_nonempty_path,
    is_positive_int,
)
from keras_mgpu.data.structure import _MAX_DEPTH, _depth_beyond, _flat_names

SPEC_FILE = "spec.json"
"""The name of the feature spec `write_tfrecords` saves next to the shards."""
SPEC_VERSION = 2  # 2: nested structures (a tree of tuples and dicts)
"""The spec format `write_tfrecords` writes and `read_spec` reads (2: nested
structures, a tree of tuples and dicts)."""


def read_spec(directory: str) -> dict:
    """The feature spec `write_tfrecords` saved in `directory`.

    Args:
        directory: The folder of the shards (a `str` or `os.PathLike`).

    Returns:
        The spec: `version` (2), `structure`, `features`, `num_examples`,
        `files`, `examples_per_file` and, if recorded, `bytes_per_file`.
        `structure` is the nesting written, as JSON: a feature name
        (`"f0"`, a leaf; the leaves are `f0`, `f1`, ... in order),
        `{"tuple": [...]}` or `{"dict": [[key, ...], ...]}` (keys in
        order). `features` maps each feature name to its
        `dtype` and per-example `shape`. `files` names the shards, and
        `examples_per_file` and `bytes_per_file` give each one's examples
        and size (a spec written before they were recorded gets the
        examples from the round-robin dealing, and no sizes). A spec that is
        not a regular file, not valid JSON, lacks what the reader needs,
        names its leaves in another order (two fields swapped by hand), or
        has another version (version 1, written before nested structures,
        included) is a `ValueError` naming the file.
    """
    path = f"{_check_directory(directory)}/{SPEC_FILE}"
    if not _fs.exists(path):
        raise FileNotFoundError(
            f"No {SPEC_FILE} in {directory!r}: write the shards with "
            "keras_mgpu.data.write_tfrecords, which saves the spec beside "
            "them."
        )
    # Never blocks on a FIFO (reading one waits for a writer).
    raw = _fs.read_bytes(path, check=partial(_check_regular, path))
    try:
        spec = json.loads(raw)
    except RecursionError:
        raise _bad_spec(path, "nested too deep to decode") from None
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise _bad_spec(path, f"not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise _bad_spec(
            path, f"a JSON object expected, got a {type(spec).__name__}"
        )
    version: Any = spec.get("version")  # any JSON value, or None
    if version != SPEC_VERSION:
        older = is_integer(version) and version < SPEC_VERSION
        raise ValueError(
            f"{path!r} has spec version {version!r}"
            f"{' (an older keras-mgpu)' if older else ''}; this keras-mgpu "
            f"reads version {SPEC_VERSION}. Rewrite the shards with "
            "keras_mgpu.data.write_tfrecords, or read them with the "
            "keras-mgpu that wrote them."
        )
    problem = _spec_problem(spec)
    if problem:
        raise _bad_spec(path, problem)
    if "examples_per_file" not in spec:  # written before it was recorded
        spec["examples_per_file"] = _round_robin(spec["num_examples"],
                                                 len(spec["files"]))
    return spec


def _check_regular(path: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise ValueError(
            f"{path!r} is {file_kind(mode)}, not a regular file: "
            "keras_mgpu.data reads the shards and their spec.json as "
            "files. Replace it with the file write_tfrecords wrote."
        )


def _bad_spec(path: str, problem: str) -> ValueError:
    return ValueError(
        f"The feature spec {path!r} is unusable ({problem}). It is written "
        "by keras_mgpu.data.write_tfrecords together with the shards: "
        "rewrite them with it (a copy cut short or a hand edit breaks it), "
        "or restore the spec.json written with them."
    )


def _spec_problem(spec: dict) -> Optional[str]:
    """What makes `spec` unreadable by `_parser`, or `None`."""
    missing = [k for k in ("structure", "features") if k not in spec]
    if missing:
        return f"missing key(s) {missing}"
    structure, features = spec["structure"], spec["features"]
    if _depth_beyond(structure, _MAX_DEPTH, spec_tree=True):
        return f"'structure' is nested more than {_MAX_DEPTH} levels deep"
    try:
        names = _flat_names(structure)
    except ValueError as e:
        return f"'structure' is {structure!r}: {e}"
    if not names:
        return f"'structure' is {structure!r}, which holds no feature"
    if len(set(names)) != len(names):
        return f"'structure' names a feature twice: {names}"
    if names != [f"f{i}" for i in range(len(names))]:
        # write_tfrecords numbers the features in the structure's order, and
        # the records hold them by those names: another order is two fields
        # swapped by hand, which would otherwise read each other's data.
        return (f"'structure' holds the features in the order {names}, "
                "not 'f0', 'f1', ... as write_tfrecords numbers them: two "
                "fields were swapped or renamed, and would read each "
                "other's data")
    if not isinstance(features, dict):
        return f"'features' is {features!r}"
    if sorted(features) != sorted(names):
        return (f"'features' names {sorted(features)}, 'structure' "
                f"{sorted(names)}")
    for n in names:
        feature = features[n]
        try:
            tf.dtypes.as_dtype(feature["dtype"])
            tf.TensorShape(feature["shape"])
        except (TypeError, KeyError, ValueError):
            return f"feature {n!r} is {feature!r}"
    return _files_problem(spec)


def _files_problem(spec: dict) -> Optional[str]:
    """What is wrong with the shard list of `spec`, or `None`."""
    missing = [k for k in ("num_examples", "files") if k not in spec]
    if missing:
        return f"missing key(s) {missing}"
    files, examples = spec["files"], spec["num_examples"]
    if not (isinstance(files, list) and files and all(
            isinstance(f, str) and _is_stem(f) for f in files)
            and len(set(files)) == len(files)):
        return f"'files' is {files!r}, not a list of distinct file names"
    if not is_positive_int(examples):
        return f"'num_examples' is {examples!r}"
    for key in ("examples_per_file", "bytes_per_file"):
        counts = spec.get(key, [])
        if key in spec and not (
                isinstance(counts, list) and len(counts) == len(files)
                and all(is_integer(c) and c >= 0 for c in counts)):
            return (f"{key!r} is {counts!r}, not one count for each of the "
                    f"{len(files)} files")
    if sum(spec.get("examples_per_file", [examples])) != examples:
        return (f"'examples_per_file' adds up to "
                f"{sum(spec['examples_per_file'])}, 'num_examples' is "
                f"{examples}")
    return None


def _round_robin(examples: int, shards: int) -> list:
    """How many of `examples` each of `shards` holds when dealt round-robin."""
    return [examples // shards + (i < examples % shards)
            for i in range(shards)]


def _check_directory(directory) -> str:
    """`directory` as a `str`, without the trailing `/` that joins file names."""
    if not is_nonempty_path(directory) or not isinstance(
            os.fspath(directory), str):
        # An empty directory would put the files at the root ("/data-...").
        raise ValueError(
            f"directory must be a non-empty path (str or os.PathLike), got "
            f"{directory!r}. Use '.' for the current directory."
        )
    return os.fspath(directory).rstrip("/")


def _is_stem(name: str) -> bool:
    """Whether `name` is a plain file name, which stays in its folder."""
    return not (not name or name in (".", "..") or "/" in name
                or "\\" in name or "\0" in name)
