"""`keras_mgpu.tuner`: real KerasTuner searches under real strategies and processes."""

import contextlib
import gc
import hashlib
import importlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import weakref

import keras
import keras_tuner
import numpy as np
import pytest
import tensorflow as tf

from keras_mgpu import GradientAccumulationModel
from keras_mgpu import compat
from keras_mgpu import launcher
from keras_mgpu import tuner as mgpu_tuner
from tests import tuner_workers
from tests.conftest import mirrored


class StepsRecorder(keras.callbacks.Callback):
    """Records each trial's steps per epoch and final optimizer iterations."""

    seen = []

    def on_train_begin(self, logs=None):
        StepsRecorder.seen.append({
            "steps": 0,
            "model": type(self.model).__name__,
            "policy": self.model.dtype_policy.name,
        })

    def on_train_batch_end(self, batch, logs=None):
        # Counted, not read from params: a re-batched dataset has no
        # known cardinality.
        if self.params.get("epochs", 1) and batch + 1 > self.seen[-1]["steps"]:
            StepsRecorder.seen[-1]["steps"] = batch + 1


@pytest.fixture(autouse=True)
def _reset():
    StepsRecorder.seen = []
    yield
    keras.mixed_precision.set_global_policy("float32")


def _trials(tuner):
    return sorted(tuner.oracle.trials.values(), key=lambda t: t.trial_id)


def _metric(trial, name):
    return float(trial.metrics.get_last_value(name))


# --- optional dependency --------------------------------------------------------


def test_import_keras_mgpu_does_not_import_keras_tuner():
    code = ("import sys, keras_mgpu; "
            "assert 'keras_tuner' not in sys.modules; "
            "assert 'keras_mgpu.tuner' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   env={**os.environ, "CUDA_VISIBLE_DEVICES": "-1"})


def test_missing_keras_tuner_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "keras_tuner", None)
    monkeypatch.delitem(sys.modules, "keras_mgpu.tuner")
    with pytest.raises(ImportError, match=r'pip install "keras-mgpu\[tuner\]"'):
        importlib.import_module("keras_mgpu.tuner")


def test_scaled_schedule_lives_outside_the_tuner_module():
    # Registered by `import keras_mgpu`; the tuner re-exports it.
    import keras_mgpu

    assert keras_mgpu.tuner is mgpu_tuner
    assert mgpu_tuner.ScaledSchedule is keras_mgpu.schedules.ScaledSchedule
    assert keras.saving.get_registered_object("keras_mgpu>ScaledSchedule") \
        is keras_mgpu.schedules.ScaledSchedule
    def build(hp):
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(
            keras.optimizers.schedules.ExponentialDecay(
                hp.Fixed("learning_rate", 0.1), 10, 0.5)), "mse")
        return model

    # The tuner's scaling of a schedule: x2 (one replica, 2 micro-batches).
    model = mgpu_tuner.StrategyAwareHyperModel(build, accum_steps=2).build(
        keras_tuner.HyperParameters())
    schedule = model.optimizer.get_config()["learning_rate"]
    assert schedule["registered_name"] == "keras_mgpu>ScaledSchedule"
    assert schedule["module"] == "keras_mgpu.schedules"
    again = keras.saving.deserialize_keras_object(schedule)
    assert round(float(again(10)), 6) == 0.1


# --- searches -------------------------------------------------------------------


def test_random_search_rebatches_dataset_and_scales_lr(tmp_path):
    x, y = tuner_workers.data(64)
    # Batched to 5 on purpose: every trial re-batches to its global batch.
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(5)
    hypermodel = mgpu_tuner.StrategyAwareHyperModel(
        tuner_workers.build_model, per_replica_batch_size=[4, 8],
        lr_scaling="linear")
    tuner = keras_tuner.RandomSearch(
        hypermodel, objective="val_loss", max_trials=3, seed=1,
        directory=str(tmp_path), distribution_strategy=mirrored(2))
    tuner.search(train, validation_data=train, epochs=1, verbose=0,
                 callbacks=[StepsRecorder()])
    trials = [t for t in _trials(tuner) if t.status == "COMPLETED"]
    assert len(trials) == 3
    for trial, seen in zip(trials, StepsRecorder.seen):
        per_replica = trial.hyperparameters.get("per_replica_batch_size")
        assert _metric(trial, "effective/replicas") == 2
        assert _metric(trial, "effective/global_batch_size") == 2 * per_replica
        assert seen["steps"] == math.ceil(64 / (2 * per_replica))
        assert _metric(trial, "effective/lr_scale") == 2.0
        assert _metric(trial, "effective/learning_rate") == pytest.approx(
            2 * trial.hyperparameters.get("learning_rate"), rel=1e-6)


def test_grid_search_tunes_accumulation_and_precision_numpy(tmp_path):
    def build(hp):
        model = keras.Sequential([keras.Input((tuner_workers.FEATURES,)),
                                  keras.layers.Dense(4),
                                  keras.layers.Dense(1, dtype="float32")])
        model.compile(keras.optimizers.Adam(
            hp.Fixed("learning_rate", 0.01)), "mse")
        return model

    hypermodel = mgpu_tuner.StrategyAwareHyperModel(
        build, lr_scaling="sqrt", accum_steps=[1, 2],
        precision=["float32", "mixed_bfloat16"])
    tuner = keras_tuner.GridSearch(
        hypermodel, objective="loss", directory=str(tmp_path),
        distribution_strategy=mirrored(2))
    x, y = tuner_workers.data(64)
    # A numpy batch_size is per replica: global batch 2 * 8.
    tuner.search(x, y, batch_size=8, epochs=1, verbose=0,
                 callbacks=[StepsRecorder()])
    trials = _trials(tuner)
    assert [t.status for t in trials] == ["COMPLETED"] * 4
    combos = set()
    for trial, seen in zip(trials, StepsRecorder.seen):
        accum = trial.hyperparameters.get("accum_steps")
        precision = trial.hyperparameters.get("precision")
        combos.add((accum, precision))
        assert seen["steps"] == 64 // 16
        assert seen["model"] == ("GradientAccumulationModel" if accum > 1
                                 else "Sequential")
        assert seen["policy"] == precision
        assert _metric(trial, "effective/global_batch_size") == 16
        assert _metric(trial, "effective/batch_size") == 16 * accum
        assert _metric(trial, "effective/lr_scale") == pytest.approx(
            math.sqrt(2 * accum))
        assert _metric(trial, "effective/learning_rate") == pytest.approx(
            0.01 * math.sqrt(2 * accum), rel=1e-5)
    assert combos == {(1, "float32"), (2, "float32"), (1, "mixed_bfloat16"),
                      (2, "mixed_bfloat16")}
    assert keras.mixed_precision.global_policy().name == "float32"


