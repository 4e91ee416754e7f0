"""keras_mgpu.compat: gates decided by what Keras does, checked private names,
one warning on an untested Keras."""

import functools
import json
import os
import signal
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from packaging.version import Version

from keras_mgpu import GradientAccumulationModel, compat
from tests import workers
from tests.conftest import mirrored


@pytest.fixture
def keras_reports(monkeypatch):
    """Makes Keras report another version, with the warnings not yet given."""
    monkeypatch.setattr(compat._core, "_warned_versions", set())

    def report(version):
        monkeypatch.setattr(keras, "__version__", version)

    return report


def untested_warnings(caught):
    return [str(w.message) for w in caught
            if issubclass(w.category, compat.UntestedKerasWarning)]


def test_version_range_includes_both_ends():
    tested = compat.VersionRange("3.10.0", "3.15.1")
    assert tested.contains("3.10.0") and tested.contains("3.15.1")
    assert tested.contains(Version("3.12.3"))
    assert not tested.contains("3.9.2") and not tested.contains("3.16.0")
    assert str(tested) == "3.10.0 to 3.15.1"


def test_installed_keras_is_in_the_tested_range():
    # The suite runs on the tested pairs only (docs/compatibility.md); a new
    # pair is added to TESTED_KERAS once the suite passes on it.
    assert compat.TESTED_KERAS.contains(keras.__version__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.warn_if_untested() is False


def test_untested_keras_warns_once_naming_the_version(keras_reports):
    keras_reports("3.16.0")
    assert compat.keras_version() == Version("3.16.0")  # read at call time
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compat.warn_if_untested() is True
        assert compat.warn_if_untested() is True
    [message] = untested_warnings(caught)
    assert "Keras 3.16.0 is installed" in message
    assert f"tested with Keras {compat.TESTED_KERAS}" in message
    for workaround in compat._WORKAROUNDS:
        assert workaround in message


def accumulate(steps=4):
    x, y = workers.regression_data(64)
    with mirrored(2).scope():
        model = GradientAccumulationModel(workers.build_mlp(), accum_steps=2)
        model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    return model


def test_accumulation_on_a_newer_keras_trains_the_same(keras_reports):
    reference = accumulate()
    keras_reports("3.16.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        newer = accumulate()
    assert len(untested_warnings(caught)) == 1
    assert int(newer.optimizer.iterations.numpy()) == 2
    for a, b in zip(reference.get_weights(), newer.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_keras_variable_without_synchronization_is_refused(
        keras_reports, monkeypatch):
    class OldVariable:  # Keras 3.8's signature
        def __init__(self, initializer, shape=None, dtype=None,
                     trainable=True, autocast=True, aggregation="mean",
                     name=None):
            pass

    keras_reports("3.8.0")
    monkeypatch.setattr(keras, "Variable", OldVariable)
    with pytest.warns(compat.UntestedKerasWarning):
        with pytest.raises(compat.KerasInternalsError) as info:
            GradientAccumulationModel(workers.build_mlp(), accum_steps=2)
    message = str(info.value)
    assert "`keras.Variable(synchronization=...)`" in message
    assert "Keras 3.8.0 does not have it" in message
    assert f"keras>={compat.TESTED_KERAS.low}" in message


def test_renamed_all_reduce_is_refused_rather_than_reduced_twice(monkeypatch):
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    monkeypatch.delattr(TFOptimizer, "_all_reduce_sum_gradients")
    with pytest.raises(compat.KerasInternalsError,
                       match=r"TFOptimizer._all_reduce_sum_gradients.*"
                             rf"Keras {keras.__version__} does not have it"):
        GradientAccumulationModel(workers.build_mlp(), accum_steps=2)
    with pytest.raises(compat.KerasInternalsError):
        with compat.gradients_already_reduced(keras.optimizers.SGD()):
            pass


def test_a_keras_whose_epoch_iterator_lacks_the_position_is_refused(
        monkeypatch):
    # A resume that continues a steps_per_epoch stream reads the epoch
    # iterator's position; an iterator without it must not read as "not
    # inside fit" (which would silently restart the stream).
    from keras.src.trainers import epoch_iterator

    monkeypatch.setattr(compat.fit_context, "_recording", False)
    monkeypatch.setattr(compat.trainer_class(), "fit",
                        compat.trainer_class().fit)
    monkeypatch.setattr(epoch_iterator.EpochIterator, "__init__",
                        lambda self, x, **kwargs: None)
    with pytest.raises(compat.KerasInternalsError,
                       match=r"EpochIterator.__init__` setting "
                             r"steps_per_epoch, _current_iterator"):
        compat.record_fits()


def test_changed_signature_is_refused(monkeypatch):
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    monkeypatch.setattr(TFOptimizer, "_all_reduce_sum_gradients",
                        lambda self, grads, variables: grads)
    with pytest.raises(compat.KerasInternalsError,
                       match=r"parameters \('self', 'grads_and_vars'\) "
                             r"\(found \('self', 'grads'\)\)"):
        compat.check_accumulation_support()


def test_multi_worker_fix_refuses_a_changed_trainer(monkeypatch):
    from keras.src.backend.tensorflow import trainer as tf_trainer

    monkeypatch.setattr(compat.keras_trainer, "_multi_worker_fit_enabled",
                        False)
    reduce_before = tf_trainer.reduce_per_replica

    def _maybe_symbolic_build(self, data_batch=None):  # a reshaped trainer
        pass

    monkeypatch.setattr(compat.trainer_class(), "_maybe_symbolic_build",
                        _maybe_symbolic_build)
    with pytest.raises(compat.KerasInternalsError) as info:
        compat.enable_multi_worker_fit()
    trainer = compat.trainer_class().__name__
    assert f"{trainer}._maybe_symbolic_build" in str(info.value)
    assert "keras-team/keras#20585" in str(info.value)
    assert f"Keras {keras.__version__}" in str(info.value)
    # Nothing was half-patched.
    assert tf_trainer.reduce_per_replica is reduce_before
    assert not compat.multi_worker_fit_enabled()


def test_schedule_lookup_needs_the_private_attribute():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    assert compat.learning_rate_schedule(keras.optimizers.SGD(schedule)) is (
        schedule)
    assert compat.learning_rate_schedule(keras.optimizers.SGD(0.1)) is None
    with pytest.raises(compat.KerasInternalsError,
                       match="_learning_rate.*learning-rate scaling"):
        compat.learning_rate_schedule(object())


def test_initial_epoch_hook_needs_the_private_attribute():
    model = workers.build_mlp()
    compat.set_initial_epoch(model, 3)
    assert model._initial_epoch == 3
    with pytest.raises(compat.KerasInternalsError, match="_initial_epoch"):
        compat.set_initial_epoch(object(), 3)


def test_the_running_fit_is_recorded_with_its_callbacks_and_data():
    compat.record_fits()
    seen, after_validation = [], []

    class Probe(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen.append(compat.running_fit(self.model))

        def on_epoch_end(self, epoch, logs=None):
            # Validation's epoch iterator, made inside this fit, is not it.
            after_validation.append(compat.fit_epoch_iterator(self.model))

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    probe, other = Probe(), keras.callbacks.History()
    x, y = np.ones((4, 2)), np.ones((4, 1))
    model.fit(x, y, verbose=0, callbacks=[probe, [other]],
              validation_data=(x, y), steps_per_epoch=2, batch_size=1)
    running = seen[0]
    assert running.model is model and running.callbacks == [probe, other]
    assert running.epoch_iterator.steps_per_epoch == 2
    assert after_validation == [running.epoch_iterator]
    assert compat.running_fit(model) is None  # fit has returned

    # A hand-written loop is not a fit.
    keras.callbacks.CallbackList([probe], model=model).on_train_begin()
    assert seen[1] is None

    # A fit that raised is over too; the next one records its own callbacks.
    failing = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: 1 / 0)
    with pytest.raises(ZeroDivisionError) as failed:
        model.fit(x, y, verbose=0, callbacks=[probe, failing])
    assert failing in seen[2].callbacks
    assert compat.running_fit(model) is None
    model.fit(x, y, verbose=0,
              callbacks=keras.callbacks.CallbackList([probe], model=model))
    assert failed.value is not None
    assert seen[3].callbacks == [probe]


def test_logits_are_recovered_by_this_keras():
    # FP32OutputHead relies on it; a Keras that stops reading the attached
    # logits makes the head warn at build time.
    assert compat.logits_recovered()


def test_sample_count_is_none_before_compile():
    model = workers.build_mlp()
    assert compat.examples_count(model) is None
    model.compile("sgd", "mse")
    assert compat.examples_count(model) is not None
    assert compat.examples_seen(model) == 0.0


def test_reshaped_kerastuner_callback_is_refused():
    import keras_tuner
    from keras_tuner.src.engine import tuner_utils

    assert compat.tuner_and_trial([keras.callbacks.History()]) is None
    callback = tuner_utils.TunerCallback(tuner=None, trial=None)
    with pytest.raises(compat.KerasInternalsError,
                       match=f"KerasTuner {keras_tuner.__version__}"):
        compat.tuner_and_trial([callback])


def test_summary_scope_sets_and_restores_tensorflows_summary_state(tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path))
    step = tf.Variable(-1, dtype=tf.int64)
    with compat.summary_scope(writer, step, lambda: step >= 0):
        # Where the condition fails nothing is written; where it holds, at
        # the variable's value.
        assert not tf.summary.scalar("x", 1.0)
        step.assign(7)
        assert tf.summary.scalar("x", 2.0)
    # Outside, TensorFlow's own state is back: no writer, no step.
    assert tf.summary.experimental.get_step() is None
    assert not tf.summary.scalar("x", 3.0)
    writer.flush()
    [path] = tf.io.gfile.glob(str(tmp_path / "events.out.tfevents.*"))
    written = [(e.step, float(tf.make_ndarray(v.tensor)))
               for e in tf.compat.v1.train.summary_iterator(path)
               for v in e.summary.value]
    assert written == [(7, 2.0)]


def test_summary_scope_needs_tensorflows_summary_state(monkeypatch):
    from tensorflow.python.ops import summary_ops_v2

    monkeypatch.delattr(summary_ops_v2, "_summary_state")
    with pytest.raises(compat.KerasInternalsError, match="_summary_state"):
        compat.summary_scope(None, None, None)


def _h5_contents(data: bytes) -> dict:
    """Every group and dataset of an HDF5 file: name -> (values, attributes)."""
    import io

    import h5py

    contents = {}

    def visit(name, item):
        values = item[()] if isinstance(item, h5py.Dataset) else None
        contents[name] = (values, dict(item.attrs))

    with h5py.File(io.BytesIO(data), "r") as f:
        f.visititems(visit)
    return contents


def _weights_test_model(accumulate=False):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((workers.FEATURES,)),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.2, seed=1),
        keras.layers.Dense(1),
    ])
    if accumulate:
        model = GradientAccumulationModel(model, accum_steps=2)
    model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    return model


