"""The worker of tests/test_elastic_launch.py: a `GradientAccumulationModel`
with a fixed global batch of a fixed micro-batch per replica under
`MultiWorkerMirroredStrategy`, with a `BackupAndRestore`, where one worker
slot (named by `SLOT` in its environment) can be made to fail."""

import os
import signal

# Per replica; the data is batched to a micro-batch on every replica: 6
# samples on 3 workers (2 per step), 4 on 2 (3 per step).
MICRO_BATCH = 2
GLOBAL_BATCH = 12
# Optimizer steps.
STEPS = 6
EPOCHS = 2
# The failing slot dies after this many batches of its first attempt, and
# as it starts in every later one. A save is due every 3 batches, mid-way
# through a window of 2 on 3 workers: it waits for the window's end
# (batch 4), which 2 workers' micro-batches of 4 samples tile.
SAVE_FREQ = 3
DIES_AFTER = 5


def train(backup_dir, failing_slot=None, log_dir=None, fails_until=None,
          grow_after=None):
    """Trains `EPOCHS` epochs of `STEPS` optimizer steps, with a
    `DistributedLogger` in `log_dir` if given; returns the weights, the
    optimizer's iterations, the replica count and the planned
    micro-batches per step.

    `failing_slot` fails in every attempt, or up to attempt `fails_until`.
    With `grow_after`, worker 0 of a 2-worker attempt sends SIGUSR1 to the
    launcher (`LAUNCHER_PID`) after that many batches of it and waits for
    the launcher's SIGTERM, which `BackupAndRestore` saves on."""
    import keras_mgpu

    slot = os.environ.get("SLOT")
    attempt = int(os.environ.get("KERAS_MGPU_ATTEMPT", "1"))
    failing = slot is not None and slot == failing_slot and (
        fails_until is None or attempt <= fails_until)
    if failing and attempt > 1:
        os.kill(os.getpid(), signal.SIGKILL)
    strategy = keras_mgpu.auto_strategy()

    import keras
    import numpy as np
    import tensorflow as tf

    from keras_mgpu.callbacks import BackupAndRestore
    from tests import workers

    keras.utils.set_random_seed(0)
    x, y = workers.regression_data(GLOBAL_BATCH * STEPS)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        keras_mgpu.global_batch_size(MICRO_BATCH, strategy))
    with strategy.scope():
        inner = keras.Sequential([
            keras.Input((workers.FEATURES,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1),
        ])
        inner.set_weights(workers.initial_weights(inner))
        model = keras_mgpu.GradientAccumulationModel(
            inner, global_batch_size=GLOBAL_BATCH,
            micro_batch_size=MICRO_BATCH)
        model.compile(keras.optimizers.Adam(0.01), "mse")
    steps = [0]
    asks_to_grow = (grow_after is not None and slot == "0"
                    and strategy.num_replicas_in_sync == 2)

    def on_batch_end(batch, logs):
        steps[0] += 1
        if failing and steps[0] == DIES_AFTER:
            workers.finish_backup_writes()
            os.kill(os.getpid(), signal.SIGKILL)
        if asks_to_grow and steps[0] == grow_after:
            _ask_to_grow()

    logger = [] if log_dir is None else [keras_mgpu.DistributedLogger(
        log_dir, update_freq=2, console=False)]
    model.fit(dataset, epochs=EPOCHS, verbose=0, shuffle=False, callbacks=[
        BackupAndRestore(backup_dir, save_freq=SAVE_FREQ,
                         save_on_sigterm=True),
        *logger,
        keras.callbacks.LambdaCallback(on_batch_end=on_batch_end),
    ])
    return {
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
        "iterations": int(model.optimizer.iterations.numpy()),
        "replicas": strategy.num_replicas_in_sync,
        "accum_steps": model.accum_steps,
    }


def _ask_to_grow():
    """SIGUSR1 to the launcher, then a wait for its SIGTERM (passed on to
    BackupAndRestore's handler), so the attempt cannot end first."""
    import threading

    termed = threading.Event()
    saves = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        termed.set()
        saves(signum, frame)

    signal.signal(signal.SIGTERM, on_term)
    os.kill(int(os.environ["LAUNCHER_PID"]), signal.SIGUSR1)
    if not termed.wait(timeout=120):
        raise RuntimeError("no SIGTERM from the launcher within 120 s")
