"""The composition run: BackupAndRestore and DistributedLogger together.

A worker entry point (run by `keras_mgpu.launcher`): it creates its strategy
first, trains a classifier with compiled metrics (a plain model or a
`GradientAccumulationModel`), and on the chief prints `STEP <n>;` after
every batch, so a test can SIGKILL it at a chosen global step (it holds
there until killed). It saves every `SAVE_FREQ` batches; a test kills
it right after a save.
"""

import numpy as np

GLOBAL_BATCH = 16
STEPS_PER_EPOCH = 8
EPOCHS = 2
UPDATE_FREQ = 3
ACCUM_STEPS = 3
SAVE_FREQ = 2


def classification_data(num_samples=GLOBAL_BATCH * STEPS_PER_EPOCH, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(num_samples, 8).astype("float32")
    labels = np.argmax(x @ rng.randn(8, 3), axis=1).astype("int64")
    return x, labels


def train(backup_dir, log_dir, replicas=1, accumulate=False, kill_at=None,
          hold_generation=None):
    """`replicas`: 1 (the default strategy, or one replica per worker under
    TF_CONFIG) or 2 (MirroredStrategy over 2 logical CPUs).
    `hold_generation`: the backup's write of that generation (the one of
    step `SAVE_FREQ * hold_generation`) holds before its commit while
    training goes on, so a kill resumes from the one before."""
    import keras_mgpu

    strategy = keras_mgpu.auto_strategy(
        virtual_cpus=replicas if replicas > 1 else None)

    import keras
    import tensorflow as tf

    from keras_mgpu.callbacks import BackupAndRestore, DistributedLogger
    from keras_mgpu.runtime import training_runtime
    from tests import workers

    x, y = classification_data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    with strategy.scope():
        inner = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(3, activation="softmax"),
        ])
        inner.set_weights(workers.initial_weights(inner))
        model = inner
        if accumulate:
            model = keras_mgpu.GradientAccumulationModel(
                inner, accum_steps=ACCUM_STEPS)
        model.compile(keras.optimizers.Adam(0.01),
                      "sparse_categorical_crossentropy", metrics=["accuracy"])

    runtime = training_runtime(model)
    if hold_generation is not None:
        from tests import backup_workers

        backup_workers._hold_the_store_at("moved", hold_generation)

    def on_batch_end(batch, logs):
        if not keras_mgpu.is_chief():
            return
        if runtime.global_step == kill_at and hold_generation is None:
            # The save of this step is written in the background: the kill
            # lands after its commit.
            workers.finish_backup_writes()
        print(f"STEP {runtime.global_step};", flush=True)
        if runtime.global_step == kill_at:
            workers.hold_until_killed()

    model.fit(dataset, epochs=EPOCHS, verbose=0, shuffle=False, callbacks=[
        BackupAndRestore(backup_dir, save_freq=SAVE_FREQ),
        DistributedLogger(log_dir, update_freq=UPDATE_FREQ, console=False),
        keras.callbacks.LambdaCallback(on_batch_end=on_batch_end),
    ])
    counters = runtime.counters()
    return {
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
        "iterations": int(model.optimizer.iterations.numpy()),
        "global_step": counters.global_step,
        "samples_seen": counters.samples_seen,
        "updates_applied": counters.updates_applied,
        "replicas": strategy.num_replicas_in_sync,
    }
