"""Training programs for the backup's crash-and-resume tests on JAX.

Each is a worker entry point (run by `keras_mgpu.launcher`, with
`KERAS_BACKEND=jax`): it trains on 2 replicas (a `DataParallel` over the 2
host devices `XLA_FLAGS` forces, or over one device in each of 2 processes
of `jax.distributed`), prints `STEP <n>;` after every batch so that a test
can kill it there, and returns the final weights and optimizer steps.
"""

import json
import os

import numpy as np

from tests.backup_workers import marker
from tests.workers import (FEATURES, HOLD_SECONDS, finish_backup_writes,
                           initial_weights, regression_data)

GLOBAL_BATCH = 16


def join_processes() -> tuple:
    """With a `TF_CONFIG` of several workers (the launcher's): joins
    `jax.distributed` at the first worker's address, one process per
    worker; (this process's index, processes)."""
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    workers = config.get("cluster", {}).get("worker", [])
    if len(workers) < 2:
        return 0, 1
    import jax

    index = int(config["task"]["index"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(workers[0], num_processes=len(workers),
                               process_id=index, initialization_timeout=120)
    return index, len(workers)


def two_replica_scope(model_parallel=False):
    """The scope of 2 replicas across this process's devices (or the
    processes' devices, one each). `model_parallel`: instead, one replica
    whose hidden layer is split over the 2 devices (its kernel's columns:
    half in each process when there are 2)."""
    import jax
    import keras

    devices = jax.devices()[:2]
    if model_parallel:
        mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"),
                                             devices)
        layouts = keras.distribution.LayoutMap(mesh)
        layouts[".*hidden/kernel"] = (None, "model")
        distribution = keras.distribution.ModelParallel(
            layout_map=layouts, batch_dim_name="batch")
    else:
        distribution = keras.distribution.DataParallel(devices=devices)
    # Each process feeds its own rows (`train` picks them).
    distribution.auto_shard_dataset = False
    keras.distribution.set_distribution(distribution)
    return distribution.scope()


def train(backup_dir, accum_steps=None, mode="window", kill_at=None,
          hold_workers=None, epochs=3, steps=8, save_freq=4,
          preset="preemptible", model_parallel=False, local_save_freq=None):
    index, processes = join_processes()
    scope = two_replica_scope(model_parallel)

    import keras

    import keras_mgpu
    from keras_mgpu.callbacks import BackupAndRestore
    from keras_mgpu.runtime import training_runtime

    keras.utils.set_random_seed(0)
    x, y = regression_data(GLOBAL_BATCH * steps)
    # Each process feeds its rows of every global batch, in order (all of
    # them where one replica spans the processes).
    part, parts = (0, 1) if model_parallel else (index, processes)
    local = GLOBAL_BATCH // parts
    rows = (np.arange(len(x)).reshape(steps, parts, local)[:, part]
            .reshape(-1))
    x, y = x[rows], y[rows]
    with scope:
        inner = keras.Sequential([
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="tanh", name="hidden"),
            keras.layers.Dropout(0.3, seed=1),
            keras.layers.Dense(1),
        ])
        inner.set_weights(initial_weights(inner))
        model = inner
        if accum_steps:
            model = keras_mgpu.GradientAccumulationModel(
                inner, accum_steps=accum_steps, mode=mode)
        model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])

    step = [0]

    def on_batch_end(batch, logs):
        if step[0] == kill_at:
            # The saves before this step are committed when the test kills:
            # only the chief writes, and the test kills every process as
            # soon as any prints the marker, so each waits for the chief.
            finish_backup_writes()
            if processes > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices(f"committed {kill_at}")
        marker(f"STEP {step[0]};")
        if step[0] == kill_at and (hold_workers is None
                                   or index in hold_workers):
            # Held until the test's signal: a SIGKILL ends the process
            # here, a SIGTERM lets the backup save at the next batch and
            # exit (the processes not held wait for this one in the next
            # step's collectives).
            backup._preemption.requested.wait(timeout=HOLD_SECONDS)
        step[0] += 1

    def on_epoch_begin(epoch, logs):
        step[0] = epoch * steps

    # A local tier beside backup_dir when local_save_freq is given.
    backup = BackupAndRestore.from_preset(
        preset, backup_dir, save_freq=save_freq,
        local_dir=None if local_save_freq is None else f"{backup_dir}-local",
        local_save_freq=local_save_freq)
    model.fit(x, y, batch_size=local, epochs=epochs, verbose=0,
              shuffle=False, callbacks=[
                  keras.callbacks.LambdaCallback(
                      on_epoch_begin=on_epoch_begin),
                  backup,
                  keras.callbacks.LambdaCallback(on_batch_end=on_batch_end),
              ])
    return {
        "weights": [w.tolist() for w in whole_weights(model)],
        "iterations": int(model.optimizer.iterations.numpy()),
        "global_step": training_runtime(model).global_step,
    }


def whole_weights(model) -> list:
    """The model's weights as host arrays, each whole where its shards lie
    in several processes (gathered from all: every process calls this)."""
    from jax.experimental import multihost_utils

    return [np.asarray(multihost_utils.process_allgather(v.value, tiled=True))
            for v in model.weights]
