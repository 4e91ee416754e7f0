"""Input pipelines that keep every replica fed: sharded TFRecords in, batches out."""

from __future__ import annotations

import json
import os
import re
import stat
import uuid
import warnings
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from keras_mgpu._checks import (
    file_kind,
    is_flag,
    is_integer,
    is_nonempty_path,
    is_positive_int,
    is_positive_integer,
    is_url,
)
from keras_mgpu import strategy as strategy_lib

SPEC_FILE = "spec.json"
SPEC_VERSION = 2  # 2: nested structures (a tree of tuples and dicts)
# Shard numbers have five digits in the file names, which then sort in order.
_MAX_SHARDS = 99_999
# Tuples, lists and dicts nested deeper are refused: walking them (and
# decoding spec.json) recurses once per level.
_MAX_DEPTH = 100
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


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
    created = not tf.io.gfile.isdir(directory or "/")
    tf.io.gfile.makedirs(directory or "/")
    opened, renamed = [], []
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
            "bytes_per_file": [
                tf.io.gfile.stat(p).length for p in partials[:-1]],
        }
        with tf.io.gfile.GFile(partials[-1], "w") as f:
            f.write(json.dumps(spec, indent=1))
        # The old spec goes first: until the new one is in place, the folder
        # has no spec (a clear error) rather than one that fits no shard.
        if tf.io.gfile.exists(spec_path):
            tf.io.gfile.remove(spec_path)
        for partial, path in zip(partials, paths + [spec_path]):
            tf.io.gfile.rename(partial, path, overwrite=True)
            renamed.append(path)
    except BaseException:
        for path in opened + partials[-1:] + renamed:
            try:
                if tf.io.gfile.exists(path):
                    tf.io.gfile.remove(path)
            except tf.errors.OpError:
                pass
        try:
            if created and not tf.io.gfile.listdir(directory):
                tf.io.gfile.rmtree(directory)
        except tf.errors.OpError:
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


def _round_robin(examples: int, shards: int) -> list:
    """How many of `examples` each of `shards` holds when dealt round-robin."""
    return [examples // shards + (i < examples % shards)
            for i in range(shards)]


