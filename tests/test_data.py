"""keras_mgpu.data: sharded TFRecords written, verified and read back."""

import collections
import json
import os
import queue
import re
import threading
import warnings

import numpy as np
import pytest
import tensorflow as tf

from keras_mgpu import data
from tests.conftest import mirrored

# Outside every scope tfrecord_dataset needs its strategy named.
ONE_DEVICE = tf.distribute.get_strategy()


def arrays(n=50):
    rng = np.random.RandomState(0)
    return (rng.randn(n, 3, 2).astype("float32"),
            rng.randint(0, 10, n).astype("int64"))


def collect(dataset):
    xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in dataset])
    return np.concatenate(xs), np.concatenate(ys)


def test_round_trip_keeps_values_dtypes_and_order(tmp_path):
    x, y = arrays()
    paths = data.write_tfrecords((x, y), str(tmp_path), num_shards=1)
    assert len(paths) == 1
    ds = data.tfrecord_dataset(str(tmp_path / "*.tfrecord"),
                               per_replica_batch_size=8, strategy=ONE_DEVICE)
    got_x, got_y = collect(ds)
    np.testing.assert_array_equal(got_x, x)
    np.testing.assert_array_equal(got_y, y)
    spec = data.read_spec(str(tmp_path))
    assert spec["num_examples"] == 50
    assert spec["features"]["f0"] == {"dtype": "float32", "shape": [3, 2]}


def test_dict_and_dataset_inputs(tmp_path):
    x, y = arrays(12)
    data.write_tfrecords({"image": x, "label": y}, str(tmp_path / "a"),
                         num_shards=3)
    batch = next(iter(data.tfrecord_dataset(
        str(tmp_path / "a" / "*.tfrecord"), per_replica_batch_size=12,
            strategy=ONE_DEVICE)))
    assert set(batch) == {"image", "label"}
    assert sorted(batch["label"].numpy()) == sorted(y)
    source = tf.data.Dataset.from_tensor_slices((x, y))
    data.write_tfrecords(source, str(tmp_path / "b"), num_shards=2)
    got = collect(data.tfrecord_dataset(str(tmp_path / "b" / "*.tfrecord"),
                                        per_replica_batch_size=4,
                                        strategy=ONE_DEVICE))
    assert sorted(got[1]) == sorted(y)


def test_global_batch_follows_the_strategy(tmp_path):
    data.write_tfrecords(arrays(40), str(tmp_path), num_shards=4)
    ds = data.tfrecord_dataset(str(tmp_path / "*.tfrecord"),
                               per_replica_batch_size=5, strategy=mirrored(4))
    assert [int(x.shape[0]) for x, _ in ds] == [20, 20]
    with mirrored(4).scope():
        ds = data.tfrecord_dataset(str(tmp_path / "*.tfrecord"),
                                   per_replica_batch_size=5)
    assert [int(x.shape[0]) for x, _ in ds] == [20, 20]
    # Outside a scope the default strategy's 1 replica would give 5.
    with pytest.raises(ValueError, match=r"tfrecord_dataset\(per_replica_"
                       r"batch_size=5\) was called outside a strategy scope"):
        data.tfrecord_dataset(str(tmp_path / "*.tfrecord"),
                              per_replica_batch_size=5)


def test_seeded_shuffle_is_deterministic(tmp_path):
    data.write_tfrecords(arrays(64), str(tmp_path), num_shards=4)
    pattern = str(tmp_path / "*.tfrecord")

    def epochs(seed, n=2):
        ds = data.tfrecord_dataset(pattern, per_replica_batch_size=8,
                                   shuffle=True, seed=seed, shuffle_buffer=64,
                                   strategy=ONE_DEVICE)
        return [collect(ds)[1] for _ in range(n)]

    first, second = epochs(1), epochs(1)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[0], first[1]), "reshuffled each epoch"
    assert not np.array_equal(first[0], epochs(2)[0])
    assert sorted(first[0]) == sorted(arrays(64)[1])


def test_cache_and_remainder(tmp_path):
    data.write_tfrecords(arrays(10), str(tmp_path), num_shards=2)
    pattern = str(tmp_path / "*.tfrecord")
    ds = data.tfrecord_dataset(pattern, per_replica_batch_size=4, cache=True,
                               drop_remainder=True, strategy=ONE_DEVICE)
    assert [int(x.shape[0]) for x, _ in ds] == [4, 4]
    assert [int(x.shape[0]) for x, _ in ds] == [4, 4]


def test_map_fn_runs_per_example_before_the_cache(tmp_path):
    x, y = arrays(10)
    data.write_tfrecords((x, y), str(tmp_path), num_shards=2)
    calls = []

    def decode(image, label):
        # Counts its runs: once per example with the cache, not per epoch.
        image = tf.numpy_function(lambda a: (calls.append(1), 2 * a)[1],
                                  [image], tf.float32)
        return tf.ensure_shape(image, (3, 2)), label

    ds = data.tfrecord_dataset(str(tmp_path / "*.tfrecord"),
                               per_replica_batch_size=4, cache=True,
                               map_fn=decode, strategy=ONE_DEVICE)
    for _ in range(3):
        got_x, got_y = collect(ds)
        np.testing.assert_array_equal(got_x, 2 * x)
        np.testing.assert_array_equal(got_y, y)
    assert len(calls) == 10
    with pytest.raises(TypeError, match="map_fn must be a function.*got 3"):
        data.tfrecord_dataset(str(tmp_path / "*.tfrecord"),
                              per_replica_batch_size=4, map_fn=3,
                              strategy=ONE_DEVICE)


