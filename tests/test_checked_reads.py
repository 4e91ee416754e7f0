"""What is read back is checked against what was written: a TFRecord
`spec.json` against the records' own features, a backup's callback states
against their depth (issue #44)."""

import hashlib
import json
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mgpu import data
from keras_mgpu.callbacks import BackupAndRestore
from keras_mgpu.callbacks.backup import generation as generation_lib
from tests import workers
from tests.test_backup_keras_scenarios import (InterruptingCallback, X, Y,
                                               make_model)

# Outside every scope tfrecord_dataset needs its strategy named.
ONE_DEVICE = tf.distribute.get_strategy()


def _write(tmp_path, arrays):
    data.write_tfrecords(arrays, str(tmp_path), num_shards=2)
    return str(tmp_path / "*.tfrecord")


def _edit_spec(tmp_path, edit):
    path = tmp_path / "spec.json"
    spec = json.loads(path.read_text())
    edit(spec)
    path.write_text(json.dumps(spec))


def _swap_features(first, second):
    def edit(spec):
        features = spec["features"]
        features[first], features[second] = (features[second],
                                              features[first])
    return edit


def _read(pattern, verify="first"):
    return data.tfrecord_dataset(pattern, per_replica_batch_size=4,
                                 strategy=ONE_DEVICE, verify=verify)


def _arrays():
    rng = np.random.RandomState(0)
    return {"image": rng.randn(12, 3).astype("float32"),
            "mask": rng.randn(12, 2).astype("float32"),
            "label": rng.randint(0, 10, 12).astype("int64")}


@pytest.mark.parametrize("first, second, says, holds", [
    # Another dtype and shape.
    ("f0", "f2", ("int64 of shape ()", "float32 of shape (3,)"),
     ("float32 of shape (3,)", "int64 of shape ()")),
    # The same dtype, another shape.
    ("f0", "f1", ("float32 of shape (2,)", "float32 of shape (3,)"),
     ("float32 of shape (3,)", "float32 of shape (2,)")),
])
def test_swapped_feature_entries_are_named_with_both_sides(
        tmp_path, first, second, says, holds):
    pattern = _write(tmp_path, _arrays())
    _edit_spec(tmp_path, _swap_features(first, second))
    fields = {"f0": "field image", "f1": "field mask", "f2": "field label"}
    for read in (_read, lambda p: _read(p, verify="all"),
                 data.verify_tfrecords):
        with pytest.raises(ValueError) as info:
            read(pattern)
        message = str(info.value)
        assert "data-00000-of-00002.tfrecord': record 0 does not match " \
            "spec.json" in message, message
        for name, said, held in ((first, says[0], holds[0]),
                                 (second, says[1], holds[1])):
            assert (f"feature '{name}' ({fields[name]}): spec.json says "
                    f"{said}, the record holds {held}") in message, message
        assert "restore the spec.json written with these shards, or " \
            "rewrite the folder with keras_mgpu.data.write_tfrecords" in (
                message)


def test_swapped_fields_in_the_structure_are_refused(tmp_path):
    """Two fields swapped in `structure`: each feature still fits its own
    entry, so only the writer's numbering shows it. Read, x and y would
    come back each other's, silently, whatever `verify` says."""
    pattern = _write(tmp_path, (np.ones((8, 3), "float32"),
                                np.ones((8, 3), "float32")))

    def swap(spec):
        spec["structure"]["tuple"].reverse()

    _edit_spec(tmp_path, swap)
    for verify in ("first", "none"):
        with pytest.raises(ValueError, match=(
                r"spec.json' is unusable \('structure' holds the features "
                r"in the order \['f1', 'f0'\], not 'f0', 'f1', \.\.\. .*"
                r"restore the spec.json written with them")):
            _read(pattern, verify)


def test_records_that_are_no_serialized_tensors_are_named(tmp_path):
    """A shard written by other code under the spec's name: its features
    are not the serialized tensors the spec describes."""
    pattern = _write(tmp_path, (np.ones((4, 3), "float32"),
                                np.arange(4, dtype="int64")))
    example = tf.train.Example(features=tf.train.Features(feature={
        "f0": tf.train.Feature(float_list=tf.train.FloatList(
            value=[1.0, 2.0, 3.0])),
        "f1": tf.train.Feature(bytes_list=tf.train.BytesList(
            value=[b"not a tensor"])),
        "f2": tf.train.Feature(int64_list=tf.train.Int64List(value=[1])),
    }))
    with tf.io.TFRecordWriter(str(tmp_path / "data-00001-of-00002.tfrecord")
                              ) as writer:
        for _ in range(2):
            writer.write(example.SerializeToString())
    spec = json.loads((tmp_path / "spec.json").read_text())
    size = (tmp_path / "data-00001-of-00002.tfrecord").stat().st_size
    spec["bytes_per_file"][1] = size
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError) as info:
        _read(pattern)
    message = str(info.value)
    assert "data-00001-of-00002.tfrecord': record 0 does not match" in message
    assert ("feature 'f0' (field [0]): spec.json says float32 of shape (3,), "
            "the record holds a float_list of 3 value(s), not one serialized "
            "tensor") in message
    assert ("feature 'f1' (field [1]): spec.json says int64 of shape (), the "
            "record holds bytes that are not a serialized tensor") in message
    assert "the record holds a feature 'f2' that spec.json does not name" in (
        message)