@pytest.mark.parametrize("accumulate", [False, True],
                         ids=["plain", "accumulation"])
def test_weights_file_is_what_save_weights_writes(tmp_path, accumulate):
    x, y = workers.regression_data(64)
    model = _weights_test_model(accumulate)
    model.fit(x, y, batch_size=16, verbose=0)
    layout = compat.weights_layout(model)
    ours = compat.weights_file(layout.read())
    model.save_weights(str(tmp_path / "keras.weights.h5"))
    theirs = _h5_contents((tmp_path / "keras.weights.h5").read_bytes())
    mine = _h5_contents(ours)
    assert sorted(mine) == sorted(theirs)
    assert any("optimizer" in name for name in mine)
    for name, (values, attributes) in theirs.items():
        assert attributes == mine[name][1], name
        if values is not None:
            np.testing.assert_array_equal(mine[name][0], values, err_msg=name)
    # And Keras loads it back.
    (tmp_path / "ours.weights.h5").write_bytes(ours)
    fresh = _weights_test_model(accumulate)
    fresh.fit(x[:16], y[:16], batch_size=16, verbose=0)  # builds everything
    fresh.load_weights(str(tmp_path / "ours.weights.h5"))
    # `weights`: what save_weights holds (not the RNG seed states).
    for a, b in zip(fresh.weights + fresh.optimizer.variables,
                    model.weights + model.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_weights_layout_reads_the_values_of_the_moment(tmp_path):
    x, y = workers.regression_data(64)
    model = _weights_test_model()
    model.fit(x, y, batch_size=16, verbose=0)
    layout = compat.weights_layout(model)
    before = layout.read()
    before_file = compat.weights_file(before)
    model.fit(x, y, batch_size=16, verbose=0)  # trains the same variables
    # The snapshot is a copy: training did not change it.
    assert compat.weights_file(before) == before_file
    model.save_weights(str(tmp_path / "after.weights.h5"))
    after = _h5_contents((tmp_path / "after.weights.h5").read_bytes())
    # The same layout, read again, sees the new values without a new walk.
    again = _h5_contents(compat.weights_file(layout.read()))
    old = _h5_contents(before_file)
    kernel = "layers/dense/vars/0"
    assert not np.array_equal(old[kernel][0], after[kernel][0])
    for name, (values, _) in after.items():
        if values is not None:
            np.testing.assert_array_equal(again[name][0], values, err_msg=name)


def test_weights_layout_needs_keras_walk_of_the_model(monkeypatch):
    from keras.src.saving import saving_lib

    model = _weights_test_model()
    original = saving_lib._save_state
    monkeypatch.setattr(saving_lib, "_save_state",
                        lambda obj, weights_store, *args, **kwargs: None)
    with pytest.raises(compat.KerasInternalsError,
                       match=r"_save_state.*BackupAndRestore"):
        compat.weights_layout(model)
    monkeypatch.setattr(saving_lib, "_save_state", original)
    monkeypatch.delattr(saving_lib, "H5IOStore")
    with pytest.raises(compat.KerasInternalsError, match="H5IOStore"):
        compat.weights_layout(model)


def test_a_weights_layout_reads_into_the_arrays_of_an_earlier_read(
        tmp_path):
    x, y = workers.regression_data(64)
    model = _weights_test_model()
    model.fit(x, y, batch_size=16, verbose=0)
    layout = compat.weights_layout(model)
    first = layout.read()
    arrays = [id(a) for _, _, values in first for _, a in values]
    model.fit(x, y, batch_size=16, verbose=0)
    second = layout.read(into=first)
    assert [id(a) for _, _, values in second for _, a in values] == arrays
    model.save_weights(str(tmp_path / "now.weights.h5"))
    now = _h5_contents((tmp_path / "now.weights.h5").read_bytes())
    for name, (values, _) in _h5_contents(
            compat.weights_file(second)).items():
        if values is not None:
            np.testing.assert_array_equal(values, now[name][0], err_msg=name)


# --- steps_per_execution on several replicas --------------------------------


@pytest.mark.parametrize("unknown_length", [False, True])
def test_steps_per_execution_on_two_replicas_matches_one(unknown_length):
    """Plain `fit` and `evaluate` with steps_per_execution=4 on 2 replicas
    (Keras's own loop fails there) against 1 replica, one step per call, on
    13 batches per epoch: the last call of an epoch has 1 batch left."""
    compat.enable_multi_step_fit()
    results = {}
    for replicas, steps in ((1, 1), (2, 4)):
        x, y = workers.regression_data(100)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        if unknown_length and replicas > 1:
            # (Keras's own one-step function trains one empty step more per
            # epoch on such data, so the reference has a known length.)
            dataset = dataset.filter(lambda x, y: True)
        with mirrored(replicas).scope():
            model = workers.build_mlp()
            model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"],
                          steps_per_execution=steps)
        history = model.fit(dataset, epochs=2, verbose=0, shuffle=False)
        results[replicas] = (
            [w.numpy() for w in model.trainable_variables],
            int(model.optimizer.iterations.numpy()),
            history.history,
            model.evaluate(dataset, verbose=0),
        )
    (w1, it1, h1, e1), (w2, it2, h2, e2) = results[1], results[2]
    assert it1 == it2 == 26
    assert max(float(np.abs(a - b).max()) for a, b in zip(w1, w2)) < 1e-5
    for key in h1:
        np.testing.assert_allclose(h2[key], h1[key], rtol=1e-5)
    np.testing.assert_allclose(e2, e1, rtol=1e-5)


