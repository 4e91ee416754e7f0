"""`write_tfrecords`: examples into sharded TFRecord files and their
`spec.json`."""

from __future__ import annotations

import json
import re
import uuid
import warnings
from typing import Any, Mapping, Sequence, Union

import tensorflow as tf

from keras_mgpu import _fs
from keras_mgpu._checks import is_positive_integer
from keras_mgpu.data.spec import (
    SPEC_FILE,
    SPEC_VERSION,
    _check_directory,
    _is_stem,
    _round_robin,
)
from keras_mgpu.data.structure import (
    _as_array,
    _check_depth,
    _check_spec,
    _field,
    _flat_names,
    _pack,
    _skeleton,
)

# Shard numbers have five digits in the file names, which then sort in order.
_MAX_SHARDS = 99_999


def write_tfrecords(
    data: Union[Mapping[str, Any], Sequence[Any], tf.data.Dataset],
    directory: str,
    *,
    num_shards: int = 8,
    name: str = "data",
) -> list:
    """Writes examples into sharded TFRecord files, with a feature spec beside them.

    Each example holds every array (leaf) of the structure as a serialized
    tensor; `spec.json` records the structure (tuples and dicts nested to
    any depth, dict keys in their order) and each leaf's dtype and
    per-example shape, so `tfrecord_dataset` gives back exactly what was
    written. Examples are dealt to shards round-robin.

    The shards are written under temporary names and renamed, with
    `spec.json` written last, only once every example is written: a write
    that is refused or fails leaves no shards or spec of its own behind.
    `spec.json` also lists the shards with the examples and bytes of each,
    so a reader finds a shard that is missing, cut short or left from an
    earlier write into the folder.

    Args:
        data: A single array, or a structure of equally long arrays
            (numpy arrays or tensors, one example per row): tuples, lists
            and dicts with `str` keys, nested to any depth, such as
            `(x, y)`, `(x, (y1, y2))` or `{"a": x, "b": [y, {"c": z}]}`.
            Or an unbatched `tf.data.Dataset` of such structures, one
            example per element. Lists are read back as tuples (a
            `tf.data` element cannot hold a list), any mapping as a
            `dict`. Leaves are bool, integer, floating, complex or string
            (read back as `tf.string`) and have one shape in every example;
            ragged and sparse tensors are refused. At most 100 levels of
            nesting.
        directory: Where the shards and `spec.json` go (any `tf.io.gfile`
            path, a `str` or `os.PathLike`). Created if missing.
        num_shards: Defaults to 8. Number of files, a positive integer, at
            most the number of examples (no shard is empty) and at most
            99,999; use at least as many as the workers that will read
            them, so each worker reads its own.
        name: Defaults to `"data"`. File name prefix: a plain file-name stem
            (no `/` or `\\`, not `"."` or `".."`), so every shard lands in
            `directory`.

    Returns:
        The shard paths.

    Raises:
        ValueError: Arrays with different numbers of examples (naming each
            leaf's path, e.g. `[1][0]` or `b.c`, and its length), a batched
            dataset (a leaf whose first dimension is unknown), an element
            whose shape differs from the first element's, no examples,
            more shards than examples, or nesting deeper than 100 levels.
        TypeError: Ragged or sparse tensors, namedtuples, non-`str` dict
            keys, or a dtype that cannot be written (e.g. `object`).

    Example:

    >>> import numpy as np, tempfile
    >>> from keras_mgpu.data import read_spec
    >>> d = tempfile.mkdtemp()
    >>> paths = write_tfrecords((np.ones((10, 3)), np.arange(10)), d,
    ...                         num_shards=2)
    >>> [p.rsplit("/", 1)[-1] for p in paths]
    ['data-00000-of-00002.tfrecord', 'data-00001-of-00002.tfrecord']
    >>> _ = write_tfrecords({"x": np.ones((10, 3)),
    ...                      "y": (np.arange(10), np.zeros(10))}, d + "/b")
    >>> read_spec(d + "/b")["structure"]
    {'dict': [['x', 'f0'], ['y', {'tuple': ['f1', 'f2']}]]}
    """
    directory = _check_directory(directory)
    if not is_positive_integer(num_shards):
        raise ValueError(
            f"num_shards must be a positive integer, got {num_shards!r}. "
            "Use at least as many shards as the workers that will read them."
        )
    if num_shards > _MAX_SHARDS:
        raise ValueError(
            f"num_shards must be at most {_MAX_SHARDS:,} (shard numbers have "
            f"five digits in the file names), got {num_shards!r}. A shard "
            "should hold many examples: e.g. aim at 100 MB per shard, and at "
            "least as many shards as the workers that will read them."
        )
    num_shards = int(num_shards)
    _check_stem(name)
    dataset, structure, fields, known = _as_dataset(data)
    if known == 0:
        raise ValueError("write_tfrecords got no examples to write.")
    if known is not None:
        _check_shard_count(num_shards, known)
    paths = [
        f"{directory}/{name}-{i:05d}-of-{num_shards:05d}.tfrecord"
        for i in range(num_shards)
    ]
    spec_path = f"{directory}/{SPEC_FILE}"
    suffix = f".partial-{uuid.uuid4().hex[:12]}"
    partials = [p + suffix for p in paths] + [spec_path + suffix]
    created = not _fs.isdir(directory or "/")
    _fs.makedirs(directory or "/")
    opened: list[str] = []
    renamed: list[str] = []
    try:
        shapes, count = _write_shards(dataset, fields, partials[:-1], opened)
        if count == 0:
            raise ValueError("write_tfrecords got no examples to write.")
        _check_shard_count(num_shards, count)
        spec = {
            "version": SPEC_VERSION,
            "structure": structure,
            "features": {
                n: {"dtype": s.dtype.name, "shape": shape}
                for (n, _, s), shape in zip(fields, shapes)
            },
            "num_examples": count,
            "files": [p.rsplit("/", 1)[-1] for p in paths],
            "examples_per_file": _round_robin(count, num_shards),
            "bytes_per_file": [_fs.size(p) for p in partials[:-1]],
        }
        # The shards are not synced either (TFRecordWriter does not).
        _fs.write_file(partials[-1], json.dumps(spec, indent=1).encode(),
                       sync=False)
        # The old spec goes first: until the new one is in place, the folder
        # has no spec (a clear error) rather than one that fits no shard.
        if _fs.exists(spec_path):
            _fs.remove_file(spec_path)
        for partial, path in zip(partials, paths + [spec_path]):
            _fs.rename(partial, path)
            renamed.append(path)
    except BaseException:
        for path in opened + partials[-1:] + renamed:
            _fs.remove_file_quietly(path)
        try:
            if created and not _fs.listdir(directory):
                _fs.remove_tree(directory)
        except _fs.ERRORS:
            pass
        raise
    _warn_stale_shards(directory, name, paths)
    return paths


