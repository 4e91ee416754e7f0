"""Worker entry points for the DistributedLogger multi-process tests.

Each that trains under a strategy creates it first, before any other
TensorFlow call, as MultiWorkerMirroredStrategy requires.
"""

import os


def chief_only_logging(base_dir, epochs=2, update_freq=2):
    """Fits `build_mlp` with a DistributedLogger in `base_dir/worker{index}`."""
    import keras_mgpu

    strategy = keras_mgpu.auto_strategy()
    import keras
    import tensorflow as tf

    from keras_mgpu.callbacks.distributed_logger import DistributedLogger
    from tests import workers

    log_dir = os.path.join(base_dir, f"worker{keras_mgpu.worker_index()}")
    x, y = workers.regression_data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    with strategy.scope():
        model = workers.build_mlp()
        model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    history = model.fit(dataset, epochs=epochs, verbose=0, shuffle=False,
                        callbacks=[DistributedLogger(log_dir,
                                                     update_freq=update_freq)])
    return {
        "worker_index": keras_mgpu.worker_index(),
        "is_chief": keras_mgpu.is_chief(),
        "log_dir": log_dir,
        "exists": os.path.exists(log_dir),
        "loss": history.history["loss"],
    }


def announced_writes(log_dir, epochs=100):
    """Fits a tiny model logging every batch to `log_dir`, and prints
    `WROTE <kind> <step>;` once each record's write has returned; holds
    after training until killed (the test kills it mid-run, on a marker)."""
    import keras

    from keras_mgpu.callbacks.telemetry import sinks as _sinks
    from keras_mgpu.callbacks.distributed_logger import DistributedLogger
    from tests import workers

    write = _sinks.Sinks._write

    def announcing(self, records):
        write(self, records)
        for record in records:
            print(f"WROTE {record['kind']} {record['step']};", flush=True)

    # Instrumented, not replaced: the real write runs, then announces.
    _sinks.Sinks._write = announcing
    keras.utils.set_random_seed(0)
    x, y = workers.regression_data(64)
    model = workers.build_mlp()
    model.compile("sgd", "mse")
    model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, shuffle=False,
              callbacks=[DistributedLogger(log_dir, update_freq=1,
                                           console=False)])
    workers.hold_until_killed()


def killed_and_resumed(log_dir, backup_dir, kill_after=None, epochs=2,
                       hold_after_first=False):
    """Fits a plain model (8 batches per epoch) with `BackupAndRestore`
    saving every batch and `DistributedLogger(update_freq=2)`; with
    `kill_after`, SIGKILLs itself at the end of that global batch, once
    its backup is committed (so the rerun resumes there), while the
    logger's background writer (TensorBoard's events) is held in its
    first write, as a first write that traces for seconds on a busy
    machine is. With `hold_after_first`, prints `HOLDING` after the first
    batch and waits for a line on stdin (the log_dir is in use then)."""
    import signal
    import sys

    import keras

    from keras_mgpu.callbacks import BackupAndRestore, DistributedLogger
    from keras_mgpu.callbacks.telemetry import sinks as _sinks
    from tests import workers

    if kill_after is not None:
        _sinks.Sinks._write = lambda self, records: workers.hold_until_killed()

    trained = [0]

    def on_train_batch_end(batch, logs):
        trained[0] += 1
        if trained[0] == 1 and hold_after_first:
            print("HOLDING", flush=True)
            sys.stdin.readline()
        if trained[0] == kill_after:
            workers.finish_backup_writes()
            os.kill(os.getpid(), signal.SIGKILL)

    keras.utils.set_random_seed(0)
    x, y = workers.regression_data(64)
    model = workers.build_mlp()
    model.set_weights(workers.initial_weights(model))
    model.compile("sgd", "mse")
    model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, shuffle=False,
              callbacks=[BackupAndRestore(backup_dir, save_freq=1),
                         DistributedLogger(log_dir, update_freq=2),
                         keras.callbacks.LambdaCallback(
                             on_train_batch_end=on_train_batch_end)])
    return {"iterations": int(model.optimizer.iterations.numpy())}