def test_multi_step_fix_refuses_a_changed_trainer(monkeypatch):
    from keras.src.backend.tensorflow import trainer as tf_trainer

    monkeypatch.setattr(compat.keras_trainer, "_multi_step_fit_enabled",
                        False)
    monkeypatch.setattr(compat.trainer_class(), "_make_function",
                        lambda self, step, jit=None: None)
    with pytest.raises(compat.KerasInternalsError,
                       match=rf"{compat.trainer_class().__name__}"
                             r"._make_function.*steps_per_execution fix"):
        compat.enable_multi_step_fit()
    assert not compat.multi_step_fit_enabled()


# --- Gradient clipping under a strategy --------------------------------------


@functools.lru_cache(maxsize=None)
def _clipped_weights(optimizer, replicas, exact, policy="float32"):
    """`workers.clipped_fit` on `replicas` under the dtype `policy`, with
    the clipping fix on, or off (Keras's own optimizer, as if never
    enabled)."""
    compat.enable_exact_clipping()
    compat.optimizer._exact_clipping_enabled = exact
    keras.mixed_precision.set_global_policy(policy)
    try:
        return workers.clipped_fit(mirrored(replicas), optimizer)
    finally:
        keras.mixed_precision.set_global_policy("float32")
        compat.optimizer._exact_clipping_enabled = True


