"""Worker entry points for the DistributedLogger multi-process tests.

Each creates its strategy first, before any other TensorFlow call, as
MultiWorkerMirroredStrategy requires.
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
