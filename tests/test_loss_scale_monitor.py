"""LossScaleMonitor: skipped steps, the loss scale and its warnings, the
non-finite counts of FP32OutputHead, log keys and arguments.

Overflow is forced, never left to chance: NaN labels in chosen batches, or
labels so large that the scaled loss gradient is past float16's largest
finite value (65504) until the scale has been halved enough.
"""

import warnings

import keras
import numpy as np
import pytest

from keras_mgpu import GradientAccumulationModel
from keras_mgpu.mixed_precision import LossScaleMonitor
from tests.conftest import mirrored
from tests.test_accumulation import batches_dataset, micro_batches
from tests.test_fp32_output_head import CLASSES, FEATURES, head_model
from tests import workers


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def runtime_warnings(caught) -> list:
    return [str(w.message) for w in caught
            if issubclass(w.category, RuntimeWarning)]


def poisoned_batches(count, bad_batches, size=8):
    batches = [list(b) for b in micro_batches([size] * count)]
    for index in bad_batches:
        batches[index][1] = batches[index][1].copy()
        batches[index][1][0] = np.nan
    return batches_dataset(batches)


def monitored_fit(strategy, data, accum_steps=None, epochs=1,
                  learning_rate=0.01, **monitor_kw):
    with strategy.scope():
        inner = workers.build_mlp()
        model = inner if accum_steps is None else GradientAccumulationModel(
            inner, accum_steps=accum_steps)
        model.compile(keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(learning_rate)), "mse")
    monitor = LossScaleMonitor(**monitor_kw)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            # The window's position, read from the model: whether
            # GradientAccumulationModel logs it is its own choice.
            seen.append(dict(logs, micro_step=getattr(
                self.model, "micro_step", None)))

    history = model.fit(data, epochs=epochs, verbose=0, shuffle=False,
                        callbacks=[monitor, Record()])
    return model, monitor, history, seen


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
@pytest.mark.parametrize("replicas", [1, 2])
def test_monitor_counts_a_skipped_step(policy, replicas):
    # A NaN label in batch 2; under 2 replicas its first sample lands on the
    # first replica (see test_fp32_output_head on Keras's finite check).
    model, monitor, history, seen = monitored_fit(
        mirrored(replicas), poisoned_batches(6, [2]))
    assert int(model.optimizer.iterations.numpy()) == 5
    assert [s["skipped_steps"] for s in seen] == [0, 0, 1, 1, 1, 1]
    assert [s["loss_scale"] for s in seen[:4]] == \
        [2.0 ** 15, 2.0 ** 15, 2.0 ** 14, 2.0 ** 14]
    assert history.history["skipped_steps"] == [1]
    assert history.history["skipped_steps_total"] == [1]
    assert history.history["loss_scale"] == [2.0 ** 14]
    assert monitor.skipped_steps_total == 1


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
@pytest.mark.parametrize("replicas", [1, 2])
def test_monitor_counts_a_skipped_window_once(policy, replicas):
    # 12 micro-batches, accum_steps=4: windows 0-3, 4-7, 8-11. NaN labels in
    # two micro-batches of window 2: one skipped window.
    model, monitor, history, seen = monitored_fit(
        mirrored(replicas), poisoned_batches(12, [5, 6]), accum_steps=4)
    assert int(model.optimizer.iterations.numpy()) == 2
    assert [s["micro_step"] for s in seen] == [1, 2, 3, 0] * 3
    assert [s["skipped_steps"] for s in seen] == [0] * 7 + [1] * 5
    assert history.history["skipped_steps"] == [1]
    assert history.history["loss_scale"] == [2.0 ** 14]


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_monitor_warns_on_consecutive_skips_and_low_scale(policy):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, monitor, history, _ = monitored_fit(
            mirrored(1), poisoned_batches(5, [0, 1, 2, 3]),
            max_consecutive_skips=3, min_scale=2.0 ** 13)
    messages = [str(w.message) for w in caught
                if issubclass(w.category, RuntimeWarning)]
    assert sum("3 consecutive" in m for m in messages) == 1
    # 2**15 halved four times: below 2**13 after the third skip.
    assert sum("fell below min_scale" in m for m in messages) == 1
    assert history.history["skipped_steps"] == [4]
    assert history.history["loss_scale"] == [2.0 ** 11]