def _max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


@pytest.mark.parametrize("optimizer", workers.CLIPPING)
def test_clipping_on_two_replicas_matches_one_device(optimizer):
    """Plain `fit` with clipnorm, clipvalue or global_clipnorm on 2
    replicas, with compat.enable_exact_clipping, against the same global
    batches on one device (Keras's own optimizer)."""
    one = _clipped_weights(optimizer, 1, exact=False)
    start = workers.initial_weights(workers.build_mlp())
    assert _max_diff(one, start) > 1e-2
    assert _max_diff(_clipped_weights(optimizer, 2, exact=True), one) < 1e-5


def test_clipping_on_one_device_is_unchanged_to_the_bit():
    one = _clipped_weights("adam_global_clipnorm", 1, exact=False)
    for a, b in zip(_clipped_weights("adam_global_clipnorm", 1, exact=True),
                    one):
        np.testing.assert_array_equal(a, b)


def test_stock_keras_still_clips_each_replica():
    """What compat.enable_exact_clipping works around, in the installed
    Keras's own optimizer (the fix switched off): under MirroredStrategy(2)
    each replica's gradient is clipped before the all-reduce, so a clipped
    `fit` ends away from one device. If this fails, Keras clips the
    all-reduced gradient itself, and the fix can go."""
    off = _max_diff(_clipped_weights("adam_global_clipnorm", 2, exact=False),
                    _clipped_weights("adam_global_clipnorm", 1, exact=False))
    assert off > 1e-3, (
        f"Keras {keras.__version__} clips the all-reduced gradient itself "
        f"({off:.1e} from one device): compat.enable_exact_clipping is no "
        "longer needed.")