def test_no_files_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="No files match .*nothing"):
        data.tfrecord_dataset(str(tmp_path / "nothing-*.tfrecord"),
                              per_replica_batch_size=2, strategy=ONE_DEVICE)


def test_corrupt_record_is_named_with_file_and_index(tmp_path):
    paths = data.write_tfrecords(arrays(20), str(tmp_path), num_shards=2)
    raw = bytearray(open(paths[1], "rb").read())
    record = len(raw) // 10
    raw[int(3.5 * record)] ^= 0xFF  # inside record 3 of 10
    open(paths[1], "wb").write(bytes(raw))
    pattern = str(tmp_path / "*.tfrecord")
    with pytest.raises(ValueError) as info:
        data.tfrecord_dataset(pattern, per_replica_batch_size=2, verify="all",
                              strategy=ONE_DEVICE)
    message = str(info.value)
    assert "data-00001-of-00002.tfrecord" in message
    assert "record 3 is corrupt" in message
    with pytest.raises(ValueError, match="record 3 is corrupt"):
        data.verify_tfrecords(pattern)
    assert data.verify_tfrecords(
        str(tmp_path / "data-00000-of-00002.tfrecord")) == 10


def test_spec_mismatch_is_named(tmp_path):
    data.write_tfrecords(arrays(8), str(tmp_path), num_shards=2)
    spec_path = tmp_path / "spec.json"
    spec = json.loads(spec_path.read_text())
    spec["features"]["f0"]["dtype"] = "int32"
    spec_path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="record 0 does not match spec.json"):
        data.tfrecord_dataset(str(tmp_path / "*.tfrecord"),
                              per_replica_batch_size=2, strategy=ONE_DEVICE)


def test_missing_spec_and_bad_arguments(tmp_path):
    (tmp_path / "x.tfrecord").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="No spec.json"):
        data.tfrecord_dataset(str(tmp_path / "*.tfrecord"),
                              per_replica_batch_size=2, strategy=ONE_DEVICE)
    with pytest.raises(ValueError, match="got 0"):
        data.tfrecord_dataset("x", per_replica_batch_size=0,
                              strategy=ONE_DEVICE)
    with pytest.raises(ValueError, match="verify must be"):
        data.tfrecord_dataset("x", per_replica_batch_size=1, verify="some",
                              strategy=ONE_DEVICE)
    with pytest.raises(ValueError, match="num_shards"):
        data.write_tfrecords(arrays(4), str(tmp_path), num_shards=0)
    with pytest.raises(ValueError, match="same number of examples"):
        data.write_tfrecords((np.ones(3), np.ones(4)), str(tmp_path / "b"))


@pytest.mark.parametrize("num_shards, policy", [(4, "FILE"), (1, "DATA")])
def test_multi_worker_sharding(run_workers, tmp_path, num_shards, policy):
    data.write_tfrecords(arrays(40), str(tmp_path), num_shards=num_shards)
    results = run_workers("tests.data_workers:read_sharded", 2,
                          kwargs={"pattern": str(tmp_path / "*.tfrecord")})
    for r in results:
        assert r.result["policy"] == policy
        # Equal step counts on every worker: no worker waits for a batch.
        assert r.result["steps"] == results[0].result["steps"]
    seen = sorted(results[0].result["labels"] + results[1].result["labels"])
    assert len(seen) == results[0].result["steps"] * 2 * 4
    assert set(seen) <= set(arrays(40)[1].tolist())


@pytest.mark.parametrize("name", ["../escape", "sub/data", "a\\b", "", ".",
                                  "..", "da\0ta"])