def _warn_stale_shards(directory: str, name: str, paths: list) -> None:
    # Shards of an earlier write with another count keep their names; the
    # new spec.json does not list them, and a reader refuses a pattern
    # matching them. Named now, but not deleted: they are the user's files.
    ours = re.compile(re.escape(name) + r"-\d{5}-of-\d{5}\.tfrecord")
    written = {p.rsplit("/", 1)[-1] for p in paths}
    stale = sorted(n for n in tf.io.gfile.listdir(directory or "/")
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


def read_spec(directory: str) -> dict:
    """The feature spec `write_tfrecords` saved in `directory`.

    Args:
        directory: The folder of the shards (a `str` or `os.PathLike`).

    Returns:
        The spec: `version` (2), `structure`, `features`, `num_examples`,
        `files`, `examples_per_file` and, if recorded, `bytes_per_file`.
        `structure` is the nesting written, as JSON: a feature name
        (`"f0"`, a leaf), `{"tuple": [...]}` or `{"dict": [[key, ...],
        ...]}` (keys in order). `features` maps each feature name to its
        `dtype` and per-example `shape`. `files` names the shards, and
        `examples_per_file` and `bytes_per_file` give each one's examples
        and size (a spec written before they were recorded gets the
        examples from the round-robin dealing, and no sizes). A spec that is
        not a regular file, not valid JSON, lacks what the reader needs, or
        has another version (version 1, written before nested structures,
        included) is a `ValueError` naming the file.
    """
    path = f"{_check_directory(directory)}/{SPEC_FILE}"
    if not tf.io.gfile.exists(path):
        raise FileNotFoundError(
            f"No {SPEC_FILE} in {directory!r}: write the shards with "
            "keras_mgpu.data.write_tfrecords, which saves the spec beside "
            "them."
        )
    raw = _read_regular_file(path)
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
    version = spec.get("version")
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


def _read_regular_file(path: str) -> bytes:
    """The bytes of `path`; a `ValueError` naming it if it is not a regular
    file. Never blocks on a FIFO (reading one waits for a writer)."""
    if is_url(path):
        with tf.io.gfile.GFile(path, "rb") as f:
            return f.read()
    _check_regular(path, os.stat(path).st_mode)
    with os.fdopen(os.open(path, os.O_RDONLY | _NONBLOCK), "rb") as f:
        _check_regular(path, os.fstat(f.fileno()).st_mode)  # replaced since?
        return f.read()


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
        "rewrite them with it (a copy cut short or a hand edit breaks it)."
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


def tfrecord_dataset(
    pattern: str,
    *,
    per_replica_batch_size: int,
    strategy: Optional[tf.distribute.Strategy] = None,
    shuffle: bool = False,
    seed: Optional[int] = None,
    shuffle_buffer: int = 10_000,
    cache: bool = False,
    repeat: bool = False,
    drop_remainder: Optional[bool] = None,
    verify: str = "first",
    num_parallel_calls: int = tf.data.AUTOTUNE,
    map_fn: Optional[Callable] = None,
) -> tf.data.Dataset:
    """Reads `write_tfrecords` shards back, batched to the global batch size.

    The pipeline interleaves the shards in parallel, parses (and applies
    `map_fn`) in parallel, optionally caches and shuffles, batches to `per_replica_batch_size` times
    the strategy's replica count, and prefetches. With a seed (or without
    shuffling) the order is deterministic: the same seed gives the same
    batches in every run, a requirement for exact resume.

    Under several workers, sharding is by file when there are at least as
    many files as workers (each worker reads only its files), else by data;
    and the last partial batch is dropped by default, so every worker takes
    the same number of steps.

    Args:
        pattern: Glob of the shard files, e.g. `"data/train-*.tfrecord"`.
        per_replica_batch_size: Samples per replica per step, a positive
            integer.
        strategy: Defaults to `None`, the strategy of the current scope;
            outside every scope, `None` raises `ValueError` (pass the
            strategy, or `tf.distribute.get_strategy()` for one device).
            Anything but a `tf.distribute.Strategy` or `None` is a
            `TypeError`.
        shuffle: Defaults to `False`. Shuffle the files and the examples,
            differently each epoch (deterministically, given `seed`).
        seed: Defaults to `None`. Integer seed for the shuffles.
        shuffle_buffer: Defaults to 10,000 examples (a positive integer).
        cache: Defaults to `False`. Cache the parsed examples in memory
            after the first epoch.
        repeat: Defaults to `False`. Repeat forever (then give `fit` a
            `steps_per_epoch`).
        drop_remainder: Defaults to `None`: `True` with several workers,
            else `False`. `shuffle`, `cache`, `repeat` and `drop_remainder`
            take `True` or `False` only.
        verify: Defaults to `"first"`: compare the files with the
            `spec.json` of their folder (a file it does not list, e.g. left
            from an earlier write with more shards; a listed one missing;
            one whose size differs, i.e. cut short or changed) and parse
            each file's first record now, so a spec mismatch fails here,
            naming the file. `"all"`: also read every record, so a corrupt
            one, or a file holding fewer examples than its spec says, fails
            here, naming the file (and the record's index). `"none"`: check
            nothing up front.
        num_parallel_calls: Defaults to `tf.data.AUTOTUNE`. Parallelism
            of reading, parsing and `map_fn`: a positive integer or
            `tf.data.AUTOTUNE`.
        map_fn: Defaults to `None`. A per-example function applied to the
            parsed example (its arguments are the structure written, e.g.
            `(x, y)`) before the cache: decoding, resizing. With
            `cache=True` it runs in the first epoch only; apply random
            augmentation to the returned dataset instead.

    Returns:
        A `tf.data.Dataset` of batches, ready for `fit` (or for
        `strategy.experimental_distribute_dataset`). On one worker, without
        `repeat`, and checked against the spec (`verify` other than
        `"none"`), its length (`cardinality()`) is the number of batches,
        so `fit` knows the epoch's length from the start.

    Example:

    >>> import numpy as np, tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = write_tfrecords((np.ones((10, 3)), np.arange(10)), d, num_shards=2)
    >>> ds = tfrecord_dataset(d + "/*.tfrecord", per_replica_batch_size=4,
    ...                       strategy=tf.distribute.get_strategy())
    >>> [tuple(x.shape) for x, y in ds]
    [(4, 3), (4, 3), (2, 3)]
    """
    pattern = _check_pattern(pattern)
    if not is_positive_integer(per_replica_batch_size):
        raise ValueError(
            "per_replica_batch_size must be a positive integer, got "
            f"{per_replica_batch_size!r}."
        )
    per_replica_batch_size = int(per_replica_batch_size)
    flags = {"shuffle": shuffle, "cache": cache, "repeat": repeat}
    if drop_remainder is not None:
        flags["drop_remainder"] = drop_remainder
    for flag, value in flags.items():
        if not is_flag(value):
            raise TypeError(
                f"{flag} must be True or False, got {value!r} (a non-empty "
                "string such as 'false' would count as True)."
            )
    if seed is not None and not is_integer(seed):
        raise ValueError(
            f"seed must be an integer or None, got {seed!r}."
        )
    if not is_positive_integer(shuffle_buffer):
        raise ValueError(
            f"shuffle_buffer must be a positive number of examples, got "
            f"{shuffle_buffer!r}."
        )
    if not (is_positive_integer(num_parallel_calls)
            or (is_integer(num_parallel_calls)
                and num_parallel_calls == tf.data.AUTOTUNE)):
        raise ValueError(
            f"num_parallel_calls must be a positive integer or "
            f"tf.data.AUTOTUNE, got {num_parallel_calls!r}."
        )
    if verify not in ("first", "all", "none"):
        raise ValueError(
            f"verify must be 'first', 'all' or 'none', got {verify!r}."
        )
    if map_fn is not None and not callable(map_fn):
        raise TypeError(
            f"map_fn must be a function of one parsed example, got {map_fn!r}."
        )
    strategy = strategy_lib.require_strategy(
        strategy,
        f"tfrecord_dataset(per_replica_batch_size={per_replica_batch_size})",
    )
    files = sorted(tf.io.gfile.glob(pattern))
    if not files:
        raise FileNotFoundError(
            f"No files match {pattern!r}. Check the path, or write shards "
            "with keras_mgpu.data.write_tfrecords."
        )
    expected = None
    if verify == "none":
        parse = _parser(read_spec(_folder(files[0])))
    else:
        spec, expected = _check_files(files)
        parse = _parser(spec)
        _verify(files, parse, expected, read_all=verify == "all")

    workers = strategy_lib.num_workers() if strategy_lib.is_multi_worker(
        strategy
    ) else 1
    if drop_remainder is None:
        drop_remainder = workers > 1
    global_batch = strategy_lib.global_batch_size(
        per_replica_batch_size, strategy
    )
    dataset = tf.data.Dataset.from_tensor_slices(files)
    if shuffle:
        dataset = dataset.shuffle(len(files), seed=seed)
    dataset = dataset.interleave(
        tf.data.TFRecordDataset,
        cycle_length=min(len(files), 16),
        num_parallel_calls=num_parallel_calls,
        deterministic=True,
    )
    dataset = dataset.map(parse, num_parallel_calls=num_parallel_calls,
                          deterministic=True)
    if map_fn is not None:
        dataset = dataset.map(map_fn, num_parallel_calls=num_parallel_calls,
                              deterministic=True)
    if cache:
        dataset = dataset.cache()
    if shuffle:
        dataset = dataset.shuffle(shuffle_buffer, seed=seed)
    if repeat:
        dataset = dataset.repeat()
    dataset = dataset.batch(global_batch, drop_remainder=drop_remainder)
    if expected is not None and not repeat and workers == 1:
        # The checked spec gives the length; without it, fit learns it only
        # when the first epoch runs out, and Keras warns "Your input ran out
        # of data". Several workers each read a share set when the dataset
        # is distributed, so there it stays unknown.
        examples = sum(count for count, _ in expected.values())
        batches = (examples // global_batch if drop_remainder
                   else -(-examples // global_batch))
        dataset = dataset.apply(
            tf.data.experimental.assert_cardinality(batches))
    dataset = dataset.prefetch(tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.FILE
        if len(files) >= workers
        else tf.data.experimental.AutoShardPolicy.DATA
    )
    return dataset.with_options(options)


def verify_tfrecords(pattern: str) -> int:
    """Reads and parses every record; returns the count, or names the bad one.

    Checks what `tfrecord_dataset(..., verify="all")` checks: every file is
    one its folder's `spec.json` lists, every file it lists is there, with
    its size, and holds as many examples as the spec says; every record
    parses.

    Args:
        pattern: Glob of the shard files, e.g. `"data/train-*.tfrecord"`.

    Returns:
        The number of examples in the files that match.

    Raises:
        ValueError: Naming the file at fault (and the record, if one is
            corrupt or does not match the spec).
        FileNotFoundError: No file matches, or a folder has no `spec.json`.

    Example:

    >>> import numpy as np, tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = write_tfrecords({"x": np.ones((5, 2))}, d, num_shards=2)
    >>> verify_tfrecords(d + "/*.tfrecord")
    5
    """
    pattern = _check_pattern(pattern)
    files = sorted(tf.io.gfile.glob(pattern))
    if not files:
        raise FileNotFoundError(f"No files match {pattern!r}.")
    spec, expected = _check_files(files)
    return _verify(files, _parser(spec), expected, read_all=True)


class UnknownLengthWarning(UserWarning):
    """A dataset's number of batches is unknown, so Keras takes an extra step."""


# Per dataset object, so a tuner's trials (same dataset, every trial) read
# the first batch or count the samples once.
_FIRST_BATCH = weakref.WeakKeyDictionary()
_SAMPLES = weakref.WeakKeyDictionary()
_WARNED_UNKNOWN = weakref.WeakSet()


def batch_size_of(dataset: tf.data.Dataset) -> int:
    """The batch size of a batched `tf.data.Dataset`, static or not.

    Read from the element spec when the batch dimension is static
    (`drop_remainder=True`); otherwise from the first batch, which is read
    once per dataset object (running the pipeline for one batch).

    Args:
        dataset: A batched dataset (its elements' first dimension is the
            batch).

    Returns:
        The number of samples in a (full) batch.

    Example:

    >>> ds = tf.data.Dataset.range(10).batch(4)   # last batch: 2
    >>> batch_size_of(ds)
    4
    """
    _check_dataset("batch_size_of", dataset)
    static = _static_batch(dataset)
    if static is not None:
        return static
    if dataset not in _FIRST_BATCH:
        first = next(iter(dataset.take(1)), None)
        if first is None:
            raise ValueError(
                "batch_size_of: the dataset is empty, so it has no batch "
                "size. Check the pipeline (a filter or take(0) can empty it)."
            )
        _FIRST_BATCH[dataset] = int(_batch_length(first))
    return _FIRST_BATCH[dataset]


def rebatch(dataset: tf.data.Dataset, batch_size: int) -> tf.data.Dataset:
    """Re-batches a batched dataset to `batch_size`, keeping every sample
    and a known length.

    `tf.data.Dataset.rebatch` keeps the samples, but its result has an
    unknown number of batches, and on such a dataset Keras 3's `fit` takes
    one extra, empty optimizer step at the end of every epoch (Adam moves on
    a zero gradient, schedules run ahead). This asserts the number of batches
    the re-batched dataset has, `ceil(samples / batch_size)`, so `fit` takes
    exactly that many steps. The sample count is the batch count times the
    static batch size, or, when the batch size is not static (a partial last
    batch), counted once per dataset object (one pass over its batches).
    An infinite dataset stays infinite. A dataset whose own length is
    unknown (after `filter`, or `tfrecord_dataset`) stays unknown, with an
    `UnknownLengthWarning` once per dataset: assert its length with
    `dataset.apply(tf.data.experimental.assert_cardinality(n))` first.

    Args:
        dataset: A batched dataset.
        batch_size: The new batch size, a positive integer (the last batch
            holds the remainder).

    Returns:
        The re-batched dataset.

    Example:

    >>> ds = tf.data.Dataset.range(64).batch(5)
    >>> again = rebatch(ds, 16)
    >>> int(again.cardinality()), [int(b.shape[0]) for b in again]
    (4, [16, 16, 16, 16])
    """
    _check_dataset("rebatch", dataset)
    if not is_positive_integer(batch_size):
        raise ValueError(
            f"rebatch: batch_size must be a positive integer, got "
            f"{batch_size!r}."
        )
    batch_size = int(batch_size)
    batches = int(dataset.cardinality())
    rebatched = dataset.rebatch(batch_size)
    if batches == tf.data.INFINITE_CARDINALITY:
        length = batches
    elif batches == tf.data.UNKNOWN_CARDINALITY:
        if dataset not in _WARNED_UNKNOWN:
            _WARNED_UNKNOWN.add(dataset)
            warnings.warn(
                "rebatch: the dataset's number of batches is unknown, so the "
                "re-batched one's is too, and Keras 3's fit takes one extra, "
                "empty optimizer step per epoch on it. If you know the "
                "number of batches n, apply "
                "tf.data.experimental.assert_cardinality(n) to the dataset "
                "first.",
                UnknownLengthWarning,
                stacklevel=2,
            )
        return rebatched
    else:
        length = -(-_sample_count(dataset, batches) // batch_size)
    return rebatched.apply(tf.data.experimental.assert_cardinality(length))


def _sample_count(dataset, batches: int) -> int:
    static = _static_batch(dataset)
    if static is not None:
        return batches * static
    if dataset not in _SAMPLES:
        _SAMPLES[dataset] = int(dataset.reduce(
            np.int64(0), lambda count, batch: count + _batch_length(batch)))
    return _SAMPLES[dataset]


def _static_batch(dataset) -> Optional[int]:
    shape = tf.nest.flatten(dataset.element_spec)[0].shape
    return shape[0] if shape.rank else None


def _batch_length(batch):
    first = tf.nest.flatten(batch)[0]
    return tf.shape(first, out_type=tf.int64)[0]


def _check_dataset(name: str, dataset) -> None:
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            f"{name} needs a batched tf.data.Dataset, got "
            f"{type(dataset).__name__}."
        )
    if not tf.nest.flatten(dataset.element_spec)[0].shape.rank:
        raise ValueError(
            f"{name} needs a batched dataset, but its elements are scalars "
            f"({dataset.element_spec}). Batch it first: dataset.batch(n)."
        )


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


def _is_stem(name: str) -> bool:
    """Whether `name` is a plain file name, which stays in its folder."""
    return not (not name or name in (".", "..") or "/" in name
                or "\\" in name or "\0" in name)


def _check_pattern(pattern) -> str:
    if not is_nonempty_path(pattern) or not isinstance(
            os.fspath(pattern), str):
        raise ValueError(
            f"pattern must be a non-empty glob of shard files (str or "
            f"os.PathLike), e.g. 'data/train-*.tfrecord', got {pattern!r}."
        )
    return os.fspath(pattern)


def _folder(path: str) -> str:
    # A pattern without a folder ("*.tfrecord") matches in the current one.
    return os.path.dirname(path) or "."


def _check_files(files: list):
    """Checks `files` against the `spec.json` of their folders.

    Returns the first folder's spec (every folder's must describe the same
    examples) and each file's expected number of examples. Raises a
    `ValueError` naming the file at fault: one the spec does not list, a
    listed one that is missing, one of another size than recorded, or
    anything but a regular file (which the reader would block on).
    """
    folders = {}
    for path in files:
        folders.setdefault(_folder(path), []).append(path)
    first, expected = None, {}
    for folder, paths in folders.items():
        spec = read_spec(folder)
        spec_path = f"{folder.rstrip('/')}/{SPEC_FILE}"
        if first is None:
            first = spec, spec_path
        elif [spec[k] for k in ("structure", "features")] != [
                first[0][k] for k in ("structure", "features")]:
            raise ValueError(
                f"The shards of {spec_path!r} hold other examples than those "
                f"of {first[1]!r} (another structure, dtype or shape): one "
                "dataset reads shards of one kind. Read each folder with its "
                "own pattern."
            )
        listed = dict(zip(spec["files"], spec["examples_per_file"]))
        sizes = dict(zip(spec["files"], spec.get("bytes_per_file", [])))
        names = {path.rsplit("/", 1)[-1]: path for path in paths}
        unlisted = sorted(n for n in names if n not in listed)
        if unlisted:
            more = (f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1
                    else "")
            raise ValueError(
                f"{names[unlisted[0]]!r}{more} matches the pattern, but "
                f"{spec_path!r} does not list it: "
                f"it holds {len(listed)} files, {spec['files'][0]!r} to "
                f"{spec['files'][-1]!r}. It is left from an earlier "
                "write_tfrecords into this folder (e.g. with more shards), or "
                "is not one of its shards: reading it would mix in examples "
                "the spec does not count. Delete it, or use a pattern that "
                "matches only the listed files."
            )
        for name in spec["files"]:
            path = names.get(name, f"{folder}/{name}")
            try:
                # Only the files read must have their size; the others in
                # the folder must be there.
                size = _file_size(path) if name in names else (
                    tf.io.gfile.stat(path).length)
            except (FileNotFoundError, tf.errors.NotFoundError):
                raise ValueError(
                    f"Shard {path!r}, one of the {len(listed)} files "
                    f"{spec_path!r} lists, is missing (deleted, or not "
                    f"copied): the {listed[name]} examples it held would be "
                    "silently left out. Restore it, or rewrite the folder "
                    "with keras_mgpu.data.write_tfrecords."
                ) from None
            if name in names and name in sizes and size != sizes[name]:
                raise ValueError(
                    f"Shard {path!r} has {size} bytes, {spec_path!r} says "
                    f"{sizes[name]}: it was cut short or changed after it "
                    "was written (e.g. by a copy that was interrupted). "
                    "Restore it, or rewrite the folder with "
                    "keras_mgpu.data.write_tfrecords."
                )
            if name in names:
                expected[path] = listed[name], spec_path
    return first[0], expected


def _file_size(path: str) -> int:
    if is_url(path):
        return tf.io.gfile.stat(path).length
    info = os.stat(path)
    _check_regular(path, info.st_mode)  # TFRecordDataset would block on a FIFO
    return info.st_size


def _verify(files, parse, expected: dict, read_all: bool) -> int:
    """Parses each file's first record (`read_all`: every record, and
    compares the count with `expected[path]`, `(examples, spec path)`)."""
    count = 0
    for path in files:
        records = iter(tf.data.TFRecordDataset(path))
        want, spec_path = expected[path]
        index = 0
        while read_all or index == 0:
            try:
                record = next(records)
            except StopIteration:
                break
            except tf.errors.DataLossError as e:
                raise _bad_record(path, index, "is corrupt", e) from None
            try:
                parse(record)
            except tf.errors.InvalidArgumentError as e:
                raise _bad_record(
                    path, index, f"does not match {SPEC_FILE}", e
                ) from None
            count += 1
            index += 1
        if index != want and (read_all or index == 0):
            raise ValueError(
                f"Shard {path!r} holds {index} examples, {spec_path!r} says "
                f"{want}: it was cut short (at a record boundary, e.g. by a "
                "copy that was interrupted) or replaced. Restore it, or "
                "rewrite the folder with keras_mgpu.data.write_tfrecords."
            )
    return count


def _bad_record(path: str, index: int, problem: str, error) -> ValueError:
    return ValueError(
        f"TFRecord file {path!r}: record {index} {problem} "
        f"({error.message.splitlines()[0]}). Rewrite the file with "
        "keras_mgpu.data.write_tfrecords."
    )


def _write_shards(dataset, fields, paths, opened: list):
    """Writes `dataset` round-robin into `paths`: (first shapes, count).

    A file is created when its first example comes (and appended to
    `opened`), so no more files exist than examples, whatever `paths` holds.
    """
    names = [n for n, _, _ in fields]
    writers = []
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


def _parser(spec: dict):
    features, structure = spec["features"], spec["structure"]
    names = _flat_names(structure)
    description = {n: tf.io.FixedLenFeature([], tf.string) for n in names}

    # Plain Python: AutoGraph would convert the recursive `_pack` level by
    # level, and overflow the stack on a deep structure.
    @tf.autograph.experimental.do_not_convert
    def parse(record):
        parsed = tf.io.parse_single_example(record, description)
        return _pack(structure, {
            n: tf.ensure_shape(
                tf.io.parse_tensor(parsed[n], features[n]["dtype"]),
                features[n]["shape"])
            for n in names
        })

    return parse


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


def _check_depth(data, what: str) -> None:
    if _depth_beyond(data, _MAX_DEPTH):
        raise ValueError(
            f"write_tfrecords: {what} is nested more than {_MAX_DEPTH} levels "
            "deep (tuples, lists and dicts inside one another, or a "
            "structure that contains itself). spec.json records the "
            "structure, and reading it back walks every level: flatten it, "
            "e.g. into a dict of arrays."
        )


def _depth_beyond(node, limit: int, spec_tree: bool = False) -> bool:
    """Whether tuples, lists and mappings nest in `node` deeper than `limit`
    (`spec_tree`: the `{"tuple": [...]}` and `{"dict": [[key, value], ...]}`
    nodes of a spec's structure; what is malformed counts as a leaf, for
    `_flat_names` to name). Walks without recursing."""
    stack = [(node, 0)]
    while stack:
        node, depth = stack.pop()
        if spec_tree:
            children = _spec_children(node)
        elif isinstance(node, Mapping):
            children = list(node.values())
        elif isinstance(node, (tuple, list)):
            children = node
        else:
            children = None
        if children is None:
            continue
        if depth >= limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _skeleton(node, path: str, leaves: list):
    """The JSON structure of `node`, and its `(path, leaf)`s appended to `leaves`.

    Leaves are named `f0`, `f1`, ... in order: dict items in their order,
    then tuple and list items. Lists are recorded as tuples.
    """
    if isinstance(node, Mapping):
        pairs = []
        for key, value in node.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"Dict keys must be str, got {key!r} in {_field(path)}. "
                    "spec.json stores keys as JSON strings."
                )
            pairs.append([key, _skeleton(value, _key_path(path, key),
                                         leaves)[0]])
        return {"dict": pairs}, leaves
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        raise TypeError(
            f"{_field(path, first=True)} is a namedtuple "
            f"({type(node).__name__}): write_tfrecords reads back tuples "
            "and dicts only. Convert it, e.g. `value._asdict()` (or "
            "`tuple(value)`), in `dataset.map` for a dataset."
        )
    if isinstance(node, (tuple, list)):
        return {"tuple": [_skeleton(v, f"{path}[{i}]", leaves)[0]
                          for i, v in enumerate(node)]}, leaves
    leaves.append((path, node))
    return f"f{len(leaves) - 1}", leaves


def _key_path(path: str, key: str) -> str:
    if key.isidentifier():
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


def _field(path: str, first: bool = False) -> str:
    """`path` in a message (`first`: at the start of a sentence)."""
    what = f"field {path}" if path else "the element"
    return what[0].upper() + what[1:] if first else what


def _as_array(path: str, leaf):
    if isinstance(leaf, (tf.RaggedTensor, tf.SparseTensor)):
        _check_spec(path, tf.type_spec_from_value(leaf))
    array = leaf if isinstance(leaf, (tf.Tensor, np.ndarray)) else (
        np.asarray(leaf))
    if isinstance(array, np.ndarray) and array.dtype.kind in "OV":
        raise TypeError(
            f"{_field(path, first=True)} is an array of dtype "
            f"{array.dtype}: write_tfrecords writes bool, integer, floating, "
            "complex and string arrays of one shape per example. Convert it "
            "(e.g. `np.asarray(x, dtype='float32')`), padding rows of "
            "different lengths to one."
        )
    if len(array.shape) == 0:
        raise ValueError(
            f"{_field(path, first=True)} is a scalar ({leaf!r}): every array "
            "needs a first dimension, one row per example. To write a tuple "
            "or list of numbers as one array, pass `np.asarray(...)`."
        )
    return array


def _check_spec(path: str, spec) -> None:
    what = _field(path, first=True)
    if isinstance(spec, (tf.RaggedTensorSpec, tf.SparseTensorSpec)):
        kind = ("ragged" if isinstance(spec, tf.RaggedTensorSpec)
                else "sparse")
        fix = ("`x.to_tensor()`" if kind == "ragged"
               else "`tf.sparse.to_dense(x)`")
        raise TypeError(
            f"{what} is a {kind} tensor ({spec}): write_tfrecords writes "
            f"dense tensors of one shape per example. Convert it with {fix} "
            "(padding to one shape), e.g. in `dataset.map`."
        )
    if not isinstance(spec, tf.TensorSpec):
        raise TypeError(
            f"{what} is {spec!r}: write_tfrecords writes tensors nested in "
            "tuples, lists and dicts."
        )
    dtype = spec.dtype
    if dtype.is_quantized or not (
            dtype.is_bool or dtype.is_integer or dtype.is_floating
            or dtype.is_complex or dtype == tf.string):
        raise TypeError(
            f"{what} has dtype {dtype.name}: write_tfrecords writes bool, "
            "integer, floating, complex and string tensors."
        )
    if spec.shape.rank and spec.shape[0] is None:
        raise ValueError(
            f"{what} has shape {tuple(spec.shape.as_list())} in the "
            "dataset's element_spec: an unknown first dimension is what "
            "`dataset.batch()` gives, and write_tfrecords writes one example "
            "per element. Pass `dataset.unbatch()`; if each element really "
            "is one example of one fixed shape, declare it (`tf.ensure_shape` "
            "in `dataset.map`, or the `output_signature` of `from_generator`)."
        )


def _flat_names(structure) -> list:
    """The feature names in `structure`, in order; `ValueError` if malformed."""
    if isinstance(structure, str):
        return [structure]
    if isinstance(structure, dict) and len(structure) == 1:
        items = structure.get("tuple")
        if isinstance(items, list):
            return [n for item in items for n in _flat_names(item)]
        pairs = structure.get("dict")
        if isinstance(pairs, list) and all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                for p in pairs) and len({p[0] for p in pairs}) == len(pairs):
            return [n for _, value in pairs for n in _flat_names(value)]
    raise ValueError(
        f"{structure!r} is not a feature name, {{'tuple': [...]}} or "
        "{'dict': [[key, ...], ...]} with distinct keys")


def _spec_children(node) -> Optional[list]:
    """The items of a spec's tuple or dict node; None for anything else."""
    if not isinstance(node, dict) or len(node) != 1:
        return None
    if isinstance(node.get("tuple"), list):
        return node["tuple"]
    pairs = node.get("dict")
    if isinstance(pairs, list) and all(
            isinstance(p, list) and len(p) == 2 for p in pairs):
        return [value for _, value in pairs]
    return None


def _pack(structure, values: Mapping):
    """The nested value of `structure`, its leaves taken from `values` by name."""
    if isinstance(structure, str):
        return values[structure]
    if "tuple" in structure:
        return tuple(_pack(item, values) for item in structure["tuple"])
    return {key: _pack(value, values) for key, value in structure["dict"]}