def test_clipping_under_a_loss_scale_matches_one_device():
    """mixed_float16: LossScaleOptimizer clips through its inner optimizer."""
    one, two = (_clipped_weights("adam_global_clipnorm", replicas,
                                 exact=True, policy="mixed_float16")
                for replicas in (1, 2))
    # float16 sums 16 rows per replica instead of 32: about 1e-4 apart;
    # clipping per replica ends about 2e-2 away.
    assert _max_diff(two, one) < 1e-3


def test_clipping_reduces_once_where_keras_reduces_before_clipping():
    """On a Keras that all-reduces before it clips (as a fix upstream
    would), the gradients arrive all-reduced and are not reduced again."""
    compat.enable_exact_clipping()

    class ReducesFirst(keras.optimizers.SGD):
        def _backend_apply_gradients(self, grads, variables):
            pairs = self._all_reduce_sum_gradients(zip(grads, variables))
            super()._backend_apply_gradients([g for g, _ in pairs],
                                             variables)

        def _backend_update_step(self, grads, variables, learning_rate):
            # Keras's, without its all-reduce (made above).
            tf.__internal__.distribute.interim.maybe_merge_call(
                self._distributed_tf_update_step,
                self._distribution_strategy,
                list(zip(grads, [v.value for v in variables])),
                learning_rate)

    # (Clipping by value: a gradient summed twice is clipped differently.)
    def optimizer():
        return ReducesFirst(0.1, clipvalue=0.01)

    one = workers.clipped_fit(mirrored(1), optimizer)
    assert _max_diff(workers.clipped_fit(mirrored(2), optimizer), one) < 1e-5