def test_learning_rate_schedule_is_scaled(tmp_path):
    def build(hp):
        model = keras.Sequential([keras.Input((tuner_workers.FEATURES,)),
                                  keras.layers.Dense(1)])
        base = hp.Float("learning_rate", 0.01, 0.02)
        model.compile(keras.optimizers.SGD(
            keras.optimizers.schedules.ExponentialDecay(base, 10, 0.5)), "mse")
        return model

    hypermodel = mgpu_tuner.StrategyAwareHyperModel(
        build, per_replica_batch_size=4, accum_steps=2)
    tuner = keras_tuner.RandomSearch(
        hypermodel, objective="loss", max_trials=1, directory=str(tmp_path),
        distribution_strategy=mirrored(2))
    x, y = tuner_workers.data(32)
    tuner.search(x, y, epochs=1, verbose=0)
    trial = _trials(tuner)[0]
    assert _metric(trial, "effective/lr_scale") == 4.0  # 2 replicas x 2
    assert _metric(trial, "effective/learning_rate") == pytest.approx(
        4 * trial.hyperparameters.get("learning_rate"), rel=1e-5)


def test_memory_is_released_across_trials(tmp_path):
    page = os.sysconf("SC_PAGE_SIZE")
    rss = []

    class Measuring(keras_tuner.RandomSearch):
        def on_trial_end(self, trial):
            super().on_trial_end(trial)
            gc.collect()
            with open("/proc/self/statm") as f:
                rss.append(int(f.read().split()[1]) * page / 2**20)

    built = []

    def build(hp):
        # Weak references to this test's trial models only: models other
        # tests of this process left alive are not this test's concern.
        model = tuner_workers.build_model(hp)
        built.append(weakref.ref(model))
        return model

    hypermodel = mgpu_tuner.StrategyAwareHyperModel(
        build, per_replica_batch_size=8)
    tuner = Measuring(hypermodel, objective="loss", max_trials=10, seed=4,
                      max_consecutive_failed_trials=1,
                      directory=str(tmp_path), distribution_strategy=mirrored(2))
    x, y = tuner_workers.data(64)
    tuner.search(x, y, epochs=1, verbose=0)
    assert len(rss) == 10
    gc.collect()
    live_models = [ref() for ref in built if ref() is not None]
    # The trials' models are gone (at most the last one lingers in a frame).
    assert len(built) >= 10 and len(live_models) <= 1, live_models
    # After warm-up, ten trials add no more than a few MiB each of allocator
    # slack; a leaked model and its traced functions per trial would not fit.
    assert rss[-1] - rss[2] < 60, rss


class FirstStep(keras.callbacks.Callback):
    """Records, per fit, the learning rate of its first optimizer step and
    the optimizer steps it took."""

    def __init__(self, log, trial_id):
        super().__init__()
        self.log, self.trial_id = log, trial_id

    def on_train_begin(self, logs=None):
        self.record = {"trial": self.trial_id, "epochs": 0, "rate": None,
                       "start": int(self.model.optimizer.iterations.numpy())}

    def on_train_batch_begin(self, batch, logs=None):
        if self.record["rate"] is None:
            optimizer = self.model.optimizer
            inner = getattr(optimizer, "inner_optimizer", optimizer)
            self.record["step"] = int(optimizer.iterations.numpy())
            self.record["rate"] = float(
                keras.ops.convert_to_numpy(inner.learning_rate))

    def on_epoch_end(self, epoch, logs=None):
        self.record["epochs"] += 1

    def on_train_end(self, logs=None):
        self.record["steps"] = (int(self.model.optimizer.iterations.numpy())
                                - self.record["start"])
        self.log.append(self.record)


def recording(build, log, **kwargs):
    """A StrategyAwareHyperModel whose fits add a `FirstStep` to `log`."""
    return tuner_workers.with_trial_callback(
        build, lambda trial_id: FirstStep(log, trial_id), **kwargs)


def rate_at(model, step):
    """The rate `model`'s optimizer applies at optimizer step `step`."""
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    schedule = compat.learning_rate_schedule(inner)
    if schedule is not None:
        return float(schedule(step))
    return float(keras.ops.convert_to_numpy(inner.learning_rate))


def adam_model(hp):
    model = keras.Sequential([keras.Input((tuner_workers.FEATURES,)),
                              keras.layers.Dense(hp.Choice("units", [4, 8]),
                                                 activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(
        hp.Choice("learning_rate", [0.004, 0.008])), "mse")
    return model


def make_tuner(kind, hypermodel, directory):
    common = dict(objective="loss", directory=directory, seed=7,
                  distribution_strategy=mirrored(2))
    if kind == "random":
        return keras_tuner.RandomSearch(hypermodel, max_trials=3, **common)
    if kind == "bayesian":
        return keras_tuner.BayesianOptimization(
            hypermodel, max_trials=3, num_initial_points=2, **common)
    if kind == "hyperband":
        return keras_tuner.Hyperband(hypermodel, max_epochs=3, factor=3,
                                     hyperband_iterations=1, **common)
    return keras_tuner.GridSearch(hypermodel, max_trials=4, **common)


# Hyperband, whose trials resume with more epochs; the other oracles drive
# the same hook (random search: the default run's other searches; all of
# them: `make test-all`).
@pytest.mark.parametrize("kind", [
    pytest.param("random", marks=pytest.mark.exhaustive),
    pytest.param("bayesian", marks=pytest.mark.exhaustive),
    "hyperband", pytest.param("grid", marks=pytest.mark.exhaustive)])
def test_every_tuner_steps_exactly_and_best_model_keeps_the_trained_rate(
        tmp_path, kind):
    # 60 samples batched to 8 without drop_remainder: no static batch size
    # (the last batch holds 4). The default per-replica batch is read from
    # it (4 per replica), and each epoch is ceil(60 / 8) = 8 steps: before,
    # the re-batched dataset had no length and Keras took a 9th, empty one.
    x, y = tuner_workers.data(60)
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    log = []
    tuner = make_tuner(kind, recording(adam_model, log, accum_steps=[1, 2]),
                       str(tmp_path))
    tuner.search(train, epochs=3, verbose=0)
    completed = {t.trial_id: t for t in _trials(tuner)
                 if t.status == "COMPLETED"}
    assert len(completed) >= 2 and len(log) >= len(completed)
    for record in log:
        hp = completed[record["trial"]].hyperparameters
        accum = hp.get("accum_steps")
        assert _metric(completed[record["trial"]],
                       "effective/per_replica_batch_size") == 4
        assert record["epochs"] >= 1
        assert record["steps"] == record["epochs"] * 8 // accum, record
        # Linear scaling: 2 replicas x accum_steps.
        assert record["rate"] == pytest.approx(
            hp.get("learning_rate") * 2 * accum, rel=1e-6)
    best_trial = tuner.oracle.get_best_trials(1)[0]
    best = tuner.get_best_models(1)[0]
    trained = [r for r in log if r["trial"] == best_trial.trial_id][0]
    assert rate_at(best, trained["step"]) == pytest.approx(trained["rate"],
                                                           rel=1e-6)


def _sgd(hp, **kwargs):
    return keras.optimizers.SGD(hp.Float("learning_rate", 0.01, 0.02),
                                **kwargs)


OPTIMIZERS = {
    "sgd": _sgd,
    "sgd_momentum": lambda hp: _sgd(hp, momentum=0.9),
    "adamw": lambda hp: keras.optimizers.AdamW(
        hp.Float("learning_rate", 0.001, 0.002), weight_decay=0.01),
    "schedule": lambda hp: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(
            hp.Float("learning_rate", 0.01, 0.02), 4, 0.5)),
    "adam_mixed_float16": lambda hp: keras.optimizers.Adam(
        hp.Float("learning_rate", 0.001, 0.002)),
}


# SGD with momentum keeps its rate where SGD does (`make test-all`).
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.exhaustive)
    if name == "sgd_momentum" else name for name in sorted(OPTIMIZERS)])
