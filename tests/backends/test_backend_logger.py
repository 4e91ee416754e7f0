"""DistributedLogger on the active Keras backend where no `fit` drives
it: a hand-written loop of `train_on_batch` calls, on one device (under
MirroredStrategy, Keras's TensorFlow `train_on_batch` hands each replica
the whole batch, and its loss tracker counts it once per replica)."""

import json
import os

import keras
import numpy as np
import pytest

from keras_mgpu.callbacks import DistributedLogger
from tests.logger_checks import metrics_only


def test_train_on_batch_in_a_callback_list_counts_every_batch(tmp_path):
    """`train_on_batch` resets Keras's loss tracker at each call (Keras
    3.15; older releases let it run on): the logger counts each batch's
    samples (8, 8 and 4) either way and logs the values the loop gives."""
    log_dir = str(tmp_path / "logs")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20, 6)).astype("float32")
    y = rng.normal(size=(20, 1)).astype("float32")
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                              keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    callbacks = keras.callbacks.CallbackList(
        [DistributedLogger(log_dir, update_freq=1, console=False)],
        model=model)
    given = []
    callbacks.on_train_begin()
    callbacks.on_epoch_begin(0)
    for batch, (start, stop) in enumerate([(0, 8), (8, 16), (16, 20)]):
        callbacks.on_train_batch_begin(batch)
        logs = model.train_on_batch(x[start:stop], y[start:stop],
                                    return_dict=True)
        given.append(float(logs["loss"]))  # a NumPy array on Keras 3.10
        callbacks.on_train_batch_end(batch, logs)
    callbacks.on_epoch_end(0, logs)
    callbacks.on_train_end()
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        records = metrics_only(map(json.loads, f))
    assert [(r["kind"], r["step"], r["examples"]) for r in records] == [
        ("window", 1, 8.0), ("window", 2, 8.0), ("window", 3, 4.0),
        ("epoch", 3, 20.0)]
    assert [r["metrics"]["loss"] for r in records[:3]] == pytest.approx(given)