def test_name_must_be_a_plain_file_stem(tmp_path, name):
    target = tmp_path / "out"
    with pytest.raises(ValueError, match="name must be a plain file-name stem") \
            as info:
        data.write_tfrecords(arrays(4), str(target), num_shards=1, name=name)
    assert f"got {name!r}." in str(info.value)
    assert "directory" in str(info.value)
    # Refused before anything is written, inside the folder or beside it.
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kwargs, match", [
    ({"num_shards": 2.0}, "num_shards must be a positive integer, got 2.0"),
    ({"num_shards": True}, "num_shards must be a positive integer, got True"),
    ({"name": 3}, "name must be a str .*got 3"),
    ({"directory": ""}, "directory must be a non-empty path.*got ''"),
])
def test_write_tfrecords_refuses_bad_arguments(tmp_path, kwargs, match):
    kwargs = {"directory": str(tmp_path / "out"), **kwargs}
    with pytest.raises((TypeError, ValueError), match=match):
        data.write_tfrecords(arrays(4), **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_numpy_shard_count_path_directory_and_bare_pattern(tmp_path,
                                                          monkeypatch):
    paths = data.write_tfrecords(arrays(6), tmp_path, num_shards=np.int64(2))
    assert [p.rsplit("/", 1)[-1] for p in paths] == [
        "data-00000-of-00002.tfrecord", "data-00001-of-00002.tfrecord"]
    # A pattern without a folder used to look for "/spec.json".
    monkeypatch.chdir(tmp_path)
    assert data.verify_tfrecords("*.tfrecord") == 6
    ds = data.tfrecord_dataset("*.tfrecord", per_replica_batch_size=6,
                               strategy=ONE_DEVICE)
    assert sorted(next(iter(ds))[1].numpy()) == sorted(arrays(6)[1])


@pytest.mark.parametrize("content, cause", [
    ("cut", "not valid JSON: "),
    ('{"version": 2, "structure": {"tuple": ["f0", "f1"]}, '
     '"num_examples": 4}', r"missing key\(s\) \['features'\]"),
    ("[1]", "a JSON object expected, got a list"),
    ('{"version": 2, "structure": {"tuple": ["f0", "f1"]}, '
     '"features": {"f0": {}}}', "'features' names"),
    # Version 1's structure, under version 2.
    ('{"version": 2, "structure": {"tuple": 2}, "features": {}}',
     "'structure' is {'tuple': 2}: .* is not a feature name"),
    ('{"version": 2, "structure": {"dict": [["a", "f0"], ["a", "f1"]]}, '
     '"features": {}}', "with distinct keys"),
    ('{"version": 2, "structure": {"tuple": ["f0", "f0"]}, '
     '"features": {"f0": {}}}', "'structure' names a feature twice"),
])
def test_corrupt_spec_names_the_file_and_the_cause(tmp_path, content, cause):
    data.write_tfrecords(arrays(4), str(tmp_path), num_shards=1)
    spec_path = tmp_path / "spec.json"
    if content == "cut":
        content = spec_path.read_text()[:40]
    spec_path.write_text(content)
    readers = [
        lambda: data.read_spec(str(tmp_path)),
        lambda: data.tfrecord_dataset(str(tmp_path / "*.tfrecord"),
                                      per_replica_batch_size=2,
                                      strategy=ONE_DEVICE),
        lambda: data.verify_tfrecords(str(tmp_path / "*.tfrecord")),
    ]
    for read in readers:
        with pytest.raises(ValueError, match=cause) as info:
            read()
        message = str(info.value)
        assert repr(str(spec_path)) in message
        assert "rewrite them with it" in message
        assert "keras_mgpu.data.write_tfrecords" in message


@pytest.mark.parametrize("kwargs, error, match", [
    ({"pattern": ""}, ValueError, "pattern must be a non-empty glob.*got ''"),
    ({"per_replica_batch_size": 2.5}, ValueError,
     "per_replica_batch_size must be a positive integer, got 2.5"),
    ({"shuffle": "no"}, TypeError, "shuffle must be True or False, got 'no'"),
    ({"cache": 1}, TypeError, "cache must be True or False, got 1"),
    ({"repeat": None}, TypeError, "repeat must be True or False, got None"),
    ({"drop_remainder": "yes"}, TypeError,
     "drop_remainder must be True or False, got 'yes'"),
    ({"seed": 1.5}, ValueError, "seed must be an integer or None, got 1.5"),
    ({"seed": True}, ValueError, "seed must be an integer or None, got True"),
    ({"shuffle_buffer": 0}, ValueError,
     "shuffle_buffer must be a positive number of examples, got 0"),
    ({"num_parallel_calls": 0}, ValueError,
     r"num_parallel_calls must be a positive integer or tf\.data\.AUTOTUNE, "
     "got 0"),
])
def test_tfrecord_dataset_refuses_bad_arguments(kwargs, error, match):
    # Checked before the glob: no shards needed.
    kwargs = {"pattern": "no-such-dir/*.tfrecord", "per_replica_batch_size": 2,
              **kwargs}
    with pytest.raises(error, match=match):
        data.tfrecord_dataset(**kwargs, strategy=ONE_DEVICE)


# Nested structures (#16). N examples, several shards: the shards are read
# round-robin, so the order read back is the order written.
N = 10


def leaves(n=N):
    rng = np.random.RandomState(1)
    return {
        "x": rng.randn(n, 3, 2).astype("float32"),
        "y": rng.randint(0, 10, n).astype("int64"),
        "h": rng.randn(n, 2).astype("float16"),
        "b": rng.rand(n) > 0.5,
        "c": (rng.randn(n, 2) + 1j * rng.randn(n, 2)).astype("complex64"),
        "s": np.array([b"s%d" % i * i for i in range(n)]),
        "u": rng.randint(0, 255, (n, 4)).astype("uint8"),
    }


L = leaves()
NESTINGS = {
    "single_array": L["x"],
    "tuple": (L["x"], L["y"]),
    "tuple_in_tuple": (L["x"], (L["y"], L["h"])),
    "dict_in_given_order": {"z": L["x"], "a": L["y"], "m": L["b"]},
    "dict_of_list_of_dict": {"a": L["x"], "b": [L["y"], {"c": L["h"]}]},
    "list_of_dicts_deep": [L["u"], {"q": (L["c"], [L["s"]]),
                                    "p": {"deep": {"er": L["b"]}}}],
    "odd_keys_and_empty_tuple": {"a.b": L["x"], "a": {"b": L["y"]},
                                 "0": (L["s"], ())},
}


def expected(structure):
    """What comes back: lists as tuples (a tf.data element holds no list)."""
    if isinstance(structure, dict):
        return {k: expected(v) for k, v in structure.items()}
    if isinstance(structure, (tuple, list)):
        return tuple(expected(v) for v in structure)
    return structure


def sliced(structure, index):
    if isinstance(structure, dict):
        return {k: sliced(v, index) for k, v in structure.items()}
    if isinstance(structure, tuple):
        return tuple(sliced(v, index) for v in structure)
    return structure[index]


def assert_same(got, want, path=""):
    """Same container types, keys in the same order, dtypes and values."""
    if isinstance(want, (dict, tuple)):
        assert type(got) is type(want), (path, type(got), type(want))
    else:
        assert isinstance(got, tf.Tensor), (path, type(got))
    if isinstance(want, dict):
        assert list(got) == list(want), path
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, tuple):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    elif want.dtype.kind == "S":
        assert got.dtype == tf.string, path
        assert got.numpy().tolist() == want.tolist(), path
    else:
        assert got.dtype.as_numpy_dtype == want.dtype, (path, got.dtype)
        np.testing.assert_array_equal(got.numpy(), want, err_msg=path)


