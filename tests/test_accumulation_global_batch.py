"""`GradientAccumulationModel(global_batch_size=B, micro_batch_size=m)`
under `MirroredStrategy`: the plan on each replica count, its refusals, and
a backup made on 3 replicas resumed on 2 as the same run."""

import warnings

import keras
import pytest
import tensorflow as tf

from keras_mgpu import GradientAccumulationModel
from keras_mgpu.callbacks import BackupAndRestore
from tests import workers
from tests.conftest import mirrored
from tests.test_distributed_logger import CrashAfter
from tests.workers import max_diff


def wrapper(replicas, mode="window", **kwargs):
    with mirrored(replicas).scope():
        keras.utils.set_random_seed(3)
        model = GradientAccumulationModel(workers.build_mlp(), mode=mode,
                                          **kwargs)
        model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


@pytest.mark.parametrize("replicas, accum_steps", [(1, 8), (2, 4), (4, 2)])
def test_accum_steps_follow_the_replica_count(replicas, accum_steps):
    model = wrapper(replicas, global_batch_size=16, micro_batch_size=2)
    assert model.accum_steps == accum_steps
    config = model.get_config()
    assert (config["accum_steps"], config["global_batch_size"],
            config["micro_batch_size"]) == (None, 16, 2)


@pytest.mark.parametrize("mode", ["window", "in_step"])
def test_four_replicas_train_as_the_big_batch(mode):
    """Arrays with no batch_size: `fit` batches them as planned (8, or 16
    in-step), and each optimizer step is one step on 16 samples."""
    x, y = workers.regression_data(48)
    model = wrapper(4, mode, global_batch_size=16, micro_batch_size=2)
    model.fit(x, y, epochs=2, verbose=0, shuffle=False)
    keras.utils.set_random_seed(3)
    big = workers.build_mlp()
    big.compile(keras.optimizers.Adam(0.01), "mse")
    big.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    assert int(model.optimizer.iterations.numpy()) == 6
    assert max_diff(model.inner.get_weights(), big.get_weights()) < 1e-6


def test_a_global_batch_that_does_not_divide_is_refused():
    with pytest.raises(ValueError) as error:
        wrapper(4, global_batch_size=12, micro_batch_size=2)
    assert ("global_batch_size=12 is not a whole number of micro-batches of "
            "micro_batch_size=2 on 4 replica(s) (8 samples each)"
            in str(error.value))
    assert "Nothing was trained" in str(error.value)
    assert ("allow_batch_change=True to train 2 micro-batch(es) per step (a "
            "global batch of 16)") in str(error.value)


def test_an_allowed_batch_change_warns_and_trains_the_nearest():
    with pytest.warns(UserWarning, match="training 2 micro-batch"):
        model = wrapper(4, global_batch_size=12, micro_batch_size=2,
                        allow_batch_change=True)
    x, y = workers.regression_data(32)
    model.fit(x, y, epochs=1, verbose=0, shuffle=False)
    # 4 batches of 8, 2 per step.
    assert int(model.optimizer.iterations.numpy()) == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"accum_steps": 2, "global_batch_size": 8, "micro_batch_size": 2},
     "accum_steps=2 and global_batch_size=8 both set"),
    ({"micro_batch_size": 2}, "micro_batch_size=2 applies with "
     "global_batch_size, which is not set"),
    ({"allow_batch_change": True}, "allow_batch_change=True applies with"),
    ({"global_batch_size": 8}, "micro_batch_size must be a positive "
     "integer, got None"),
    ({"global_batch_size": 0, "micro_batch_size": 2},
     "global_batch_size must be a positive integer, got 0"),
    ({"global_batch_size": 8, "micro_batch_size": 2,
      "allow_batch_change": "yes"},
     "allow_batch_change must be True or False, got 'yes'"),
])
def test_bad_global_batch_options(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        GradientAccumulationModel(workers.build_mlp(), **kwargs)


@pytest.mark.parametrize("mode, data, message", [
    ("window", "batch_size", "batch_size is 5, but this "
     "GradientAccumulationModel takes batches of 4: one micro-batch of "
     "micro_batch_size=2 on 2 replica(s)."),
    ("window", "dataset", "the data's batch is 5"),
    ("in_step", "batch_size", "takes batches of 16: global_batch_size=16 as "
     "4 micro-batches of micro_batch_size=2 on 2 replica(s)."),
])
def test_data_batched_otherwise_is_refused(mode, data, message):
    model = wrapper(2, mode, global_batch_size=16, micro_batch_size=2)
    x, y = workers.regression_data(40)
    with pytest.raises(ValueError) as error:
        if data == "dataset":
            model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(
                5, drop_remainder=True), verbose=0)
        else:
            model.fit(x, y, batch_size=5, verbose=0)
    assert message in str(error.value)
    assert "Nothing was trained" in str(error.value)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_a_backup_on_3_replicas_resumes_on_2_as_the_same_run(tmp_path):
    """Micro-batches of 2 per replica, 12 per step: 2 micro-batches of 6 on
    3 replicas, 3 of 4 on 2. A save due after batch 3 (mid-window) is made
    at the window's end (batch 4); the crash after batch 5 resumes there on
    2 replicas, skipping the same 24 samples, with no warning."""
    x, y = workers.regression_data(72)
    kwargs = {"global_batch_size": 12, "micro_batch_size": 2}
    backup_dir = str(tmp_path / "b")
    first = wrapper(3, **kwargs)
    with pytest.raises(RuntimeError, match="crash"):
        first.fit(x, y, epochs=2, verbose=0, shuffle=False, callbacks=[
            BackupAndRestore(backup_dir, save_freq=3), CrashAfter(5)])
    workers.finish_backup_writes()
    resumed = wrapper(2, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.fit(x, y, epochs=2, verbose=0, shuffle=False,
                    callbacks=[BackupAndRestore(backup_dir, save_freq=3)])
    # The runtime's warning of a changed step batch, which this is not.
    assert not [w for w in caught if "skipping" in str(w.message)]
    on3, on2 = wrapper(3, **kwargs), wrapper(2, **kwargs)
    for model in (on3, on2):
        model.fit(x, y, epochs=2, verbose=0, shuffle=False)
    assert (resumed.accum_steps, on3.accum_steps) == (3, 2)
    for model in (resumed, on3, on2):
        assert int(model.optimizer.iterations.numpy()) == 12
    weights = resumed.inner.get_weights()
    assert max_diff(weights, on3.inner.get_weights()) < 1e-6
    assert max_diff(weights, on2.inner.get_weights()) < 1e-6


def test_a_backup_of_another_global_batch_is_refused(tmp_path):
    x, y = workers.regression_data(48)
    backup_dir = str(tmp_path / "b")
    with pytest.raises(RuntimeError, match="crash"):
        wrapper(2, global_batch_size=8, micro_batch_size=2).fit(
            x, y, epochs=1, verbose=0, shuffle=False, callbacks=[
                BackupAndRestore(backup_dir, save_freq=2), CrashAfter(2)])
    workers.finish_backup_writes()
    with pytest.raises(ValueError, match="global_batch_size 8 -> 16"):
        wrapper(2, global_batch_size=16, micro_batch_size=2).fit(
            x, y, epochs=1, verbose=0,
            callbacks=[BackupAndRestore(backup_dir)])