def test_best_model_is_compiled_with_the_rate_its_trial_trained_with(
        tmp_path, name):
    # The trial must train to a finite loss, or KerasTuner saves no best
    # checkpoint: its initial weights are this test's, not whatever random
    # state and policy the tests before it left.
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy("float32")

    def build(hp):
        model = keras.Sequential([keras.Input((tuner_workers.FEATURES,)),
                                  keras.layers.Dense(4),
                                  keras.layers.Dense(1, dtype="float32")])
        model.compile(OPTIMIZERS[name](hp), "mse")
        return model

    # The reference batch makes the scale depend on the per-replica batch:
    # (8 per replica x 2) / 4 = 4.
    log = []
    hypermodel = recording(
        build, log, reference_batch_size=4, per_replica_batch_size=8,
        precision="mixed_float16" if "mixed" in name else None)
    tuner = keras_tuner.RandomSearch(
        hypermodel, objective="loss", max_trials=1, seed=3,
        directory=str(tmp_path), distribution_strategy=mirrored(2))
    x, y = tuner_workers.data(64)
    tuner.search(tf.data.Dataset.from_tensor_slices((x, y)).batch(16),
                 epochs=2, verbose=0)
    (trained,) = log
    trial = _trials(tuner)[0]
    assert trial.hyperparameters.get("per_replica_batch_size") == 8
    assert _metric(trial, "effective/lr_scale") == 4.0
    best = tuner.get_best_models(1)[0]
    if "mixed" in name:
        assert isinstance(best.optimizer,
                          keras.optimizers.LossScaleOptimizer)
    assert trained["step"] == 0
    if "mixed" not in name:
        # (Under a loss scale, a step with non-finite gradients is skipped.)
        assert trained["steps"] == 8
    assert trained["rate"] == pytest.approx(
        4 * trial.hyperparameters.get("learning_rate"), rel=1e-6)
    for step in (0, 4, 8):
        assert rate_at(best, step) == pytest.approx(
            4 * trial.hyperparameters.get("learning_rate")
            * (0.5 ** (step / 4) if name == "schedule" else 1), rel=1e-6)
    # KerasTuner's documented retraining path builds from the best
    # hyperparameters: on the same strategy, the same rate.
    with mirrored(2).scope():
        rebuilt = tuner.hypermodel.build(tuner.get_best_hyperparameters(1)[0])
    assert rate_at(rebuilt, 0) == pytest.approx(trained["rate"], rel=1e-6)


@pytest.mark.parametrize("pipeline", ["exact", "remainder", "static",
                                      "shuffled"])
def test_default_per_replica_batch_reads_any_batched_dataset(tmp_path,
                                                             pipeline):
    samples = 60 if pipeline == "remainder" else 64
    x, y = tuner_workers.data(samples)
    source = tf.data.Dataset.from_tensor_slices((x, y))
    train = {
        "exact": lambda: source.batch(16),
        "remainder": lambda: source.batch(16),  # last batch 12
        "static": lambda: source.batch(16, drop_remainder=True),
        "shuffled": lambda: source.shuffle(64, seed=1).batch(16).prefetch(2),
    }[pipeline]()
    log = []
    tuner = keras_tuner.RandomSearch(
        recording(tuner_workers.build_model, log), objective="loss",
        max_trials=1, seed=1, directory=str(tmp_path),
        distribution_strategy=mirrored(2))
    tuner.search(train, epochs=3, verbose=0)
    trial = _trials(tuner)[0]
    assert trial.status == "COMPLETED", trial.message
    assert _metric(trial, "effective/per_replica_batch_size") == 8
    # Found in the data, so not a hyperparameter.
    assert "per_replica_batch_size" not in trial.hyperparameters
    assert log[0]["steps"] == 3 * -(-samples // 16)


# --- errors ---------------------------------------------------------------------


def test_unknown_lr_scaling_lists_valid_rules():
    with pytest.raises(ValueError, match=r"'cubic'.*'linear', 'sqrt', None"):
        mgpu_tuner.StrategyAwareHyperModel(tuner_workers.build_model,
                                           lr_scaling="cubic")


@pytest.mark.parametrize("precision, message", [
    ([], r"precision must be a policy name or a non-empty list.*got \[\]"),
    ((), r"non-empty list.*got \(\)"),
    (["float64"], r"Unknown precision policy 'float64'"),
])
def test_bad_precision_is_refused_at_construction(precision, message):
    with pytest.raises(ValueError, match=message):
        mgpu_tuner.StrategyAwareHyperModel(tuner_workers.build_model,
                                           precision=precision)


def test_missing_learning_rate_hp_names_fix(tmp_path):
    def build(hp):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
            hp.Choice("units", [1, 2]))])
        model.compile("sgd", "mse")
        return model

    hypermodel = mgpu_tuner.StrategyAwareHyperModel(build, lr_scaling="sqrt")
    with pytest.raises(ValueError, match=r"'learning_rate'.*hp\.Float"):
        keras_tuner.RandomSearch(hypermodel, objective="loss", max_trials=1,
                                 directory=str(tmp_path))