@pytest.mark.parametrize("source", ["numpy", "dataset"])
@pytest.mark.parametrize("nesting", list(NESTINGS))
def test_any_nesting_round_trips_exactly(tmp_path, nesting, source):
    structure = NESTINGS[nesting]
    want = expected(structure)
    data_in = (structure if source == "numpy"
               else tf.data.Dataset.from_tensor_slices(want))
    paths = data.write_tfrecords(data_in, tmp_path, num_shards=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [p.rsplit("/", 1)[-1] for p in paths] + ["spec.json"])
    spec = data.read_spec(tmp_path)
    assert spec["version"] == 2 and spec["num_examples"] == N
    ds = data.tfrecord_dataset(str(tmp_path / "*.tfrecord"),
                               per_replica_batch_size=4, strategy=ONE_DEVICE)
    batches = list(ds)
    assert [len(tf.nest.flatten(b)[0]) for b in batches] == [4, 4, 2]
    for i, batch in enumerate(batches):
        assert_same(batch, sliced(want, slice(4 * i, 4 * i + 4)))
    assert data.verify_tfrecords(str(tmp_path / "*.tfrecord")) == N


def test_structure_and_features_in_the_spec(tmp_path):
    x, y = arrays(4)
    data.write_tfrecords({"b": x, "a": [y, {"c": y}]}, tmp_path, num_shards=2)
    spec = data.read_spec(tmp_path)
    assert spec["structure"] == {"dict": [
        ["b", "f0"], ["a", {"tuple": ["f1", {"dict": [["c", "f2"]]}]}]]}
    assert spec["features"] == {
        "f0": {"dtype": "float32", "shape": [3, 2]},
        "f1": {"dtype": "int64", "shape": []},
        "f2": {"dtype": "int64", "shape": []},
    }


def test_a_version_1_spec_is_refused_clearly(tmp_path):
    data.write_tfrecords(arrays(4), tmp_path, num_shards=1)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps({
        "version": 1, "structure": {"tuple": 2}, "num_examples": 4,
        "features": {"f0": {"dtype": "float32", "shape": [3, 2]},
                     "f1": {"dtype": "int64", "shape": []}}}))
    with pytest.raises(ValueError) as info:
        data.tfrecord_dataset(str(tmp_path / "*.tfrecord"),
                              per_replica_batch_size=2, strategy=ONE_DEVICE)
    message = str(info.value)
    assert repr(str(spec_path)) in message
    assert "spec version 1 (an older keras-mgpu); this keras-mgpu reads " \
        "version 2" in message
    assert "Rewrite the shards with keras_mgpu.data.write_tfrecords" in message


def assert_nothing_left(tmp_path, target):
    """A refused write leaves no folder (it made it) and no partial file."""
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("structure, lengths", [
    ((L["x"], (L["y"], L["h"][:2])), "{'[0]': 10, '[1][0]': 10, '[1][1]': 2}"),
    ({"a": L["x"], "b": [L["y"], {"c": L["y"][:3]}]},
     "{'a': 10, 'b[0]': 10, 'b[1].c': 3}"),
], ids=["tuple_in_tuple", "dict_of_list_of_dict"])
def test_leaves_of_different_lengths_are_named(tmp_path, structure, lengths):
    target = tmp_path / "out"
    with pytest.raises(ValueError) as info:
        data.write_tfrecords(structure, target)
    assert "same number of examples" in str(info.value)
    assert f"got lengths {lengths}." in str(info.value)
    assert_nothing_left(tmp_path, target)


