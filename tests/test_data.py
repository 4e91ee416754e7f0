"""keras_mgpu.data: sharded TFRecords written, verified and read back."""

import json

import numpy as np
import pytest
import tensorflow as tf

from keras_mgpu import data
from tests.conftest import mirrored


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
                               per_replica_batch_size=8)
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
        str(tmp_path / "a" / "*.tfrecord"), per_replica_batch_size=12)))
    assert set(batch) == {"image", "label"}
    assert sorted(batch["label"].numpy()) == sorted(y)
    source = tf.data.Dataset.from_tensor_slices((x, y))
    data.write_tfrecords(source, str(tmp_path / "b"), num_shards=2)
    got = collect(data.tfrecord_dataset(str(tmp_path / "b" / "*.tfrecord"),
                                        per_replica_batch_size=4))
    assert sorted(got[1]) == sorted(y)


def test_global_batch_follows_the_strategy(tmp_path):
    data.write_tfrecords(arrays(40), str(tmp_path), num_shards=4)
    ds = data.tfrecord_dataset(str(tmp_path / "*.tfrecord"),
                               per_replica_batch_size=5, strategy=mirrored(4))
    assert [int(x.shape[0]) for x, _ in ds] == [20, 20]


def test_seeded_shuffle_is_deterministic(tmp_path):
    data.write_tfrecords(arrays(64), str(tmp_path), num_shards=4)
    pattern = str(tmp_path / "*.tfrecord")

    def epochs(seed, n=2):
        ds = data.tfrecord_dataset(pattern, per_replica_batch_size=8,
                                   shuffle=True, seed=seed, shuffle_buffer=64)
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
                               drop_remainder=True)
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
                               map_fn=decode)
    for _ in range(3):
        got_x, got_y = collect(ds)
        np.testing.assert_array_equal(got_x, 2 * x)
        np.testing.assert_array_equal(got_y, y)
    assert len(calls) == 10
    with pytest.raises(TypeError, match="map_fn must be a function.*got 3"):
        data.tfrecord_dataset(str(tmp_path / "*.tfrecord"),
                              per_replica_batch_size=4, map_fn=3)


def test_no_files_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="No files match .*nothing"):
        data.tfrecord_dataset(str(tmp_path / "nothing-*.tfrecord"),
                              per_replica_batch_size=2)


def test_corrupt_record_is_named_with_file_and_index(tmp_path):
    paths = data.write_tfrecords(arrays(20), str(tmp_path), num_shards=2)
    raw = bytearray(open(paths[1], "rb").read())
    record = len(raw) // 10
    raw[int(3.5 * record)] ^= 0xFF  # inside record 3 of 10
    open(paths[1], "wb").write(bytes(raw))
    pattern = str(tmp_path / "*.tfrecord")
    with pytest.raises(ValueError) as info:
        data.tfrecord_dataset(pattern, per_replica_batch_size=2, verify="all")
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
                              per_replica_batch_size=2)


def test_missing_spec_and_bad_arguments(tmp_path):
    (tmp_path / "x.tfrecord").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="No spec.json"):
        data.tfrecord_dataset(str(tmp_path / "*.tfrecord"),
                              per_replica_batch_size=2)
    with pytest.raises(ValueError, match="got 0"):
        data.tfrecord_dataset("x", per_replica_batch_size=0)
    with pytest.raises(ValueError, match="verify must be"):
        data.tfrecord_dataset("x", per_replica_batch_size=1, verify="some")
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
    ds = data.tfrecord_dataset("*.tfrecord", per_replica_batch_size=6)
    assert sorted(next(iter(ds))[1].numpy()) == sorted(arrays(6)[1])


@pytest.mark.parametrize("content, cause", [
    ("cut", "not valid JSON: "),
    ('{"version": 1, "structure": {"tuple": 2}, "num_examples": 4}',
     r"missing key\(s\) \['features'\]"),
    ("[1]", "a JSON object expected, got a list"),
    ('{"version": 1, "structure": {"tuple": 2}, "features": {"f0": {}}}',
     "'features' names"),
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
                                      per_replica_batch_size=2),
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
        data.tfrecord_dataset(**kwargs)