def test_dataset_batch_not_divisible_without_rebatch(tmp_path):
    x, y = tuner_workers.data(60)
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        12, drop_remainder=True)
    hypermodel = mgpu_tuner.StrategyAwareHyperModel(
        tuner_workers.build_model, per_replica_batch_size=8, rebatch=False)
    tuner = keras_tuner.RandomSearch(
        hypermodel, objective="loss", max_trials=1, directory=str(tmp_path),
        distribution_strategy=mirrored(2))
    with pytest.raises(keras_tuner.errors.FatalValueError,
                       match=r"per_replica_batch_size=8.*batched to 12.*"
                             r"8 does not divide.*rebatch=True"):
        tuner.search(train, epochs=1, verbose=0)


def test_dataset_used_as_batched_without_rebatch(tmp_path):
    x, y = tuner_workers.data(64)
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        16, drop_remainder=True)
    hypermodel = mgpu_tuner.StrategyAwareHyperModel(
        tuner_workers.build_model, rebatch=False)
    tuner = keras_tuner.RandomSearch(
        hypermodel, objective="loss", max_trials=1, directory=str(tmp_path),
        distribution_strategy=mirrored(2))
    tuner.search(train, epochs=1, verbose=0, callbacks=[StepsRecorder()])
    trial = _trials(tuner)[0]
    assert _metric(trial, "effective/per_replica_batch_size") == 8
    assert StepsRecorder.seen[0]["steps"] == 4


def test_accumulation_wrapper_from_build_fn_is_kept(tmp_path):
    def build(hp):
        inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model = GradientAccumulationModel(inner, accum_steps=3)
        model.compile(keras.optimizers.SGD(hp.Fixed("learning_rate", 0.1)),
                      "mse")
        return model

    hypermodel = mgpu_tuner.StrategyAwareHyperModel(
        build, per_replica_batch_size=2, accum_steps=[3, 4])
    with pytest.raises(ValueError, match=r"accum_steps=3.*accum_steps=4"):
        tuner = keras_tuner.GridSearch(hypermodel, objective="loss",
                                       directory=str(tmp_path))
        tuner.search(np.ones((24, 4)), np.ones((24, 1)), epochs=1, verbose=0)


def test_an_oracle_refusing_new_entries_gets_no_recorded_batch(tmp_path):
    space = keras_tuner.HyperParameters()
    space.Choice("units", [4, 8])
    space.Float("learning_rate", 1e-3, 1e-2, sampling="log")
    tuner = keras_tuner.RandomSearch(
        mgpu_tuner.StrategyAwareHyperModel(tuner_workers.build_model),
        hyperparameters=space, allow_new_entries=False, objective="loss",
        max_trials=2, seed=1, directory=str(tmp_path))
    x, y = tuner_workers.data(32)
    tuner.search(x, y, batch_size=8, epochs=1, verbose=0)
    trials = _trials(tuner)
    assert [t.status for t in trials] == ["COMPLETED"] * 2
    assert all("per_replica_batch_size" not in t.hyperparameters
               for t in trials)
    assert _metric(trials[0], "effective/per_replica_batch_size") == 8


def test_uncompiled_build_fn_is_named_with_the_fix(tmp_path):
    def build(hp):
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(
            hp.Choice("units", [1, 2]))])

    for lr_scaling in ("linear", None):
        hypermodel = mgpu_tuner.StrategyAwareHyperModel(
            build, lr_scaling=lr_scaling)
        with pytest.raises(keras_tuner.errors.FatalValueError,
                           match=r"uncompiled Sequential.*model\.compile"):
            keras_tuner.RandomSearch(hypermodel, objective="loss",
                                     max_trials=1, directory=str(tmp_path))


def test_callable_learning_rate_is_named_with_the_fix(tmp_path):
    def build(hp):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        lr = hp.Float("learning_rate", 0.01, 0.1)
        model.compile(keras.optimizers.SGD(lambda: lr), "mse")
        return model

    hypermodel = mgpu_tuner.StrategyAwareHyperModel(build)
    with pytest.raises(keras_tuner.errors.FatalValueError,
                       match=r"learning rate is a function.*cannot scale.*"
                             r"LearningRateSchedule.*lr_scaling=None"):
        keras_tuner.RandomSearch(hypermodel, objective="loss", max_trials=1,
                                 directory=str(tmp_path))
    # Unscaled, it is left as build_fn set it.
    tuner = keras_tuner.RandomSearch(
        mgpu_tuner.StrategyAwareHyperModel(build, lr_scaling=None),
        objective="loss", max_trials=1, directory=str(tmp_path),
        overwrite=True)
    tuner.search(np.ones((8, 4)), np.ones((8, 1)), epochs=1, verbose=0)
    assert _trials(tuner)[0].status == "COMPLETED"


def test_numpy_integers_are_accepted_as_plain_ints(tmp_path):
    hypermodel = mgpu_tuner.StrategyAwareHyperModel(
        tuner_workers.build_model, per_replica_batch_size=np.int64(8),
        accum_steps=[np.int32(1), np.int64(2)],
        reference_batch_size=np.int64(16), backup=np.int64(4))
    assert type(hypermodel.per_replica_batch_size) is int
    assert [type(a) for a in hypermodel.accum_steps] == [int, int]
    assert type(hypermodel.reference_batch_size) is int
    tuner = keras_tuner.GridSearch(hypermodel, objective="loss", max_trials=1,
                                   directory=str(tmp_path))
    x, y = tuner_workers.data(32)
    tuner.search(x, y, batch_size=np.int64(8), epochs=1, verbose=0)
    trial = _trials(tuner)[0]
    assert trial.status == "COMPLETED", trial.message
    assert _metric(trial, "effective/per_replica_batch_size") == 8
    with pytest.raises(ValueError, match=r"per_replica_batch_size must be a "
                                         r"positive integer, got np.int64\(0\)"):
        mgpu_tuner.StrategyAwareHyperModel(tuner_workers.build_model,
                                           per_replica_batch_size=np.int64(0))