def test_batched_dataset_is_refused(tmp_path):
    x, y = arrays(10)
    target = tmp_path / "out"
    batched = tf.data.Dataset.from_tensor_slices({"x": x, "y": y}).batch(4)
    with pytest.raises(ValueError) as info:
        data.write_tfrecords(batched, target, num_shards=2)
    message = str(info.value)
    assert "Field x has shape (None, 3, 2)" in message
    assert "`dataset.batch()`" in message and "`dataset.unbatch()`" in message
    assert_nothing_left(tmp_path, target)
    # As the message says: unbatched, it is written.
    data.write_tfrecords(batched.unbatch(), target, num_shards=2)
    assert data.read_spec(target)["num_examples"] == 10


def variable_shapes(n=7, odd=5):
    """Elements (x, {"v": v}) where v of element `odd` has another shape."""
    def gen():
        for i in range(n):
            yield (np.full(2, i, "float32"),
                   {"v": np.full((2, 3 if i == odd else 1), i, "int32")})
    return tf.data.Dataset.from_generator(gen, output_signature=(
        tf.TensorSpec([2], tf.float32),
        {"v": tf.TensorSpec([2, None], tf.int32)}))


def test_variable_shape_dataset_is_refused_and_cleaned_up(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(ValueError) as info:
        data.write_tfrecords(variable_shapes(), target, num_shards=3)
    message = str(info.value)
    assert ("Element 5, field [1].v: shape (2, 3) differs from element 0's "
            "(2, 1).") in message
    assert "`dataset.unbatch()`" in message and "pad or resize" in message
    # Five examples were in the shards when it was refused: all removed.
    assert_nothing_left(tmp_path, target)


def test_refused_write_keeps_the_previous_one(tmp_path):
    x, y = arrays(6)
    data.write_tfrecords((x, y), tmp_path, num_shards=3)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match="differs from element 0's"):
        data.write_tfrecords(variable_shapes(), tmp_path, num_shards=3)
    with pytest.raises(ValueError, match="differs from element 0's"):
        data.write_tfrecords(variable_shapes(), tmp_path, num_shards=2,
                             name="other")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    got_x, got_y = collect(data.tfrecord_dataset(
        str(tmp_path / "*.tfrecord"), per_replica_batch_size=6,
            strategy=ONE_DEVICE))
    np.testing.assert_array_equal(got_x, x)
    np.testing.assert_array_equal(got_y, y)