def _check_shard_count(num_shards: int, examples: int) -> None:
    if num_shards > examples:
        raise ValueError(
            f"num_shards={num_shards} is more than the {examples} examples "
            f"to write: {num_shards - examples} shard(s) would be empty. Use "
            f"num_shards={examples} or fewer (and at least as many as the "
            "workers that will read them). Nothing was written."
        )


def _warn_stale_shards(directory: str, name: str, paths: list) -> None:
    # Shards of an earlier write with another count keep their names; the
    # new spec.json does not list them, and a reader refuses a pattern
    # matching them. Named now, but not deleted: they are the user's files.
    ours = re.compile(re.escape(name) + r"-\d{5}-of-\d{5}\.tfrecord")
    written = {p.rsplit("/", 1)[-1] for p in paths}
    stale = sorted(n for n in _fs.listdir(directory or "/")
                   if ours.fullmatch(n) and n not in written)
    if stale:
        warnings.warn(
            f"write_tfrecords: {directory!r} still holds {len(stale)} "
            f"shard(s) of an earlier write, not listed in the new {SPEC_FILE} "
            f"({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''}). "
            "tfrecord_dataset refuses a pattern that matches them: delete "
            f"them, or read only the new ones ('{name}-*-of-"
            f"{len(paths):05d}.tfrecord').",
            stacklevel=3,
        )