def test_tuner_extra_installs_what_every_kerastuner_tuner_imports():
    from importlib import metadata

    from packaging.requirements import Requirement

    def names(distribution, extra):
        wanted = []
        for line in metadata.requires(distribution) or []:
            requirement = Requirement(line)
            if requirement.marker and requirement.marker.evaluate(
                    {"extra": extra}):
                wanted.append(requirement.name.lower())
        return set(wanted)

    # keras-tuner declares BayesianOptimization's needs as its "bayesian"
    # extra; keras-mgpu's "tuner" extra must bring them.
    bayesian = names("keras-tuner", "bayesian")
    assert {"scipy", "scikit-learn"} <= bayesian
    assert bayesian <= names("keras-mgpu", "tuner")


# --- launcher planning ----------------------------------------------------------


def test_plan_workers_device_groups():
    gpus = [str(i) for i in range(8)]
    envs = mgpu_tuner.plan_workers(gpus, 2, oracle_port=1234)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == [
        "-1", "0,1", "2,3", "4,5", "6,7"]
    assert [e["KERASTUNER_TUNER_ID"] for e in envs] == [
        "chief", "tuner0", "tuner1", "tuner2", "tuner3"]
    assert all(e["KERASTUNER_ORACLE_PORT"] == "1234" for e in envs)
    assert all(e["TF_CONFIG"] == "{}" for e in envs)
    # The chief waits for every worker's tuner id.
    assert envs[0]["KERAS_MGPU_TUNER_IDS"] == "tuner0,tuner1,tuner2,tuner3"
    assert len(mgpu_tuner.plan_workers(gpus, 1, oracle_port=1)) == 9
    assert [e["CUDA_VISIBLE_DEVICES"] for e in mgpu_tuner.plan_workers(
        gpus, 4, num_workers=1, oracle_port=1)] == ["-1", "0,1,2,3"]
    cpu = mgpu_tuner.plan_workers([], num_workers=2, oracle_port=1)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in cpu] == ["-1", "-1", "-1"]


def test_plan_workers_errors():
    with pytest.raises(ValueError, match=r"devices_per_trial=3.*8 devices"):
        mgpu_tuner.plan_workers([str(i) for i in range(8)], 3, oracle_port=1)
    with pytest.raises(ValueError, match=r"num_workers=3.*only 2"):
        mgpu_tuner.plan_workers(["0", "1", "2", "3"], 2, num_workers=3,
                                oracle_port=1)


@pytest.mark.parametrize("devices, kwargs, error, message", [
    ([], {"oracle_port": -1}, ValueError,
     r"oracle_port must be a TCP port, an integer from 1 to 65535, got -1"),
    ([], {"oracle_port": 65536}, ValueError, r"got 65536"),
    ([], {"oracle_port": "x; rm -rf /"}, ValueError,
     r"oracle_port must be a TCP port.*got 'x; rm -rf /'"),
    ([], {"oracle_port": "8000"}, ValueError, r"got '8000'"),
    ([], {"oracle_port": True}, ValueError, r"got True"),
    ([], {"oracle_port": 8000, "oracle_ip": "x; rm -rf /"}, ValueError,
     r"oracle_ip must be the chief's host name or IP address.*"
     r"got 'x; rm -rf /'"),
    ([], {"oracle_port": 8000, "oracle_ip": "localhost\n"}, ValueError,
     r"oracle_ip .*got 'localhost\\n'"),
    ([], {"oracle_port": 8000, "oracle_ip": None}, ValueError,
     r"oracle_ip .*got None"),
    (["0,1", "2"], {"oracle_port": 8000}, ValueError,
     r"one GPU id per entry.*got '0,1'"),
    (["0", "1; rm -rf /"], {"oracle_port": 8000}, ValueError,
     r"got '1; rm -rf /'"),
    (["0", "1", "0"], {"oracle_port": 8000}, ValueError,
     r"devices lists \['0'\] more than once"),
    ("0,1", {"oracle_port": 8000}, TypeError,
     r"devices must be a list of GPU ids.*got the string '0,1'"),
])
def test_plan_workers_refuses_what_would_reach_the_environment(
        devices, kwargs, error, message):
    with pytest.raises(error, match=message):
        mgpu_tuner.plan_workers(devices, 1, **kwargs)


def test_plan_workers_accepts_hosts_addresses_and_numpy_ports():
    for ip in ("127.0.0.1", "::1", "node-0.cluster.local", "localhost"):
        envs = mgpu_tuner.plan_workers([0, 1], 1, oracle_port=np.int64(8000),
                                       oracle_ip=ip)
        assert {e["KERASTUNER_ORACLE_IP"] for e in envs} == {ip}
        assert {e["KERASTUNER_ORACLE_PORT"] for e in envs} == {"8000"}


# --- real processes ---------------------------------------------------------------


def checkpoint_arrays(path):
    """The arrays of a weights file, in the order of their names."""
    import h5py

    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, item: found.__setitem__(name, item[()])
                     if isinstance(item, h5py.Dataset) else None)
    return [found[name] for name in sorted(found)]


