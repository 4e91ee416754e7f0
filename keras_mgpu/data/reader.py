"""`tfrecord_dataset` and `verify_tfrecords`: `write_tfrecords` shards
checked against their `spec.json` and read back, batched for the strategy."""

from __future__ import annotations

import os
from functools import partial
from typing import Callable, Optional

import tensorflow as tf
# Both come with TensorFlow: the error of a message that does not parse,
# and the message `tf.io.serialize_tensor` writes (TensorFlow exports no
# name for it, as it does `tf.train.Example` for a record).
from google.protobuf.message import DecodeError
from tensorflow.core.framework import tensor_pb2

from keras_mgpu import _fs
from keras_mgpu._checks import (
    is_flag,
    is_integer,
    is_nonempty_path,
    is_positive_integer,
)
from keras_mgpu import strategy as strategy_lib
from keras_mgpu.data.spec import SPEC_FILE, _check_regular, read_spec
from keras_mgpu.data.structure import (
    _field,
    _flat_names,
    _leaf_paths,
    _pack,
)


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
            one whose size differs, i.e. cut short or changed), and compare
            each file's first record with it (the features it holds, each
            one's dtype and shape) and parse it now, so a spec that does not
            fit the records (edited, e.g. two features' entries swapped, or
            from another write) fails here, naming the file, each feature,
            what the spec says and what the record holds. `"all"`: also read
            every record, so a corrupt one, or a file holding fewer examples
            than its spec says, fails here, naming the file (and the
            record's index). `"none"`: check nothing up front but the spec
            itself.
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
    >>> from keras_mgpu.data import write_tfrecords
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
    files = sorted(_fs.glob(pattern))
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
        _verify(files, spec, parse, expected, read_all=verify == "all")

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
    its size, and holds as many examples as the spec says; each file's first
    record holds the features the spec names, of its dtypes and shapes;
    every record parses.

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
    >>> from keras_mgpu.data import write_tfrecords
    >>> d = tempfile.mkdtemp()
    >>> _ = write_tfrecords({"x": np.ones((5, 2))}, d, num_shards=2)
    >>> verify_tfrecords(d + "/*.tfrecord")
    5
    """
    pattern = _check_pattern(pattern)
    files = sorted(_fs.glob(pattern))
    if not files:
        raise FileNotFoundError(f"No files match {pattern!r}.")
    spec, expected = _check_files(files)
    return _verify(files, spec, _parser(spec), expected, read_all=True)


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
    folders: dict[str, list[str]] = {}
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
                # Only the files read must have their size (and be regular
                # files: TFRecordDataset would block on a FIFO); the others
                # in the folder must be there.
                size = _fs.size(path, partial(_check_regular, path)
                                if name in names else None)
            except _fs.NOT_FOUND:
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
    # `files` is never empty: its callers refuse a pattern matching none.
    assert first is not None
    return first[0], expected


def _verify(files, spec: dict, parse, expected: dict, read_all: bool) -> int:
    """Compares each file's first record with `spec` and parses it
    (`read_all`: parses every record, and compares the count with
    `expected[path]`, `(examples, spec path)`)."""
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
            if index == 0:
                _check_example(path, record.numpy(), spec, spec_path)
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


def _check_example(path: str, record: bytes, spec: dict,
                   spec_path: str) -> None:
    """Compares a record's own features with `spec`: their names, and the
    dtype and shape of the tensor each holds.

    One record of a file costs little, and names what parsing cannot: an
    op error names neither the feature nor both sides, and features of one
    dtype and shape swapped in the spec would parse without any error.
    """
    try:
        held = tf.train.Example.FromString(record).features.feature
    except DecodeError:
        raise ValueError(
            f"TFRecord file {path!r}: record 0 is not a tf.train.Example, so "
            "the file was not written by keras_mgpu.data.write_tfrecords. "
            "Read it with tf.data.TFRecordDataset, or rewrite it with "
            "write_tfrecords."
        ) from None
    fields = _leaf_paths(spec["structure"])
    problems = [f"{SPEC_FILE} names {_feature(n, fields)}, the record holds "
                "no such feature" for n in fields if n not in held]
    problems += [f"the record holds a feature {n!r} that {SPEC_FILE} does "
                 "not name" for n in sorted(held) if n not in fields]
    for name in fields:
        if name not in held:
            continue
        says = spec["features"][name]
        wanted = (tf.dtypes.as_dtype(says["dtype"]).name,
                  tf.TensorShape(says["shape"]))
        holds = _held_tensor(held[name])
        if isinstance(holds, str):
            problems.append(f"{_feature(name, fields)}: {SPEC_FILE} says "
                            f"{_describe(*wanted)}, the record holds {holds}")
        elif holds[0] != wanted[0] or not wanted[1].is_compatible_with(
                holds[1]):
            problems.append(f"{_feature(name, fields)}: {SPEC_FILE} says "
                            f"{_describe(*wanted)}, the record holds "
                            f"{_describe(*holds)}")
    if problems:
        raise ValueError(
            f"TFRecord file {path!r}: record 0 does not match {SPEC_FILE} "
            f"({spec_path!r}): {'; '.join(problems)}. The spec was edited "
            "(two features' entries swapped, say) or comes from another "
            f"write: restore the {SPEC_FILE} written with these shards, or "
            "rewrite the folder with keras_mgpu.data.write_tfrecords."
        )


def _held_tensor(feature):
    """(dtype name, shape) of the serialized tensor a feature holds, as
    `write_tfrecords` writes each one; else what it holds instead, in words."""
    kind = feature.WhichOneof("kind")
    if kind is None:
        return "an empty feature, not one serialized tensor"
    values = getattr(feature, kind).value
    if kind != "bytes_list" or len(values) != 1:
        return (f"a {kind} of {len(values)} value(s), not one serialized "
                "tensor")
    try:
        proto = tensor_pb2.TensorProto.FromString(values[0])
        dtype = tf.dtypes.as_dtype(proto.dtype).name
    except (DecodeError, TypeError):
        return "bytes that are not a serialized tensor"
    if proto.tensor_shape.unknown_rank:
        return f"a {dtype} tensor of unknown shape"
    return dtype, tf.TensorShape([d.size for d in proto.tensor_shape.dim])


def _feature(name: str, fields: dict) -> str:
    return f"feature {name!r} ({_field(fields[name])})"


def _describe(dtype: str, shape: tf.TensorShape) -> str:
    return f"{dtype} of shape {tuple(shape.as_list())}"


def _bad_record(path: str, index: int, problem: str, error) -> ValueError:
    return ValueError(
        f"TFRecord file {path!r}: record {index} {problem} "
        f"({error.message.splitlines()[0]}). Rewrite the file with "
        "keras_mgpu.data.write_tfrecords."
    )


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