def test_empty_dataset_is_refused_and_cleaned_up(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(ValueError, match="no examples to write"):
        data.write_tfrecords(tf.data.Dataset.range(0), target, num_shards=2)
    assert_nothing_left(tmp_path, target)
    with pytest.raises(ValueError, match="no examples to write"):
        data.write_tfrecords((np.ones((0, 2)), np.ones(0)), target)
    assert_nothing_left(tmp_path, target)


Point = collections.namedtuple("Point", "x y")


@pytest.mark.parametrize("make, error, match", [
    (lambda: {"a": L["x"], "r": tf.ragged.constant([[1]] * 9 + [[1, 2]])},
     TypeError, r"Field r is a ragged tensor .*`x\.to_tensor\(\)`"),
    (lambda: tf.data.Dataset.from_tensor_slices(
        (L["y"], tf.ragged.constant([[1]] * 9 + [[1, 2]]))),
     TypeError, r"Field \[1\] is a ragged tensor"),
    (lambda: tf.data.Dataset.from_tensor_slices(
        {"sp": tf.sparse.from_dense(np.eye(3))}),
     TypeError, r"Field sp is a sparse tensor .*tf\.sparse\.to_dense"),
    (lambda: (L["x"], {"o": np.array([1, "a", None] * 3 + [2], object)}),
     TypeError, r"Field \[1\]\.o is an array of dtype object"),
    (lambda: (L["x"], 3), ValueError,
     r"Field \[1\] is a scalar \(3\): every array needs a first dimension"),
    (lambda: {"p": Point(L["x"], L["y"])}, TypeError,
     r"Field p is a namedtuple \(Point\)"),
    (lambda: {1: L["x"]}, TypeError, "Dict keys must be str, got 1"),
    (lambda: [L["x"], {"Img": {"O": np.array([None] * 10)}}], TypeError,
     r"Field \[1\]\.Img\.O is an array of dtype object"),
    (lambda: tf.data.Dataset.from_generator(
        lambda: iter([np.ones(2)]),
        output_signature=tf.TensorSpec([None], tf.float64)),
     ValueError, r"The element has shape \(None,\).*unknown first dimension"),
], ids=["ragged_leaf", "ragged_dataset", "sparse_dataset", "object_dtype",
        "scalar_leaf", "namedtuple", "int_key", "case_kept_in_path",
        "unknown_first_dim"])
def test_unwritable_inputs_are_refused_before_writing(tmp_path, make, error,
                                                      match):
    target = tmp_path / "out"
    with pytest.raises(error, match=match):
        data.write_tfrecords(make(), target)
    assert_nothing_left(tmp_path, target)


# --- shards that come back short, and what cannot be read (#31) -------------

# 20 examples in 4 shards of 5: every record has the same size.
SHARDS = 4


def shard(tmp_path, i):
    return tmp_path / f"data-{i:05d}-of-{SHARDS:05d}.tfrecord"


def drop_recorded_counts(tmp_path):
    """Makes spec.json one written before per-file counts were recorded."""
    spec_path = tmp_path / "spec.json"
    spec = json.loads(spec_path.read_text())
    for key in ("examples_per_file", "bytes_per_file"):
        spec.pop(key, None)
    spec_path.write_text(json.dumps(spec))


def damage(tmp_path, how):
    path = shard(tmp_path, 1)
    if how == "emptied":
        path.write_bytes(b"")
    elif how == "deleted":
        path.unlink()
    elif how == "cut_at_a_record":  # 2 of its 5 records kept
        path.write_bytes(path.read_bytes()[:2 * path.stat().st_size // 5])
    elif how == "rewritten_with_fewer_shards":
        with pytest.warns(UserWarning, match=r"still holds 4 shard\(s\) of "
                          r"an earlier write.*'data-\*-of-00002\.tfrecord'"):
            data.write_tfrecords(arrays(10), tmp_path, num_shards=2)


@pytest.mark.parametrize("how, old_spec, message", [
    ("emptied", False, "-00001-of-00004.tfrecord' has 0 bytes, '.*spec.json' "
     "says [0-9]+: it was cut short"),
    ("emptied", True, "-00001-of-00004.tfrecord' holds 0 examples, "
     "'.*spec.json' says 5: it was cut short"),
    ("deleted", False, "-00001-of-00004.tfrecord', one of the 4 files "
     "'.*spec.json' lists, is missing .*the 5 examples it held"),
    ("cut_at_a_record", False, "-00001-of-00004.tfrecord' has [0-9]+ bytes, "
     "'.*spec.json' says [0-9]+"),
    ("cut_at_a_record", True, "-00001-of-00004.tfrecord' holds 2 examples, "
     "'.*spec.json' says 5"),
    ("rewritten_with_fewer_shards", False, "data-00000-of-00004.tfrecord' "
     r"\(and 3 more\) matches the pattern, but '.*spec.json' does not list "
     "it: it holds 2 files, 'data-00000-of-00002.tfrecord' to "
     "'data-00001-of-00002.tfrecord'. It is left from an earlier"),
], ids=["emptied", "emptied_old_spec", "deleted", "cut_at_a_record",
        "cut_at_a_record_old_spec", "rewritten_with_fewer_shards"])
def test_a_short_or_stale_shard_is_named(tmp_path, how, old_spec, message):
    data.write_tfrecords(arrays(20), tmp_path, num_shards=SHARDS)
    if old_spec:
        drop_recorded_counts(tmp_path)
    damage(tmp_path, how)
    pattern = str(tmp_path / "*.tfrecord")
    readers = {
        "verify=all": lambda: data.tfrecord_dataset(
            pattern, per_replica_batch_size=4, verify="all",
            strategy=ONE_DEVICE),
        "verify_tfrecords": lambda: data.verify_tfrecords(pattern),
    }
    # Without recorded sizes, a shard cut at a record still parses.
    if how != "cut_at_a_record" or not old_spec:
        readers["verify=first"] = lambda: data.tfrecord_dataset(
            pattern, per_replica_batch_size=4, strategy=ONE_DEVICE)
    for name, read in readers.items():
        with pytest.raises(ValueError, match=message) as info:
            read()
        assert "Restore it, or rewrite the folder" in str(info.value) or (
            "Delete it, or use a pattern" in str(info.value)), name


def test_intact_shards_read_with_old_and_new_specs(tmp_path):
    data.write_tfrecords(arrays(7), tmp_path, num_shards=3)
    spec = data.read_spec(tmp_path)
    assert spec["examples_per_file"] == [3, 2, 2]
    assert spec["bytes_per_file"] == [
        p.stat().st_size for p in sorted(tmp_path.glob("*.tfrecord"))]
    pattern = str(tmp_path / "*.tfrecord")
    for old in (False, True):
        if old:
            drop_recorded_counts(tmp_path)
            assert data.read_spec(tmp_path)["examples_per_file"] == [3, 2, 2]
            assert "bytes_per_file" not in data.read_spec(tmp_path)
        assert data.verify_tfrecords(pattern) == 7
        got = collect(data.tfrecord_dataset(
            pattern, per_replica_batch_size=7, verify="all",
            strategy=ONE_DEVICE))
        np.testing.assert_array_equal(got[1], arrays(7)[1])
        # A subset of the shards reads, the others being intact.
        assert data.verify_tfrecords(str(tmp_path / "data-0000[02]-*")) == 5


def test_shards_of_several_folders_are_checked_each_against_its_spec(
        tmp_path):
    x, y = arrays(9)
    data.write_tfrecords((x[:4], y[:4]), tmp_path / "a", num_shards=2)
    data.write_tfrecords((x[4:], y[4:]), tmp_path / "b", num_shards=3)
    pattern = str(tmp_path / "*" / "*.tfrecord")
    assert data.verify_tfrecords(pattern) == 9
    (tmp_path / "b" / "data-00002-of-00003.tfrecord").write_bytes(b"")
    with pytest.raises(ValueError, match=r"b/data-00002-of-00003\.tfrecord' "
                       r"has 0 bytes, '.*b/spec\.json' says"):
        data.verify_tfrecords(pattern)
    data.write_tfrecords({"x": x[4:]}, tmp_path / "b", num_shards=3)
    with pytest.raises(ValueError, match=r"The shards of '.*b/spec\.json' "
                       r"hold other examples than those of '.*a/spec\.json'"):
        data.tfrecord_dataset(pattern, per_replica_batch_size=2,
                              strategy=ONE_DEVICE)


def nested(value, depth):
    for _ in range(depth):
        value = (value,)
    return value


def deep_spec(depth):
    structure = '"f0"'
    for _ in range(depth):
        structure = '{"tuple": [' + structure + ']}'
    return ('{"version": 2, "structure": %s, "num_examples": 4, "files": '
            '["data-00000-of-00001.tfrecord"], "features": {"f0": '
            '{"dtype": "float32", "shape": [3, 2]}}}' % structure)


@pytest.mark.parametrize("spec, cause", [
    (deep_spec(5000), "nested too deep to decode"),
    (deep_spec(150), "'structure' is nested more than 100 levels deep"),
    ('{"version": 2, "structure": {"tuple": []}, "features": {}, '
     '"num_examples": 4, "files": ["data-00000-of-00001.tfrecord"]}',
     r"'structure' is \{'tuple': \[\]\}, which holds no feature"),
    ("fifo", "is a named pipe \\(FIFO\\), not a regular file"),
], ids=["nested_5000_deep", "nested_150_deep", "empty", "fifo"])
def test_an_unreadable_spec_is_named_without_blocking(tmp_path, spec, cause):
    data.write_tfrecords(arrays(4), tmp_path, num_shards=1)
    spec_path = tmp_path / "spec.json"
    spec_path.unlink()
    if spec == "fifo":
        os.mkfifo(spec_path)  # reading it would wait for a writer
    else:
        spec_path.write_text(spec)
    outcome = queue.Queue()

    def read():
        try:
            data.tfrecord_dataset(str(tmp_path / "*.tfrecord"),
                                  per_replica_batch_size=2,
                                  strategy=ONE_DEVICE)
            outcome.put(None)
        except BaseException as e:
            outcome.put(e)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():
        os.close(os.open(spec_path, os.O_WRONLY | os.O_NONBLOCK))  # unblocks
        pytest.fail(f"reading {spec_path} blocked")
    error = outcome.get_nowait()
    assert isinstance(error, ValueError), repr(error)
    assert re.search(cause, str(error)), str(error)
    assert repr(str(spec_path)) in str(error)


def unknown_length(n):
    return tf.data.Dataset.from_tensor_slices(arrays(n)).filter(
        lambda x, y: True)


@pytest.mark.parametrize("source, kwargs, error, match", [
    (lambda: nested(arrays(4)[0], 5000), {}, ValueError,
     "data is nested more than 100 levels deep"),
    (lambda: unknown_length(3).map(lambda x, y: nested(x, 101)), {},
     ValueError, "element_spec is nested more than 100 levels deep"),
    (lambda: arrays(4), {"num_shards": 10**9}, ValueError,
     "num_shards must be at most 99,999 .*got 1000000000"),
    (lambda: arrays(4), {"num_shards": 5}, ValueError,
     r"num_shards=5 is more than the 4 examples to write: 1 shard\(s\) "
     "would be empty. Use num_shards=4 or fewer"),
    (lambda: unknown_length(3), {"num_shards": 5}, ValueError,
     "num_shards=5 is more than the 3 examples"),
    (lambda: tf.data.Dataset.from_tensor_slices(arrays(3)).repeat(), {},
     ValueError, "got an infinite dataset"),
], ids=["nested_5000_deep", "dataset_nested_101_deep", "num_shards_1e9",
        "more_shards_than_examples", "more_shards_than_unknown_examples",
        "infinite_dataset"])
def test_unwritable_structures_and_shard_counts_are_refused(
        tmp_path, source, kwargs, error, match):
    target = tmp_path / "out"
    with pytest.raises(error, match=match):
        data.write_tfrecords(source(), target, **kwargs)
    assert_nothing_left(tmp_path, target)


def test_nesting_100_deep_round_trips(tmp_path):
    x = arrays(4)[0]
    data.write_tfrecords(nested(x, 100), tmp_path, num_shards=2)
    got = next(iter(data.tfrecord_dataset(
        str(tmp_path / "*.tfrecord"), per_replica_batch_size=4,
        strategy=ONE_DEVICE)))
    for _ in range(100):
        assert isinstance(got, tuple) and len(got) == 1
        got = got[0]
    np.testing.assert_array_equal(got.numpy(), x)


def test_a_strategy_that_is_not_one_is_a_type_error(tmp_path):
    data.write_tfrecords(arrays(4), tmp_path, num_shards=1)
    with pytest.raises(TypeError, match=r"tfrecord_dataset\(per_replica_"
                       r"batch_size=2\): strategy must be a tf\.distribute\."
                       r"Strategy or None, got 'mirrored'\. Pass the "
                       "strategy object"):
        data.tfrecord_dataset(str(tmp_path / "*.tfrecord"),
                              per_replica_batch_size=2, strategy="mirrored")


# --- re-batching a batched dataset ------------------------------------------------


def _ids(samples, batch, drop_remainder=False):
    return tf.data.Dataset.range(samples).batch(batch,
                                                drop_remainder=drop_remainder)


@pytest.mark.parametrize("samples,batch,new,drop_remainder", [
    (64, 5, 8, False),    # last batch 4, so counted: 8 batches of 8
    (60, 8, 8, False),    # same size, last batch 4: 8 batches, last 4
    (61, 7, 16, False),   # 4 batches, last 13
    (64, 16, 5, True),    # static batch: 13 batches, last 4, not counted
    (3, 2, 4, False),     # fewer samples than one new batch
])
def test_rebatch_keeps_every_sample_and_a_known_length(samples, batch, new,
                                                      drop_remainder):
    source = _ids(samples, batch, drop_remainder)
    kept = [int(i) for b in source for i in b]
    again = data.rebatch(source, new)
    sizes = [int(b.shape[0]) for b in again]
    assert int(again.cardinality()) == len(sizes) == -(-len(kept) // new)
    assert sizes[:-1] == [new] * (len(sizes) - 1) and 0 < sizes[-1] <= new
    assert [int(i) for b in again for i in b] == kept
    # Every epoch alike (the count is taken once, not consumed).
    assert [int(i) for b in again for i in b] == kept


def test_rebatch_of_an_infinite_dataset_stays_infinite():
    again = data.rebatch(_ids(10, 3).repeat(), 4)
    assert int(again.cardinality()) == tf.data.INFINITE_CARDINALITY
    assert [int(b.shape[0]) for b in again.take(3)] == [4, 4, 4]


def test_rebatch_of_unknown_length_warns_once_per_dataset():
    source = _ids(20, 5).filter(lambda b: True)
    with pytest.warns(data.UnknownLengthWarning,
                      match=r"extra, empty optimizer step.*assert_cardinality"):
        again = data.rebatch(source, 8)
    assert int(again.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    assert [int(b.shape[0]) for b in again] == [8, 8, 4]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data.rebatch(source, 4)
    # With the length asserted first, it is kept.
    known = source.apply(tf.data.experimental.assert_cardinality(4))
    assert int(data.rebatch(known, 8).cardinality()) == 3


def test_batch_size_of_static_and_read_from_the_first_batch():
    assert data.batch_size_of(_ids(64, 16, drop_remainder=True)) == 16
    ragged_end = _ids(61, 16).prefetch(2)
    assert ragged_end.element_spec.shape[0] is None
    assert data.batch_size_of(ragged_end) == 16
    pairs = tf.data.Dataset.from_tensor_slices(
        ({"a": np.zeros((9, 2))}, np.zeros(9))).batch(4)
    assert data.batch_size_of(pairs) == 4


@pytest.mark.parametrize("call,dataset,error,match", [
    ("batch_size_of", [1, 2], TypeError, "batched tf.data.Dataset, got list"),
    ("batch_size_of", tf.data.Dataset.range(4), ValueError,
     r"elements are scalars.*dataset\.batch\(n\)"),
    ("batch_size_of", _ids(4, 2).take(0), ValueError, "the dataset is empty"),
    ("rebatch", tf.data.Dataset.range(4), ValueError, "elements are scalars"),
])
def test_rebatch_and_batch_size_of_refuse_what_they_cannot_read(
        call, dataset, error, match):
    with pytest.raises(error, match=match):
        if call == "rebatch":
            data.rebatch(dataset, 2)
        else:
            data.batch_size_of(dataset)


@pytest.mark.parametrize("size", [0, -1, 2.5, "8", True])
def test_rebatch_refuses_a_bad_batch_size(size):
    with pytest.raises(ValueError, match=f"batch_size must be a positive "
                                         f"integer, got {size!r}"):
        data.rebatch(_ids(8, 2), size)


def test_rebatch_takes_a_numpy_batch_size():
    assert int(data.rebatch(_ids(8, 2), np.int64(4)).cardinality()) == 2


@pytest.mark.parametrize("drop_remainder, batches", [(False, 3), (True, 2)])
def test_fit_knows_the_epoch_length_and_never_runs_out(drop_remainder,
                                                       batches, tmp_path):
    # The spec gives the length: fit does not learn it by running out of
    # data (Keras's "Your input ran out of data" warning).
    import keras

    x = np.random.RandomState(0).rand(20, 3).astype("float32")
    data.write_tfrecords((x, x[:, :1]), str(tmp_path), num_shards=2)
    strategy = mirrored(2)
    dataset = data.tfrecord_dataset(f"{tmp_path}/*.tfrecord", strategy=strategy,
                                    per_replica_batch_size=4,
                                    drop_remainder=drop_remainder)
    assert int(dataset.cardinality()) == batches
    assert len(list(dataset)) == batches
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(dataset, epochs=2, verbose=0, shuffle=False)
    assert not [str(w.message) for w in caught
                if "ran out of data" in str(w.message)]
    assert int(model.optimizer.iterations.numpy()) == 2 * batches
