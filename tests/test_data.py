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