def _check_stem(name) -> None:
    if not isinstance(name, str):
        raise TypeError(
            f"name must be a str (the shard file-name prefix), got {name!r}."
        )
    if not _is_stem(name):
        # The name is joined to the directory, so "../x" or "a/b" would
        # write outside it, where no spec.json describes the shards.
        raise ValueError(
            f"name must be a plain file-name stem such as 'train', without "
            f"'/', '\\' or NUL and not '', '.' or '..', got {name!r}. "
            "Choose the folder with `directory` instead."
        )


def _write_shards(dataset, fields, paths, opened: list):
    """Writes `dataset` round-robin into `paths`: (first shapes, count).

    A file is created when its first example comes (and appended to
    `opened`), so no more files exist than examples, whatever `paths` holds.
    """
    names = [n for n, _, _ in fields]
    writers: list[Any] = []  # tf.io.TFRecordWriter
    shapes, count = None, 0
    try:
        for element in dataset:
            flat = [leaf for _, leaf in _skeleton(element, "", [])[1]]
            if shapes is None:
                shapes = [t.shape.as_list() for t in flat]
            for (_, path, _), shape, t in zip(fields, shapes, flat):
                if t.shape.as_list() != shape:
                    raise ValueError(
                        f"Element {count}, {_field(path)}: shape "
                        f"{tuple(t.shape.as_list())} differs from element "
                        f"0's {tuple(shape)}. write_tfrecords writes one "
                        "example of one fixed shape per element: unbatch a "
                        "batched dataset first (`dataset.unbatch()`), and "
                        "pad or resize variable-size examples to one shape "
                        "(e.g. in `dataset.map`). Nothing was written."
                    )
            example = tf.train.Example(features=tf.train.Features(feature={
                n: tf.train.Feature(bytes_list=tf.train.BytesList(
                    value=[tf.io.serialize_tensor(t).numpy()]))
                for n, t in zip(names, flat)
            }))
            if len(writers) < len(paths):
                opened.append(paths[len(writers)])
                writers.append(tf.io.TFRecordWriter(opened[-1]))
            writers[count % len(paths)].write(example.SerializeToString())
            count += 1
    finally:
        for writer in writers:
            writer.close()
    return shapes, count


def _as_dataset(data):
    """`data` as a dataset of examples, its JSON structure, its fields and
    its number of examples (`None` if unknown until written).

    The fields are `(feature name, path, tf.TensorSpec)`, in the order of
    `_flat_names(structure)`. Everything that can be refused before writing
    is refused here.
    """
    if not isinstance(data, tf.data.Dataset):
        _check_depth(data, "data")
        structure, leaves = _skeleton(data, "", [])
        arrays = {n: _as_array(path, leaf)
                  for n, (path, leaf) in zip(_flat_names(structure), leaves)}
        if not arrays:
            raise ValueError(
                f"write_tfrecords got no arrays to write in {data!r}.")
        lengths = {path: int(a.shape[0])
                   for (path, _), a in zip(leaves, arrays.values())}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                "All arrays must have the same number of examples (first "
                f"dimension), got lengths {lengths}. Each array of the "
                "structure is one field, holding every example."
            )
        if not any(lengths.values()):
            raise ValueError("write_tfrecords got no examples to write.")
        # Lists become tuples: from_tensor_slices would stack a list.
        data = tf.data.Dataset.from_tensor_slices(_pack(structure, arrays))
    _check_depth(data.element_spec, "The dataset's element_spec")
    structure, specs = _skeleton(data.element_spec, "", [])
    if not specs:
        raise ValueError(
            f"write_tfrecords got a dataset without tensors: its element_spec "
            f"is {data.element_spec!r}.")
    for path, spec in specs:
        _check_spec(path, spec)
    names = _flat_names(structure)
    known = int(data.cardinality())
    if known == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "write_tfrecords got an infinite dataset (e.g. after "
            "`.repeat()`): it would write forever. Pass the finite dataset, "
            "or `.take(n)` of it."
        )
    return (data, structure,
            [(n, p, s) for n, (p, s) in zip(names, specs)],
            None if known < 0 else known)
