"""The worker of tests/test_elastic_launch.py: a fixed global batch under
`MultiWorkerMirroredStrategy`, with a `BackupAndRestore`, where one worker
slot (named by `SLOT` in its environment) can be made to fail."""

import os
import signal

# Divisible by 2 and by 3 workers' replicas: every replica's share of each
# batch is equal on either, so the loss is the same global mean.
GLOBAL_BATCH = 12
STEPS = 6
EPOCHS = 2
# The failing slot dies after this many steps of its first attempt (a save
# every 2 steps before it), and as it starts in every later one.
DIES_AFTER = 5


def train(backup_dir, failing_slot=None, log_dir=None):
    """Trains `EPOCHS` epochs of `STEPS` batches, with a `DistributedLogger`
    in `log_dir` if given; returns the weights, the optimizer's iterations
    and the replica count."""
    import keras_mgpu

    slot = os.environ.get("SLOT")
    attempt = int(os.environ.get("KERAS_MGPU_ATTEMPT", "1"))
    failing = slot is not None and slot == failing_slot
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
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((workers.FEATURES,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1),
        ])
        model.set_weights(workers.initial_weights(model))
        model.compile(keras.optimizers.Adam(0.01), "mse")
    steps = [0]

    def on_batch_end(batch, logs):
        steps[0] += 1
        if failing and steps[0] == DIES_AFTER:
            workers.finish_backup_writes()
            os.kill(os.getpid(), signal.SIGKILL)

    logger = [] if log_dir is None else [keras_mgpu.DistributedLogger(
        log_dir, update_freq=2, console=False)]
    model.fit(dataset, epochs=EPOCHS, verbose=0, shuffle=False, callbacks=[
        BackupAndRestore(backup_dir, save_freq=2),
        *logger,
        keras.callbacks.LambdaCallback(on_batch_end=on_batch_end),
    ])
    return {
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
        "iterations": int(model.optimizer.iterations.numpy()),
        "replicas": strategy.num_replicas_in_sync,
    }