def test_killed_search_resumes_without_redoing_trials(run_workers, tmp_path):
    """A trial killed after epoch 1 of 4 (SIGKILL) resumes at epoch 2, and
    ends with the score, best step and best checkpoint of the same trial
    uninterrupted: its best epoch (the first: `loss` is maximized) came
    before the kill."""
    directory = str(tmp_path / "killed")
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "-1",
           "TF_CONFIG": "{}"}
    first = run_workers(
        tuner_workers.resumable_search, 1, env=env, timeout=180,
        kwargs={"directory": directory, "kill_trial": "1", "kill_epoch": 2},
        kill_when_printed="KILL-ME")
    assert first[0].killed
    log = tuner_workers.read_log(os.path.join(directory, "epochs.jsonl"))
    killed_pid = log[0]["pid"]
    assert [(r["trial"], r["epoch"]) for r in log] == [
        ("0", 0), ("0", 1), ("0", 2), ("0", 3), ("1", 0), ("1", 1)]

    second = run_workers(tuner_workers.resumable_search, 1, env=env,
                         timeout=180, kwargs={"directory": directory})
    assert second[0].result["trials"] == {
        "0": "COMPLETED", "1": "COMPLETED", "2": "COMPLETED"}
    rerun = [r for r in tuner_workers.read_log(
        os.path.join(directory, "epochs.jsonl")) if r["pid"] != killed_pid]
    # Trial 0 is not redone; trial 1 resumes at epoch 2 with its optimizer
    # state (4 steps per epoch: 64 samples, global batch 8 x 2 replicas).
    assert [(r["trial"], r["epoch"]) for r in rerun] == [
        ("1", 2), ("1", 3), ("2", 0), ("2", 1), ("2", 2), ("2", 3)]
    assert [r["iterations"] for r in rerun[:2]] == [12, 16]
    # Finished trials leave no backups behind.
    assert not os.path.exists(os.path.join(
        directory, "resume", "trial_1", "backup", "execution_0"))

    reference = str(tmp_path / "uninterrupted")
    expected = tuner_workers.search_resumable(tuner_workers.resumable_tuner(
        reference, mirrored(2), max_trials=2))["best"]["1"]
    resumed = second[0].result["best"]["1"]
    assert resumed["hp"] == expected["hp"]
    assert resumed["best_step"] == expected["best_step"] == 0
    assert abs(resumed["score"] - expected["score"]) <= 1e-6
    checkpoints = [checkpoint_arrays(os.path.join(
        d, "resume", "trial_1", "checkpoint.weights.h5"))
        for d in (directory, reference)]
    assert len(checkpoints[0]) == len(checkpoints[1]) > 0
    assert max(float(np.abs(a - b).max())
               for a, b in zip(*checkpoints)) <= 1e-6



def first_trial_search(directory, seed=None, kill_epoch=None, max_trials=2):
    """Worker entry point (and, with the killed search's seed, the
    uninterrupted reference here): `resumable_search`'s trials with
    KerasTuner's default seed, None (a new one drawn in each process), and
    `loss` minimized, so each trial's best epoch is its last. With
    `kill_epoch`, killed as trial 0, its first, begins that epoch."""
    tuner = keras_tuner.RandomSearch(
        tuner_workers.make_recording_hypermodel(
            os.path.join(directory, "epochs.jsonl"),
            None if kill_epoch is None else "0", kill_epoch,
            build_fn=tuner_workers.build_seeded_model,
            per_replica_batch_size=8),
        objective="loss", max_trials=max_trials, seed=seed,
        directory=directory, project_name="first", overwrite=False,
        distribution_strategy=mirrored(2))
    return tuner_workers.search_resumable(tuner)


# A kill in the first trial, which KerasTuner reloads no search for: the
# resume of a killed trial is in the default run (the test above).
@pytest.mark.exhaustive
def test_a_search_killed_in_its_first_trial_resumes_that_trial(run_workers,
                                                               tmp_path):
    """A search killed (SIGKILL) in epoch 3 of 4 of its first trial: the
    rerun in a new process retries trial 0 with its own hyperparameters
    and resumes its backup, and the trial ends as it does uninterrupted.
    (KerasTuner reloads a search only from the tuner's file, which it
    writes as a trial ends: the rerun began a new search, whose trial 0,
    with new hyperparameters, failed on the killed one's backup.)"""
    directory = str(tmp_path / "killed")
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "-1",
           "TF_CONFIG": "{}"}
    first = run_workers(
        first_trial_search, 1, env=env, timeout=180,
        kwargs={"directory": directory, "kill_epoch": 2},
        kill_when_printed="KILL-ME")
    assert first[0].killed
    log_path = os.path.join(directory, "epochs.jsonl")
    killed_pid = tuner_workers.read_log(log_path)[0]["pid"]
    assert [(r["trial"], r["epoch"])
            for r in tuner_workers.read_log(log_path)] == [("0", 0), ("0", 1)]
    project = os.path.join(directory, "first")
    with open(os.path.join(project, "trial_0", "trial.json")) as f:
        killed_hp = json.load(f)["hyperparameters"]["values"]
    with open(os.path.join(project, "oracle.json")) as f:
        seed = json.load(f)["seed"]

    second = run_workers(first_trial_search, 1, env=env, timeout=180,
                         kwargs={"directory": directory})
    assert second[0].result["trials"] == {"0": "COMPLETED", "1": "COMPLETED"}
    resumed = second[0].result["best"]["0"]
    assert resumed["hp"] == killed_hp
    rerun = [r for r in tuner_workers.read_log(log_path)
             if r["pid"] != killed_pid]
    # Trial 0 resumes at epoch 3 with its optimizer's state (4 steps per
    # epoch: 64 samples, global batch 8 x 2 replicas), then trial 1 runs.
    assert [(r["trial"], r["epoch"]) for r in rerun] == [
        ("0", 2), ("0", 3), ("1", 0), ("1", 1), ("1", 2), ("1", 3)]
    assert [r["iterations"] for r in rerun[:2]] == [12, 16]

    reference = str(tmp_path / "uninterrupted")
    expected = first_trial_search(reference, seed=seed,
                                  max_trials=1)["best"]["0"]
    assert expected["hp"] == killed_hp
    assert resumed["best_step"] == expected["best_step"] == 3
    assert abs(resumed["score"] - expected["score"]) <= 1e-6
    checkpoints = [checkpoint_arrays(os.path.join(
        d, "first", "trial_0", "checkpoint.weights.h5"))
        for d in (directory, reference)]
    assert len(checkpoints[0]) == len(checkpoints[1]) > 0
    assert max(float(np.abs(a - b).max())
               for a, b in zip(*checkpoints)) <= 1e-6

