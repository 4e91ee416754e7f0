"""Training programs for BackupAndRestore's crash-and-resume tests.

Each is a worker entry point (run by `keras_mgpu.launcher`): it creates its
strategy first, prints `STEP <n>;` after every batch so a test can kill it at
a chosen step, and returns the final weights.
"""


import numpy as np


def train(backup_dir, preset="preemptible", save_freq=4, accum_steps=None,
          epochs=3, steps=8, hold_write_of=None, report_held_at=None,
          pause_at=None, virtual_cpus=None, mode="window", **overrides):
    import keras_mgpu

    strategy = keras_mgpu.auto_strategy(virtual_cpus=virtual_cpus)

    import threading

    import keras
    import tensorflow as tf

    from keras_mgpu.callbacks import BackupAndRestore, _backup_store
    from tests import workers

    write = _backup_store._write_file
    held = threading.Event()

    def holding_write(path, data):
        # Holds the background write of generation `hold_write_of` after
        # its weights and variables files until the test kills the
        # process: the kill lands inside that generation.
        write(path, data)
        name = path.rsplit('/', 1)[-1]
        if (f"/.tmp-{hold_write_of}-" in path
                and name == "variables.npz"):
            print(f"HOLDING {name};", flush=True)
            held.set()
            workers.hold_until_killed()

    if hold_write_of is not None:
        _backup_store._write_file = holding_write

    keras.utils.set_random_seed(0)
    global_batch = 16
    x, y = workers.regression_data(global_batch * steps)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    with strategy.scope():
        inner = keras.Sequential([
            keras.Input((workers.FEATURES,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dropout(0.3, seed=1),
            keras.layers.Dense(1),
        ])
        inner.set_weights(workers.initial_weights(inner))
        model = inner
        if accum_steps:
            model = keras_mgpu.GradientAccumulationModel(
                inner, accum_steps=accum_steps, mode=mode)
        model.compile(keras.optimizers.Adam(0.01), "mse")

    epoch_step = [0]

    def on_epoch_begin(epoch, logs):
        epoch_step[0] = epoch * steps

    def on_batch_end(batch, logs):
        if epoch_step[0] == pause_at:
            # Saves before this step are committed when the test acts.
            workers.finish_backup_writes()
        if epoch_step[0] == report_held_at:
            # Training got here while the write is held mid-generation.
            held.wait(timeout=workers.HOLD_SECONDS)
        print(f"STEP {epoch_step[0]};", flush=True)
        if epoch_step[0] == pause_at:
            # Hold still at this step until the test's signal arrives: a
            # SIGKILL ends the process here, a SIGTERM (handled by the
            # backup) lets it go on to save and exit.
            backup._sigterm.wait(timeout=workers.HOLD_SECONDS)
        epoch_step[0] += 1

    backup = BackupAndRestore.from_preset(preset, backup_dir,
                                          save_freq=save_freq, **overrides)
    model.fit(dataset, epochs=epochs, verbose=0, shuffle=False, callbacks=[
        keras.callbacks.LambdaCallback(on_epoch_begin=on_epoch_begin),
        backup,
        keras.callbacks.LambdaCallback(on_batch_end=on_batch_end),
    ])
    return {
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
        "iterations": int(model.optimizer.iterations.numpy()),
    }