def test_exact_clipping_refuses_a_changed_optimizer(monkeypatch):
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    monkeypatch.setattr(compat.optimizer, "_exact_clipping_enabled", False)
    monkeypatch.setattr(TFOptimizer, "_clip_gradients",
                        lambda self, grads_and_vars: grads_and_vars)
    with pytest.raises(compat.KerasInternalsError,
                       match=r"TFOptimizer._clip_gradients.*exact gradient "
                             r"clipping under a strategy") as info:
        compat.enable_exact_clipping()
    assert f"Keras {keras.__version__}" in str(info.value)
    assert not compat.exact_clipping_enabled()


# --- KerasTuner's oracle state ------------------------------------------------


def _oracle(directory, max_trials):
    import keras_tuner

    space = keras_tuner.HyperParameters()
    space.Float("x", 0.0, 1.0)
    oracle = keras_tuner.oracles.RandomSearchOracle(
        objective="loss", max_trials=max_trials, seed=1,
        hyperparameters=space)
    oracle._set_project_dir(str(directory), "project")
    return oracle


def _end_one_trial(oracle):
    trial = oracle.create_trial("tuner0")
    oracle.update_trial(trial.trial_id, {"loss": 1.0})
    trial.status = "COMPLETED"
    oracle.end_trial(trial)
    return trial


def _saved_ongoing(directory):
    with open(os.path.join(directory, "project", "oracle.json")) as f:
        return json.load(f)["ongoing_trials"]


def test_kerastuner_still_saves_an_ended_trial_as_ongoing(tmp_path):
    # What compat.enable_tuner_state_fix works around, in the installed
    # KerasTuner's own end_trial (the fix leaves it alone): if this fails,
    # KerasTuner saves after ending the trial, and the fix can go.
    oracle = _oracle(tmp_path, max_trials=2)
    trial = _end_one_trial(oracle)
    assert oracle.ongoing_trials == {}
    assert _saved_ongoing(tmp_path) == {"tuner0": trial.trial_id}


def test_tuner_state_fix_retries_no_ended_trial_and_saves_when_stopped(
        tmp_path):
    compat.enable_tuner_state_fix()
    assert compat.enable_tuner_state_fix() is False  # idempotent
    ended = _end_one_trial(_oracle(tmp_path, max_trials=3))
    interrupted = _oracle(tmp_path, max_trials=3)
    interrupted.reload()
    running = interrupted.create_trial("tuner0")
    assert running.trial_id != ended.trial_id
    # A rerun of that project: its file lists both as ongoing (the ended
    # one by KerasTuner's ordering); only the running one is retried.
    rerun = _oracle(tmp_path, max_trials=3)
    rerun.reload()
    assert rerun.trials[ended.trial_id].status == "COMPLETED"
    again = rerun.create_trial("tuner1")
    assert again.trial_id == running.trial_id
    again.status = "COMPLETED"
    rerun.update_trial(again.trial_id, {"loss": 0.5})
    rerun.end_trial(again)
    last = _end_one_trial(rerun)
    assert last.trial_id not in (ended.trial_id, running.trial_id)
    assert rerun.create_trial("tuner0").status == "STOPPED"
    assert rerun.end_order == [ended.trial_id, again.trial_id, last.trial_id]
    assert _saved_ongoing(tmp_path) == {}


# --- The record of workarounds and the shapes of copied Keras functions -------


def test_docs_show_the_workarounds_as_the_record_says():
    from pathlib import Path

    docs = (Path(__file__).parents[1] / "docs" / "compatibility.md").read_text()
    assert compat.workarounds_table() in docs, (
        "docs/compatibility.md's workaround table differs from "
        "compat.WORKAROUNDS; paste keras_mgpu.compat.workarounds_table() "
        "there.")
    for record in compat.WORKAROUNDS:
        assert record.upstream.startswith("https://github.com/")
        assert record.works_around and record.applied and record.remove_when