def test_untouched_records_read_back_exactly(tmp_path):
    arrays = _arrays()
    pattern = _write(tmp_path, arrays)
    assert data.verify_tfrecords(pattern) == 12
    for verify in ("first", "all", "none"):
        batches = list(_read(pattern, verify))
        for key, array in arrays.items():
            read = np.concatenate([b[key].numpy() for b in batches])
            # Dealt round-robin to the shards, interleaved back in order.
            assert read.dtype == array.dtype
            np.testing.assert_array_equal(read, array)


# --- callback states: depth and cycles, saved and read back ------------------


class _Holder(keras.callbacks.Callback):
    """A user's callback whose state is whatever it is given."""

    def __init__(self, state=None):
        super().__init__()
        self.state = {} if state is None else state
        self.restored = None

    def get_state(self):
        return self.state

    def set_state(self, state):
        self.state = self.restored = state


def _nested(levels):
    """A state `levels` dicts and lists deep: its own dict, then lists."""
    table = 1.0
    for _ in range(levels - 1):
        table = [table]
    return {"table": table}


def _containing_itself():
    log = {"epochs": [1, 2]}
    log["parent"] = log
    return {"log": log}


def _fit_with(callbacks):
    """Keras's BackupAndRestore test model: 3 epochs of 3 batches."""
    model = make_model()
    model.fit(X, Y, batch_size=4, epochs=3, shuffle=False, verbose=0,
              callbacks=callbacks)
    return model


_TOO_DEEP = (r"_Holder.get_state\(\)\['table'\]\[0\]\[0\]\[0\]\.\.\.\[0\]"
             r"\[0\] \(100 keys\) is nested more than 100 levels deep")


@pytest.mark.parametrize("state, match", [
    (_nested(101), _TOO_DEEP),
    (_nested(5000), _TOO_DEEP),
    (_containing_itself(), r"_Holder.get_state\(\)\['log'\]\['parent'\] is "
     r"_Holder.get_state\(\)\['log'\] itself, which contains it"),
], ids=["101-levels", "5000-levels", "containing-itself"])
def test_a_state_too_deep_or_containing_itself_is_named_at_the_save(
        tmp_path, state, match):
    with pytest.raises(ValueError, match=match):
        _fit_with([_Holder(state),
                   BackupAndRestore(str(tmp_path / "b"), save_freq=2)])
    workers.finish_backup_writes()


def test_a_state_of_100_levels_is_saved_and_restored(tmp_path):
    backup_dir = str(tmp_path / "b")
    with pytest.raises(RuntimeError, match="StepsInterruption"):
        _fit_with([_Holder(_nested(100)),
                   BackupAndRestore(backup_dir, save_freq=2),
                   InterruptingCallback(steps_int=5)])
    workers.finish_backup_writes()
    holder = _Holder()
    _fit_with([holder, BackupAndRestore(backup_dir, save_freq=2)])
    assert holder.restored == _nested(100)


@pytest.mark.parametrize("levels", [101, 3000])
def test_a_saved_state_nested_too_deep_is_named_at_the_restore(tmp_path,
                                                               levels):
    """state.json edited after the save (its manifest too, so the checksum
    holds): 101 levels decode, 3000 are beyond Python's JSON decoder. Either
    way the generation is unusable, naming the callback and the key."""
    backup_dir = str(tmp_path / "b")
    with pytest.raises(RuntimeError, match="StepsInterruption"):
        _fit_with([_Holder({"table": [1.0]}),
                   BackupAndRestore(backup_dir, save_freq=2),
                   InterruptingCallback(steps_int=5)])
    workers.finish_backup_writes()
    (number,) = generation_lib.generations(backup_dir)
    folder = generation_lib.generation_dir(backup_dir, number)
    with open(os.path.join(folder, "state.json")) as f:
        state = json.load(f)
    state["callbacks"][0]["state"]["table"] = "DEEP"
    deep = "[" * (levels - 1) + "1.0" + "]" * (levels - 1)
    raw = json.dumps(state).replace('"DEEP"', deep).encode()
    with open(os.path.join(folder, "state.json"), "wb") as f:
        f.write(raw)
    with open(os.path.join(folder, "MANIFEST.json")) as f:
        manifest = json.load(f)
    manifest["files"]["state.json"] = {
        "size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    with open(os.path.join(folder, "MANIFEST.json"), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(RuntimeError) as info:
        _fit_with([_Holder(), BackupAndRestore(backup_dir, save_freq=2)])
    assert info.type is RuntimeError  # not a RecursionError
    message = str(info.value)
    assert re.search(
        rf"generation {number} \(the saved {_TOO_DEEP}, which "
        r"BackupAndRestore never saves: the generation's state.json was "
        r"changed after the save\)", message), message
