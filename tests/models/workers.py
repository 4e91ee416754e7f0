"""The model matrix's training program, in the test process (the
uninterrupted reference) and in a child that SIGKILLs itself (the resume
test): a catalogue model wrapped for window accumulation, backed up every
few batches."""

from __future__ import annotations

import os
import signal

import numpy as np

BATCH = 8  # global micro-batch
ACCUM = 2
SAMPLES = 48  # 6 micro-batches an epoch: 3 windows
EPOCHS = 2
SAVE_FREQ = 3  # batches, so saves land mid-window


def train(name, backup_dir=None, kill_at=None, scope=None):
    """Trains catalogue model `name`; SIGKILLs itself after global batch
    `kill_at`. Returns the weights and the optimizer's iterations. Without
    `scope` it sets up 2 devices itself (a child process)."""
    import contextlib

    import keras

    if scope is None:
        scope = _two_devices()
    from keras_mgpu import GradientAccumulationModel
    from keras_mgpu.callbacks import BackupAndRestore
    from tests.models.catalogue import MODELS

    entry = MODELS[name]
    x, y = entry.data(SAMPLES)
    seen = []
    backup = None if backup_dir is None else BackupAndRestore(
        backup_dir, save_freq=SAVE_FREQ)

    def on_batch_end(batch, logs):
        seen.append(batch)
        if len(seen) == kill_at:
            # The save in flight finishes first, so the resume starts from
            # the same generation on every run, not from whichever write
            # beat the kill.
            backup._finish_write()
            os.kill(os.getpid(), signal.SIGKILL)

    callbacks = [keras.callbacks.LambdaCallback(on_batch_end=on_batch_end)]
    if backup is not None:
        callbacks.insert(0, backup)
    with (scope() if scope else contextlib.nullcontext()):
        model = GradientAccumulationModel(entry.build(), accum_steps=ACCUM)
        model.compile(keras.optimizers.Adam(1e-3),
                      keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                  verbose=0, callbacks=callbacks)
    return {"weights": [np.asarray(w).tolist() for w in model.get_weights()],
            "iterations": int(keras.ops.convert_to_numpy(
                model.optimizer.iterations))}


def _two_devices():
    import keras

    if keras.backend.backend() == "jax":
        import jax

        distribution = keras.distribution.DataParallel(
            devices=jax.devices()[:2])
        return distribution.scope
    import keras_mgpu

    return keras_mgpu.auto_strategy(virtual_cpus=2).scope