def test_the_package_re_exports_every_module_and_looks_up_in_one_place():
    # `keras_mgpu.compat.<name>` is the one path the rest of keras-mgpu
    # uses, whichever module defines the name; and only `_core` reads a
    # private name or module (`_lookup`, `_import_module`), so that one hook
    # sees every lookup (tests/mutation_workers.py).
    import ast
    import importlib
    import inspect
    import pkgutil

    modules = [info.name for info in pkgutil.iter_modules(compat.__path__)
               if info.name != "__main__"]
    assert {"_core", "registry", "keras_trainer"} <= set(modules)
    for name in modules:
        module = importlib.import_module(f"keras_mgpu.compat.{name}")
        tree = ast.parse(inspect.getsource(module))
        defined = {node.name for node in tree.body if isinstance(
            node, (ast.FunctionDef, ast.ClassDef))} | {
            target.id for node in tree.body if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name)}
        for public in sorted(n for n in defined if not n.startswith("_")):
            assert getattr(compat, public, None) is getattr(module, public), (
                f"compat/{name}.py: {public} is not re-exported by "
                "compat/__init__.py")
        if name != "_core":
            called = {node.func.id for node in ast.walk(tree)
                      if isinstance(node, ast.Call)
                      and isinstance(node.func, ast.Name)}
            assert not called & {"_lookup", "_import_module"}, (
                f"compat/{name}.py looks up past _require/_require_module")


def test_a_shape_is_the_code_not_its_comments_docstring_or_layout():
    import ast

    def shape(source):
        return compat._shape_of_tree(ast.parse(source).body[0])

    base = shape('def f(x):\n    """Doc."""\n    # A note.\n    return x + 1\n')
    assert shape("def f(x):\n    return (x\n            + 1)\n") == base
    assert shape("def f(x):\n    return x + 2\n") != base
    assert shape("def f(y):\n    return y + 1\n") != base


def test_the_installed_keras_copies_have_known_shapes():
    # Each copied original of this Keras is one `_KNOWN_SHAPES` lists (a
    # new Keras fails here, naming the shape to review and add).
    for name, (owner, used_for) in compat._copied_originals().items():
        assert compat._copied_variant(owner, name, used_for) in (
            "graph_fetch", "host_fetch_one_step", "reduce_first_batch",
            "h5_store")


# --- Ctrl-C during fit: taken at the next batch ------------------------------


class _Interrupted:
    """A log value whose conversion is interrupted, as a Ctrl-C landing in
    Keras's conversion interrupts it."""

    def __float__(self):
        raise KeyboardInterrupt


def test_stock_keras_still_swallows_ctrl_c_in_its_log_conversion():
    from keras.src.utils import python_utils

    logs = python_utils.pythonify_logs({"loss": _Interrupted()})
    assert isinstance(logs["loss"], _Interrupted)


def _compiled_mlp():
    """The suite's MLP, compiled, and 32 samples: 4 steps of 8 an epoch."""
    model = workers.build_mlp()
    model.compile("sgd", "mse")
    return (model, *workers.regression_data(32))


def _fit_with_ctrl_c_as_epoch_2_begins(callback):
    """A 3-epoch `fit` of 4 steps an epoch, to which a real SIGINT comes
    while TensorFlow makes the data iterator of epoch 2 (Keras makes one an
    epoch): from `TensorShape.__len__`, which TensorFlow's eager fast path
    calls there, where a lost Ctrl-C was measured. The optimizer steps done,
    or KeyboardInterrupt."""
    from tensorflow.python.data.ops import iterator_ops
    from tensorflow.python.framework import tensor_shape

    state = {"epoch": 0, "armed": False}
    length = tensor_shape.TensorShape.__len__
    create = iterator_ops.OwnedIterator._create_iterator

    def interrupting_len(self):
        if state["armed"]:
            state["armed"] = False
            signal.raise_signal(signal.SIGINT)
        return length(self)

    def create_iterator(self, dataset):
        state["armed"] = state["epoch"] == 1
        try:
            return create(self, dataset)
        finally:
            state["armed"] = False

    class Epochs(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            state["epoch"] = epoch

    tensor_shape.TensorShape.__len__ = interrupting_len
    iterator_ops.OwnedIterator._create_iterator = create_iterator
    try:
        model, x, y = _compiled_mlp()
        model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False,
                  callbacks=[Epochs(), callback])
        return int(model.optimizer.iterations.numpy())
    finally:
        tensor_shape.TensorShape.__len__ = length
        iterator_ops.OwnedIterator._create_iterator = create