def test_monitor_counts_per_epoch_and_total(reset_policy):
    keras.mixed_precision.set_global_policy("mixed_float16")
    _, monitor, history, _ = monitored_fit(
        mirrored(1), poisoned_batches(4, [1]), epochs=2)
    # The same poisoned batch each epoch: one skip per epoch.
    assert history.history["skipped_steps"] == [1, 1]
    assert history.history["skipped_steps_total"] == [1, 2]


@pytest.mark.gpu
def test_monitor_reports_a_head_nested_in_gradient_accumulation():
    # Keras collects no metrics of a model nested in another; the monitor
    # finds the head anyway.
    from keras_mgpu import GradientAccumulationModel

    x = np.random.RandomState(1).randn(16, FEATURES).astype("float32")
    x[5, 1] = np.nan
    keras.utils.set_random_seed(0)
    model = GradientAccumulationModel(head_model(hidden=False), accum_steps=2)
    model.compile(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD()), "sparse_categorical_crossentropy")
    history = model.fit(x, np.zeros(16, "float32"), batch_size=4, epochs=1,
                        verbose=0, shuffle=False,
                        callbacks=[LossScaleMonitor()])
    assert history.history["head_nonfinite_inputs"] == [1]
    assert history.history["head_nonfinite_outputs"] == [CLASSES]
    assert history.history["skipped_steps"] == [1]


# --- What the tests above leave out -----------------------------------------


@pytest.mark.parametrize("value", [0, -1])
def test_max_consecutive_skips_below_one_is_refused_naming_it(value):
    with pytest.raises(ValueError,
                       match=rf"max_consecutive_skips must be >= 1, got "
                             rf"{value}\."):
        LossScaleMonitor(max_consecutive_skips=value)


def test_defaults_and_the_state_before_any_fit():
    monitor = LossScaleMonitor()
    assert (monitor.min_scale, monitor.max_consecutive_skips,
            monitor.log_prefix) == (1.0, 5, "")
    assert monitor.loss_scale is None
    assert (monitor.skipped_steps, monitor.skipped_steps_total,
            monitor.consecutive_skips) == (0, 0, 0)
    assert monitor.nonfinite_counts == {}


def huge_label_batches(count, size=8):
    """Labels of 1e4: the mean squared error's gradient at the float16
    output, 2 * 1e4 / size per sample, times the initial scale 2**15, is
    about 8e7, past float16's 65504; each skipped step halves the scale
    until the gradients (the output's and those behind it) fit."""
    x, _ = workers.regression_data(count * size)
    y = np.full((count * size, 1), 1e4, "float32")
    return batches_dataset([(x[i:i + size], y[i:i + size])
                            for i in range(0, count * size, size)])


