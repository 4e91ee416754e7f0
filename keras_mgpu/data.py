"""Input pipelines that keep every replica fed: sharded TFRecords in, batches out."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from keras_mgpu._checks import (
    is_flag,
    is_integer,
    is_nonempty_path,
    is_positive_integer,
)
from keras_mgpu import strategy as strategy_lib

SPEC_FILE = "spec.json"
SPEC_VERSION = 1


def write_tfrecords(
    data: Union[Mapping[str, Any], Sequence[Any], tf.data.Dataset],
    directory: str,
    *,
    num_shards: int = 8,
    name: str = "data",
) -> list:
    """Writes examples into sharded TFRecord files, with a feature spec beside them.

    Each example holds every feature as a serialized tensor; `spec.json`
    records the names, dtypes, per-example shapes and the structure (a tuple
    such as `(x, y)` or a dict), so `tfrecord_dataset` gives back exactly
    what was written. Examples are dealt to shards round-robin.

    Args:
        data: A dict of equally long arrays, a tuple/list of them (e.g.
            `(x, y)`), or an unbatched `tf.data.Dataset` of such structures.
        directory: Where the shards and `spec.json` go (any `tf.io.gfile`
            path, a `str` or `os.PathLike`). Created if missing.
        num_shards: Defaults to 8. Number of files, a positive integer; use
            at least as many as the workers that will read them, so each
            worker reads its own.
        name: Defaults to `"data"`. File name prefix: a plain file-name stem
            (no `/` or `\\`, not `"."` or `".."`), so every shard lands in
            `directory`.

    Returns:
        The shard paths.

    Example:

    >>> import numpy as np, tempfile
    >>> d = tempfile.mkdtemp()
    >>> paths = write_tfrecords((np.ones((10, 3)), np.arange(10)), d,
    ...                         num_shards=2)
    >>> [p.rsplit("/", 1)[-1] for p in paths]
    ['data-00000-of-00002.tfrecord', 'data-00001-of-00002.tfrecord']
    """
    directory = _check_directory(directory)
    if not is_positive_integer(num_shards):
        raise ValueError(
            f"num_shards must be a positive integer, got {num_shards!r}. "
            "Use at least as many shards as the workers that will read them."
        )
    num_shards = int(num_shards)
    _check_stem(name)
    dataset, structure = _as_dataset(data)
    names = _flat_names(structure)
    tf.io.gfile.makedirs(directory or "/")
    paths = [
        f"{directory}/{name}-{i:05d}-of-{num_shards:05d}.tfrecord"
        for i in range(num_shards)
    ]
    writers = [tf.io.TFRecordWriter(p) for p in paths]
    features, count = None, 0
    try:
        for element in dataset:
            flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(element)]
            if features is None:
                features = {
                    n: {"dtype": t.dtype.name, "shape": t.shape.as_list()}
                    for n, t in zip(names, flat)
                }
            example = tf.train.Example(features=tf.train.Features(feature={
                n: tf.train.Feature(bytes_list=tf.train.BytesList(
                    value=[tf.io.serialize_tensor(t).numpy()]))
                for n, t in zip(names, flat)
            }))
            writers[count % num_shards].write(example.SerializeToString())
            count += 1
    finally:
        for writer in writers:
            writer.close()
    if count == 0:
        raise ValueError("write_tfrecords got no examples to write.")
    spec = {
        "version": SPEC_VERSION,
        "structure": structure,
        "features": features,
        "num_examples": count,
        "files": [p.rsplit("/", 1)[-1] for p in paths],
    }
    with tf.io.gfile.GFile(f"{directory}/{SPEC_FILE}", "w") as f:
        f.write(json.dumps(spec, indent=1))
    return paths


def read_spec(directory: str) -> dict:
    """The feature spec `write_tfrecords` saved in `directory`.

    Args:
        directory: The folder of the shards (a `str` or `os.PathLike`).

    Returns:
        The spec: `version`, `structure`, `features`, `num_examples` and
        `files`. A spec that is not valid JSON or lacks what the reader needs
        is a `ValueError` naming the file.
    """
    path = f"{_check_directory(directory)}/{SPEC_FILE}"
    if not tf.io.gfile.exists(path):
        raise FileNotFoundError(
            f"No {SPEC_FILE} in {directory!r}: write the shards with "
            "keras_mgpu.data.write_tfrecords, which saves the spec beside "
            "them."
        )
    with tf.io.gfile.GFile(path, "rb") as f:
        raw = f.read()
    try:
        spec = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise _bad_spec(path, f"not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise _bad_spec(
            path, f"a JSON object expected, got a {type(spec).__name__}"
        )
    if spec.get("version") != SPEC_VERSION:
        raise ValueError(
            f"{path!r} has spec version {spec.get('version')!r}; this "
            f"keras-mgpu reads version {SPEC_VERSION}. Rewrite the shards "
            "with keras_mgpu.data.write_tfrecords, or read them with the "
            "keras-mgpu that wrote them."
        )
    problem = _spec_problem(spec)
    if problem:
        raise _bad_spec(path, problem)
    return spec


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
    keys = structure.get("dict") if isinstance(structure, dict) else None
    if not (isinstance(structure, dict) and len(structure) == 1
            and (isinstance(keys, list)
                 and all(isinstance(k, str) for k in keys)
                 or is_integer(structure.get("tuple"))
                 or "single" in structure)):
        return f"'structure' is {structure!r}"
    if not isinstance(features, dict):
        return f"'features' is {features!r}"
    names = _flat_names(structure)
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
        strategy: Defaults to `None`, the strategy of the current scope.
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
        verify: Defaults to `"first"`: parse each file's first record now,
            so a spec mismatch fails here, naming the file. `"all"`: also
            read every record, so a corrupt one fails here, naming its file
            and index. `"none"`: check nothing up front.
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
        `strategy.experimental_distribute_dataset`).

    Example:

    >>> import numpy as np, tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = write_tfrecords((np.ones((10, 3)), np.arange(10)), d, num_shards=2)
    >>> ds = tfrecord_dataset(d + "/*.tfrecord", per_replica_batch_size=4)
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
    files = sorted(tf.io.gfile.glob(pattern))
    if not files:
        raise FileNotFoundError(
            f"No files match {pattern!r}. Check the path, or write shards "
            "with keras_mgpu.data.write_tfrecords."
        )
    spec = read_spec(_folder(files[0]))
    parse = _parser(spec)
    if verify != "none":
        _verify(files, parse, read_all=verify == "all")

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
    parse = _parser(read_spec(_folder(files[0])))
    return _verify(files, parse, read_all=True)


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
    if (not name or name in (".", "..") or "/" in name or "\\" in name
            or "\0" in name):
        # The name is joined to the directory, so "../x" or "a/b" would
        # write outside it, where no spec.json describes the shards.
        raise ValueError(
            f"name must be a plain file-name stem such as 'train', without "
            f"'/', '\\' or NUL and not '', '.' or '..', got {name!r}. "
            "Choose the folder with `directory` instead."
        )


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


def _verify(files, parse, read_all: bool) -> int:
    count = 0
    for path in files:
        records = iter(tf.data.TFRecordDataset(path))
        index = 0
        while True:
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
            if not read_all:
                break
    return count


def _bad_record(path: str, index: int, problem: str, error) -> ValueError:
    return ValueError(
        f"TFRecord file {path!r}: record {index} {problem} "
        f"({error.message.splitlines()[0]}). Rewrite the file with "
        "keras_mgpu.data.write_tfrecords."
    )


def _parser(spec: dict):
    names = list(spec["features"])
    features = spec["features"]
    structure = spec["structure"]
    description = {n: tf.io.FixedLenFeature([], tf.string) for n in names}

    def parse(record):
        parsed = tf.io.parse_single_example(record, description)
        flat = []
        for n in names:
            tensor = tf.io.parse_tensor(parsed[n], features[n]["dtype"])
            tensor = tf.ensure_shape(tensor, features[n]["shape"])
            flat.append(tensor)
        return _pack(structure, flat)

    return parse


def _as_dataset(data):
    if isinstance(data, tf.data.Dataset):
        element = data.element_spec
        if isinstance(element, Mapping):
            structure = {"dict": sorted(element)}
        elif isinstance(element, (tuple, list)):
            structure = {"tuple": len(element)}
        else:
            structure = {"single": 1}
        return data, structure
    if isinstance(data, Mapping):
        keys = sorted(data)
        arrays = {k: np.asarray(data[k]) for k in keys}
        _check_lengths(arrays)
        return tf.data.Dataset.from_tensor_slices(arrays), {"dict": keys}
    if isinstance(data, (tuple, list)):
        arrays = tuple(np.asarray(a) for a in data)
        _check_lengths(dict(enumerate(arrays)))
        return tf.data.Dataset.from_tensor_slices(arrays), {
            "tuple": len(arrays)
        }
    array = np.asarray(data)
    return tf.data.Dataset.from_tensor_slices(array), {"single": 1}


def _check_lengths(arrays: Mapping) -> None:
    lengths = {k: len(a) for k, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(
            f"All arrays must have the same number of examples, got lengths "
            f"{lengths}."
        )


def _flat_names(structure: dict) -> list:
    if "dict" in structure:
        return list(structure["dict"])
    if "tuple" in structure:
        return [f"f{i}" for i in range(structure["tuple"])]
    return ["f0"]


def _pack(structure: dict, flat: list):
    if "dict" in structure:
        return dict(zip(structure["dict"], flat))
    if "tuple" in structure:
        return tuple(flat)
    return flat[0]