def test_tensorflow_still_loses_a_ctrl_c_as_an_epochs_iterator_is_made():
    # In a child: TensorFlow may corrupt the heap there. Python's own
    # handler, and no keras-mgpu callback: stock `fit`.
    code = (
        "import keras\n"
        "from tests.test_compat import _fit_with_ctrl_c_as_epoch_2_begins\n"
        "steps = _fit_with_ctrl_c_as_epoch_2_begins(keras.callbacks.Callback())\n"
        "print('STEPS', steps)\n")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True,
        timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert "KeyboardInterrupt" not in proc.stderr, proc.stderr[-3000:]
    # Lost (all 12 steps trained), or a crash of the corrupted heap.
    assert (proc.returncode == 0 and "STEPS 12" in proc.stdout) or (
        proc.returncode in (-signal.SIGABRT, -signal.SIGSEGV)), (
        proc.returncode, proc.stdout, proc.stderr[-3000:])


def test_a_ctrl_c_during_fit_ends_it_at_the_next_batch(python_sigint_handler):
    from keras_mgpu.runtime import RuntimeCallback

    callback = RuntimeCallback()
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    steps = {}

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps["done"] = int(self.model.optimizer.iterations.numpy())

    with pytest.raises(KeyboardInterrupt) as raised:
        _fit_with_ctrl_c_as_epoch_2_begins(
            keras.callbacks.CallbackList([callback, Steps()]))
    assert raised.traceback[-1].name == "raise_deferred_ctrl_c"
    # Epoch 1's 4 steps, none of epoch 2's; no corrupted heap.
    assert steps["done"] == 4


def _ctrl_c_at(hook, times=1):
    """A callback sending this process `times` real SIGINTs from `hook`,
    the first time it runs."""
    sent = []

    def send(self, *args, **kwargs):
        if not sent:
            sent.append(hook)
            for _ in range(times):
                signal.raise_signal(signal.SIGINT)

    return type("CtrlC", (keras.callbacks.Callback,), {hook: send})()


@pytest.mark.parametrize("hook, batches", [
    ("on_train_batch_end", 1),  # the next batch
    ("on_test_batch_end", 4),  # validation: its next batch
    ("on_train_end", 4),  # after the last batch: as `fit` returns
])
def test_a_ctrl_c_is_raised_at_the_next_batch_or_as_fit_returns(
        python_sigint_handler, hook, batches):
    from keras_mgpu.runtime import RuntimeCallback

    runtime_callback = RuntimeCallback()
    model, x, y = _compiled_mlp()
    with pytest.raises(KeyboardInterrupt) as raised:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  validation_data=(x, y),
                  callbacks=[_ctrl_c_at(hook), runtime_callback])
    assert raised.traceback[-1].name == "raise_deferred_ctrl_c"
    assert int(model.optimizer.iterations.numpy()) == batches


def test_a_second_ctrl_c_raises_at_once_and_the_next_fit_forgets_both(
        python_sigint_handler):
    from keras_mgpu.runtime import RuntimeCallback

    runtime_callback = RuntimeCallback()
    model, x, y = _compiled_mlp()
    with pytest.raises(KeyboardInterrupt) as raised:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[runtime_callback,
                             _ctrl_c_at("on_train_batch_end", times=2)])
    # Raised where the second SIGINT landed, not at the next batch.
    assert [entry.name for entry in raised.traceback][-2:] == [
        "send", "_on_sigint"]
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[runtime_callback])
    assert int(model.optimizer.iterations.numpy()) == 1 + 4
    # Outside a fit, a Ctrl-C raises where it lands.
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)


def test_a_programs_own_sigint_handler_is_kept(python_sigint_handler):
    from keras_mgpu.runtime import RuntimeCallback

    def own(signum, frame):
        pass

    signal.signal(signal.SIGINT, own)
    RuntimeCallback()
    assert signal.getsignal(signal.SIGINT) is own
