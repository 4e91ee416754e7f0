"""The tested-models matrix, a run's life: a SIGKILL mid-window and the
resume; the wrapped model saved, loaded and trained on, the inner one
exported for serving; Keras's own `gradient_accumulation_steps` under
every keras-mgpu callback. Same models and replicas as
test_model_training.py.
"""

import contextlib
import signal

import keras
import numpy as np
import pytest

from keras_mgpu import GradientAccumulationModel, mixed_precision
from keras_mgpu.callbacks import BackupAndRestore, DistributedLogger
from keras_mgpu.runtime import training_runtime
from tests.models import workers
from tests.models.catalogue import MODELS
from tests.models.matrix import (
    ACCUM, BACKEND, KILL_PARAMS, LIFECYCLE_PARAMS, MICRO, SAMPLES,
    crossentropy, fit, max_diff, record, subset)


# --- kill and resume ---------------------------------------------------------


@pytest.mark.parametrize("name", KILL_PARAMS)
def test_sigkill_mid_window_resumes_exactly(two_replicas, run_workers, name,
                                            tmp_path):
    """Killed after global batch 8 of 12 (mid-epoch 2, mid-window), once
    the save after batch 6 is written, then rerun from it: the
    uninterrupted run's weights and optimizer steps.

    Not from the save after batch 3 (mid-window): that resume sums the
    window's gradient in another order (the replicas' partial sums come
    back as their total split evenly), which Adam turns into steps of up
    to its learning rate where a gradient is zero up to rounding (the beta
    of a BatchNormalization that another one follows): 2.8e-4 on
    MobileNetV3Small, 4e-3 on EfficientNetV2B0. test_backup_and_restore.py
    kills MLPs mid-window."""
    backup_dir = str(tmp_path / "backup")
    killed = run_workers(workers.train, 1, kwargs={
        "name": name, "backup_dir": backup_dir, "kill_at": 8},
        check=False)[0]
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run_workers(workers.train, 1, kwargs={
        "name": name, "backup_dir": backup_dir})[0].result
    full = workers.train(name, scope=two_replicas)
    diff = max_diff(resumed["weights"], full["weights"])
    record(name, "sigkill_resume", max_abs_diff=diff,
           iterations=[resumed["iterations"], full["iterations"]])
    assert resumed["iterations"] == full["iterations"] == (
        workers.EPOCHS * workers.SAMPLES // (workers.BATCH * workers.ACCUM))
    assert diff <= 1e-6


# --- saving and serving ------------------------------------------------------


@pytest.mark.parametrize("name", LIFECYCLE_PARAMS)
def test_saved_loaded_trained_and_exported(two_replicas, name, tmp_path):
    """The wrapper saved mid-window to `.keras` and loaded trains on as the
    original does; the inner model exported for serving predicts as it
    (float32 rounding: within 1e-4 of the largest output)."""
    entry = MODELS[name]
    x, y = entry.data(SAMPLES)
    path = str(tmp_path / "model.keras")
    with two_replicas():
        # Carried across fits: after 3 micro-batches the save holds half
        # a window.
        model = GradientAccumulationModel(entry.build(), accum_steps=ACCUM,
                                          partial_window="carry")
        model.compile(keras.optimizers.Adam(1e-3), crossentropy())
        model.fit(subset(x, slice(0, 3 * MICRO)), y[:3 * MICRO],
                  batch_size=MICRO, shuffle=False, verbose=0)
        model.save(path)
        loaded = keras.saving.load_model(path)
        for trained in (model, loaded):
            trained.fit(subset(x, slice(3 * MICRO, None)), y[3 * MICRO:],
                        batch_size=MICRO, shuffle=False, verbose=0)
    diff = max_diff(loaded.get_weights(), model.get_weights())
    assert int(keras.ops.convert_to_numpy(loaded.optimizer.iterations)) == 2
    export = str(tmp_path / "served")
    model.inner.export(export, verbose=False)
    import tensorflow as tf

    served = tf.saved_model.load(export)
    batch = subset(x, slice(0, 4))
    if isinstance(batch, dict):
        outputs = served.serve({k: tf.constant(v) for k, v in batch.items()})
    else:
        outputs = served.serve(tf.constant(batch))
    predicted = model.inner.predict(batch, verbose=0)
    # Relative to the largest output: float32 rounding scales with it, and
    # an untrained convnet's logits at inference (BatchNormalization's
    # moving statistics barely moved from 0 and 1) can be large.
    served_diff = float(np.abs(np.asarray(outputs) - predicted).max()
                        / max(1.0, float(np.abs(predicted).max())))
    record(name, "save_load_export", trained_on_diff=diff,
           served_diff=served_diff)
    assert diff <= 1e-6
    assert served_diff <= 1e-4


# --- Keras's own accumulation under every callback ---------------------------


@pytest.mark.parametrize("name", LIFECYCLE_PARAMS)
def test_keras_accumulation_with_every_callback(two_replicas, name, tmp_path):
    """`gradient_accumulation_steps` (on one device on TensorFlow, where it
    fails under `MirroredStrategy`: keras-team/keras#20582) with the
    logger, the backup and the loss-scale monitor: the run without them,
    its updates counted as updates."""
    entry = MODELS[name]
    x, y = entry.data(SAMPLES)
    scope = two_replicas if BACKEND == "jax" else contextlib.nullcontext
    adam = lambda: keras.optimizers.Adam(  # noqa: E731
        1e-3, gradient_accumulation_steps=ACCUM)
    plain = fit(entry, scope, MICRO, x, y, adam).get_weights()
    with scope():
        model = entry.build()
        model.compile(adam(), crossentropy())
        model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0,
                  callbacks=[
                      DistributedLogger(str(tmp_path / "logs"),
                                        update_freq=2, console=False),
                      BackupAndRestore(str(tmp_path / "backup"),
                                       save_freq=3),
                      mixed_precision.LossScaleMonitor()])
    counters = training_runtime(model).counters()
    diff = max_diff(model.get_weights(), plain)
    record(name, "keras_accumulation_callbacks", max_abs_diff=diff)
    assert (counters.global_step, counters.updates_applied,
            counters.updates_skipped) == (4, 2, 0)
    assert diff <= 1e-6