def test_every_skipped_step_is_counted_as_the_scale_halves(mixed_float16):
    # The learning rate keeps the applied steps from moving the output
    # towards the labels: whether a step overflows depends on the scale.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, monitor, history, seen = monitored_fit(
            mirrored(1), huge_label_batches(24), learning_rate=1e-12)
    assert model.layers[-1].compute_dtype == "float16"
    skipped = [s["skipped_steps"] for s in seen]
    total = skipped[-1]
    # Every step overflows until the scale is small enough, then none:
    # the first `total` steps skipped in a row, the rest applied.
    assert 5 <= total < 24
    assert skipped == list(range(1, total + 1)) + [total] * (24 - total)
    # No clean run of 2000 steps: the scale only halves, once per skip.
    assert [s["loss_scale"] for s in seen] == [2.0 ** 15 / 2 ** k
                                               for k in skipped]
    assert [s["skipped_steps_total"] for s in seen] == skipped
    assert int(model.optimizer.iterations.numpy()) == 24 - total
    assert history.history["skipped_steps"] == [total]
    assert history.history["loss_scale"] == [2.0 ** 15 / 2 ** total]
    assert (monitor.skipped_steps, monitor.skipped_steps_total,
            monitor.loss_scale) == (total, total, 2.0 ** 15 / 2 ** total)
    assert monitor.consecutive_skips == 0
    # One run of skips: one warning, at the default 5 in a row.
    assert [m for m in runtime_warnings(caught) if "consecutive" in m] == [
        "LossScaleMonitor: 5 consecutive optimizer steps skipped for "
        "non-finite gradients. Look for NaN/inf in the data or activations "
        "(FP32OutputHead counts them), or lower the learning rate."]
    assert all(np.isfinite(w).all() for w in model.get_weights())


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_consecutive_skips_warn_once_per_run_and_never_stop_training(
        policy):
    # Skips at batches 0-2 and 4-5: two runs of at least 2 in a row.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, monitor, history, seen = monitored_fit(
            mirrored(1), poisoned_batches(7, [0, 1, 2, 4, 5]),
            max_consecutive_skips=2)
    messages = runtime_warnings(caught)
    assert [m for m in messages if "consecutive" in m] == [
        "LossScaleMonitor: 2 consecutive optimizer steps skipped for "
        "non-finite gradients. Look for NaN/inf in the data or activations "
        "(FP32OutputHead counts them), or lower the learning rate."] * 2
    # A warning, not an error, and not a stop: every batch ran.
    assert len(seen) == 7 and not model.stop_training
    assert int(model.optimizer.iterations.numpy()) == 2
    assert [s["skipped_steps"] for s in seen] == [1, 2, 3, 3, 4, 5, 5]
    assert history.history["skipped_steps"] == [5]
    assert monitor.consecutive_skips == 0  # batch 6 was applied


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
@pytest.mark.parametrize("min_scale, warned", [(1.0, 1), (0.5, 0)])
def test_a_scale_below_min_scale_warns_once_not_every_batch(policy,
                                                            min_scale,
                                                            warned):
    # Clean batches at a scale of 0.5 from the start: below 1.0 all along,
    # never below 0.5 (not "below" it: equal).
    x, y = workers.regression_data(48)
    model = workers.build_mlp()
    model.compile(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=0.5), "mse")
    monitor = LossScaleMonitor(min_scale=min_scale)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                            shuffle=False, callbacks=[monitor])
    below = [m for m in runtime_warnings(caught) if "min_scale" in m]
    assert below == [
        f"LossScaleMonitor: loss scale 0.5 fell below min_scale="
        f"{min_scale:g}: gradients overflow float16 even unscaled. Check "
        "for NaN/inf inputs or labels, or compute the overflowing part in "
        "float32."] * warned
    assert history.history["loss_scale"] == [0.5, 0.5]
    assert history.history["skipped_steps_total"] == [0, 0]


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_log_prefix_names_every_key_it_adds(policy):
    # A NaN feature in sample 5 (batch 1 of 4): one skipped step, and the
    # head's input and all its outputs for that sample non-finite.
    x = np.random.RandomState(1).randn(16, FEATURES).astype("float32")
    x[5, 1] = np.nan
    keras.utils.set_random_seed(0)
    model = head_model(hidden=False)
    model.compile(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD()), "sparse_categorical_crossentropy")
    seen = []

    class Keys(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(sorted(logs))

    history = model.fit(x, np.zeros(16, "float32"), batch_size=4, epochs=1,
                        verbose=0, shuffle=False,
                        callbacks=[LossScaleMonitor(log_prefix="mp_"),
                                   Keys()])
    scale_keys = ["mp_loss_scale", "mp_skipped_steps",
                  "mp_skipped_steps_total"]
    head_keys = ["mp_head_nonfinite_inputs", "mp_head_nonfinite_outputs"]
    assert sorted(history.history) == sorted(["loss"] + scale_keys
                                             + head_keys)
    # The head's counts from the first batch with a non-finite value on.
    assert seen == [sorted(["loss"] + scale_keys)] + [
        sorted(["loss"] + scale_keys + head_keys)] * 3
    assert history.history["mp_skipped_steps"] == [1]
    assert history.history["mp_loss_scale"] == [2.0 ** 14]
    assert history.history["mp_head_nonfinite_inputs"] == [1]
    assert history.history["mp_head_nonfinite_outputs"] == [CLASSES]


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"],
                         indirect=True)
def test_without_a_loss_scale_nothing_is_skipped_or_logged(policy):
    # A NaN label without a loss scale: the optimizer applies the NaN
    # gradient (no step is skipped), and the monitor adds nothing.
    model = workers.build_mlp()
    model.compile(keras.optimizers.SGD(0.01), "mse")
    assert not isinstance(model.optimizer,
                          keras.optimizers.LossScaleOptimizer)
    monitor = LossScaleMonitor()
    history = model.fit(poisoned_batches(3, [1]), epochs=1, verbose=0,
                        shuffle=False, callbacks=[monitor])
    assert sorted(history.history) == ["loss"]
    assert int(model.optimizer.iterations.numpy()) == 3
    assert monitor.loss_scale is None
    assert (monitor.skipped_steps, monitor.skipped_steps_total) == (0, 0)