@contextlib.contextmanager
def rendezvous(parties, timeout=240):
    """A barrier for `parties` worker processes, held by the test: a Unix
    socket that answers every worker once all have connected."""
    folder = tempfile.mkdtemp(prefix="kmgpu-rv-")  # short: AF_UNIX paths
    address = os.path.join(folder, "rv.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen(parties)
    listener.settimeout(timeout)

    def serve():
        connections = []
        try:
            for _ in range(parties):
                connections.append(listener.accept()[0])
            for c in connections:
                c.sendall(b"1")
        except OSError:
            pass  # timed out: the waiting workers fail with their own error
        finally:
            for c in connections:
                c.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield address
    finally:
        try:
            listener.shutdown(socket.SHUT_RDWR)  # wakes a pending accept
        except OSError:
            pass
        listener.close()
        thread.join(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def test_launch_chief_and_two_workers(tmp_path):
    with rendezvous(2) as address:
        results = mgpu_tuner.launch(
            tuner_workers.parallel_search, devices=[], num_workers=2,
            kwargs={"directory": str(tmp_path), "max_trials": 4,
                    "rendezvous": address},
            timeout=240, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    chief, *workers = [r.result for r in results]
    assert chief["tuner_id"] == "chief" and chief["trained"] == []
    assert {t["status"] for t in chief["trials"].values()} == {"COMPLETED"}
    assert sorted(chief["trials"]) == ["0", "1", "2", "3"]
    assert all(t["replicas"] == 2 for t in chief["trials"].values())
    trained = [set(w["trained"]) for w in workers]
    assert all(trained), trained            # both workers ran trials
    assert trained[0].isdisjoint(trained[1])
    assert trained[0] | trained[1] == {"0", "1", "2", "3"}
    # The oracle state lives in the project directory, written by the chief.
    reloaded = keras_tuner.RandomSearch(
        mgpu_tuner.StrategyAwareHyperModel(tuner_workers.build_model),
        objective="loss", max_trials=4, directory=str(tmp_path),
        project_name="parallel")
    assert len(reloaded.oracle.trials) == 4
    assert reloaded.remaining_trials == 0


def _checkpoints(directory):
    found = {}
    for trial in sorted(os.listdir(directory)):
        path = os.path.join(directory, trial, "checkpoint.weights.h5")
        if os.path.exists(path):
            with open(path, "rb") as f:
                found[trial] = hashlib.sha256(f.read()).hexdigest()
    return found


# Parallel tuning's reruns: a kill's on the same resume as one worker's
# (the default run's killed search) and a chief with two workers
# (test_launch_chief_and_two_workers); both together: `make test-all`.
@pytest.mark.exhaustive
def test_parallel_reruns_after_a_kill_and_a_finish_redo_no_trial(tmp_path):
    def search(num_workers=1, **kwargs):
        results = mgpu_tuner.launch(
            tuner_workers.parallel_search, devices=[], num_workers=num_workers,
            kwargs={"directory": str(tmp_path), "max_trials": 3, **kwargs},
            timeout=240, env={"TF_CPP_MIN_LOG_LEVEL": "2"},
            **({"kill_when_printed": "KILL-ME", "kill_workers": [1]}
               if kwargs else {}))
        return results

    # The tuning worker is killed in trial 1: the chief, which would wait
    # for that trial until the timeout, is stopped too (as after a failure).
    killed = search(kill_trial="1", kill_epoch=0)
    assert [r.killed for r in killed] == [True, True]
    # The rerun resumes trial 1, runs trial 2, and leaves trial 0 alone.
    chief, worker = [r.result for r in search()]
    assert worker["trained"] == ["1", "2"]
    assert chief["end_order"] == ["0", "1", "2"]
    assert chief["saved_ongoing"] == {}
    trials = _checkpoints(os.path.join(tmp_path, "parallel"))
    assert sorted(trials) == ["trial_0", "trial_1", "trial_2"]
    # A rerun of the finished search trains nothing and rewrites nothing.
    # Its first worker is told STOPPED at once: the chief still waits for
    # the second one, which would otherwise find it gone.
    chief, *workers = [r.result for r in search(num_workers=2)]
    assert [w["trained"] for w in workers] == [[], []]
    assert chief["trained"] == []
    assert chief["end_order"] == ["0", "1", "2"]
    assert chief["saved_ongoing"] == {}
    assert _checkpoints(os.path.join(tmp_path, "parallel")) == trials


# --- wrapping a HyperModel, the search space, the learning rate (#33) -------------


class UserHyperModel(keras_tuner.HyperModel):
    """A user's own HyperModel: its space is declared up front, and its
    `fit` changes the epochs and adds a callback."""

    def __init__(self, log, **kwargs):
        super().__init__(**kwargs)
        self.log = log

    def declare_hyperparameters(self, hp):
        hp.Choice("units", [4, 8])

    def build(self, hp):
        model = keras.Sequential([
            keras.Input((tuner_workers.FEATURES,)),
            keras.layers.Dense(hp.get("units"), activation="tanh"),
            keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(
            hp.Float("learning_rate", 1e-3, 1e-2, sampling="log")), "mse")
        return model

    def fit(self, hp, model, *args, callbacks=None, epochs=1, **kwargs):
        record = {"batch_size": kwargs.get("batch_size"), "epochs": epochs,
                  "callbacks": [type(c).__name__ for c in callbacks]}
        self.log.append(record)
        seen = keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: record.__setitem__(
                "trained", epoch + 1))
        return model.fit(*args, callbacks=callbacks + [seen], epochs=2,
                         **kwargs)


def test_a_keras_tuner_hypermodel_is_wrapped_with_its_fit_and_space(
        tmp_path):
    log = []
    hypermodel = mgpu_tuner.StrategyAwareHyperModel(
        UserHyperModel(log, name="user"), per_replica_batch_size=4)
    assert hypermodel.name == "user"
    tuner = keras_tuner.RandomSearch(
        hypermodel, objective="loss", max_trials=1, seed=2,
        directory=str(tmp_path), distribution_strategy=mirrored(2))
    # Its declared space, before any trial.
    assert {"units", "learning_rate"} <= {
        hp.name for hp in tuner.oracle.get_space().space}
    x, y = tuner_workers.data(32)
    tuner.search(x, y, epochs=1, verbose=0)
    trials = _trials(tuner)
    assert [t.status for t in trials] == ["COMPLETED"]
    for trial, record in zip(trials, log):
        # Its fit got the global batch and the trial's backup, and its own
        # epochs won.
        assert record["batch_size"] == 8
        assert "BackupAndRestore" in record["callbacks"]
        assert record["trained"] == 2
        assert _metric(trial, "effective/learning_rate") == pytest.approx(
            2 * trial.hyperparameters.get("learning_rate"), rel=1e-6)
    # docs/tuning.md's retraining recipe goes through the same fit.
    best_hp = tuner.get_best_hyperparameters(1)[0]
    with mirrored(2).scope():
        model = tuner.hypermodel.build(best_hp)
    history = tuner.hypermodel.fit(best_hp, model, x, y, verbose=0)
    assert log[-1]["batch_size"] == 8 and log[-1]["trained"] == 2
    assert history.history["effective/learning_rate"][0] == pytest.approx(
        2 * best_hp.get("learning_rate"), rel=1e-6)


def test_a_hypermodel_that_skips_hypermodel_init_is_wrapped(tmp_path):
    """KerasTuner accepts a HyperModel subclass whose `__init__` does not
    call `HyperModel.__init__` (KerasTuner's own tests have several): it
    has no `name` and no `tunable`, and it is wrapped all the same."""

    class Bare(keras_tuner.HyperModel):
        def __init__(self):
            pass

        def build(self, hp):
            return tuner_workers.build_model(hp)

    bare = Bare()
    assert not hasattr(bare, "name")
    hypermodel = mgpu_tuner.StrategyAwareHyperModel(bare,
                                                    per_replica_batch_size=4)
    assert hypermodel.name is None
    tuner = keras_tuner.RandomSearch(
        hypermodel, objective="loss", max_trials=1, seed=2,
        directory=str(tmp_path))
    x, y = tuner_workers.data(16)
    tuner.search(x, y, epochs=1, verbose=0)
    assert [t.status for t in _trials(tuner)] == ["COMPLETED"]


@pytest.mark.parametrize("lr_scaling", ["linear", None])
def test_a_non_keras_optimizer_is_named_with_what_is_expected(
        tmp_path, lr_scaling):
    def build(hp):
        model = tuner_workers.build_model(hp)
        model.optimizer = True  # Not a Keras optimizer.
        return model

    with pytest.raises(TypeError, match=r"optimizer is True \(a bool\).*"
                                        r"needs a keras\.optimizers\.Optimizer"):
        tuner = keras_tuner.RandomSearch(
            mgpu_tuner.StrategyAwareHyperModel(build, lr_scaling=lr_scaling),
            objective="loss", max_trials=1, directory=str(tmp_path))
        x, y = tuner_workers.data(16)
        tuner.search(x, y, epochs=1, verbose=0)


@pytest.mark.parametrize("optimizer, warned", [
    (lambda lr: keras.optimizers.SGD(0.5), True),
    (lambda lr: keras.optimizers.SGD(lr), False),
    (lambda lr: keras.optimizers.SGD(), False),    # the default: left to hp
])
def test_a_fixed_rate_replaced_by_the_tuned_one_warns_once(
        tmp_path, optimizer, warned):
    def build(hp):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        lr = hp.Float("learning_rate", 1e-3, 1e-2, sampling="log")
        model.compile(optimizer(lr), "mse")
        return model

    with warnings_recorded() as caught:
        tuner = keras_tuner.RandomSearch(
            mgpu_tuner.StrategyAwareHyperModel(build, per_replica_batch_size=4),
            objective="loss", max_trials=2, seed=1, directory=str(tmp_path),
            distribution_strategy=mirrored(2))
        tuner.search(np.ones((8, 4)), np.ones((8, 1)), epochs=1, verbose=0)
    messages = [str(w.message) for w in caught
                if "the hypermodel sets it" in str(w.message)]
    assert len(messages) == (1 if warned else 0), messages
    if warned:
        assert re.search(r"learning_rate=0\.5, .*'learning_rate' "
                         r"hyperparameter: .* x scale \d = .* 0\.5 is not",
                         messages[0])
    trial = _trials(tuner)[-1]
    assert _metric(trial, "effective/learning_rate") == pytest.approx(
        2 * trial.hyperparameters.get("learning_rate"), rel=1e-6)


@contextlib.contextmanager
def warnings_recorded():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


@pytest.mark.parametrize("per_replica", [8, [4, 8], None])
def test_the_search_space_is_complete_before_the_first_trial(
        tmp_path, per_replica):
    shown = []

    class Showing(keras_tuner.RandomSearch):
        def on_trial_begin(self, trial):
            # What KerasTuner's display prints for the trial.
            shown.append(dict(trial.hyperparameters.values))
            super().on_trial_begin(trial)

    tuner = Showing(
        mgpu_tuner.StrategyAwareHyperModel(
            tuner_workers.build_model, per_replica_batch_size=per_replica),
        objective="loss", max_trials=2, seed=1, directory=str(tmp_path),
        distribution_strategy=mirrored(2))
    before = [hp.name for hp in tuner.oracle.get_space().space]
    x, y = tuner_workers.data(32)
    tuner.search(x, y, epochs=1, verbose=0,
                 **({"batch_size": 8} if per_replica is None else {}))
    # KerasTuner's own test_reparameterized_space / test_update_space
    # pattern: the search does not change the space.
    assert [hp.name for hp in tuner.oracle.get_space().space] == before
    if per_replica is None:
        # From search(batch_size=...): recorded, not a hyperparameter.
        assert "per_replica_batch_size" not in before
        assert all("per_replica_batch_size" not in s for s in shown)
        assert _metric(_trials(tuner)[0],
                       "effective/per_replica_batch_size") == 8
    else:
        assert before[0] == "per_replica_batch_size"
        assert all(s["per_replica_batch_size"] in (4, 8) for s in shown)


def test_a_reference_batch_needs_the_per_replica_batch_at_build(tmp_path):
    with pytest.raises(ValueError, match=r"reference_batch_size=4 .*"
                                         r"per_replica_batch_size=<int"):
        keras_tuner.RandomSearch(
            mgpu_tuner.StrategyAwareHyperModel(tuner_workers.build_model,
                                               reference_batch_size=4),
            objective="loss", max_trials=1, directory=str(tmp_path))


def test_a_failed_launch_names_the_first_to_die_and_streams_live(tmp_path):
    lines = []

    class Stream:
        def write(self, text):
            lines.extend(text.splitlines())
            if "[chief] chief up" in text:
                # Seen while every process runs: the victim may die now.
                open(os.path.join(tmp_path, "go"), "w").close()

        def flush(self):
            pass

    with pytest.raises(launcher.WorkerError) as info:
        mgpu_tuner.launch(tuner_workers.die_first, devices=[], num_workers=2,
                          kwargs={"directory": str(tmp_path)}, timeout=180,
                          echo=Stream())
    error = info.value
    assert error.first_failed == [2]
    assert [(r.returncode, r.stopped) for r in error.results] == [
        (-signal.SIGKILL, True), (-signal.SIGKILL, True),
        (-signal.SIGKILL, False)]
    message = str(error)
    assert "First to fail: tuner1, killed by SIGKILL (exit -9)." in message
    assert ("Stopped by the launcher (SIGKILL) after that: chief, tuner0."
            in message)
    assert {"[chief] chief up", "[tuner0] tuner0 up", "[tuner1] tuner1 up",
            "[tuner1] dying"} <= set(lines)
