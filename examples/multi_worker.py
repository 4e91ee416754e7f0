"""Train on 2 local worker processes, as on 2 machines, with TF_CONFIG.

    python examples/multi_worker.py [--smoke] [--workers 2]

The launcher starts each worker with a TF_CONFIG naming every worker on
localhost; `auto_strategy()` then returns a MultiWorkerMirroredStrategy.
On real machines, set TF_CONFIG yourself and run the same training code.
"""

import json
import os
import sys


def train(epochs: int) -> dict:
    """One worker's program: strategy first, then the usual Keras code."""
    import keras_mgpu

    strategy = keras_mgpu.auto_strategy()
    import keras

    from _common import digits

    (x, y), (x_test, y_test) = digits()
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ])
        model.compile("adam", "sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    batch = keras_mgpu.global_batch_size(32, strategy)
    model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    return {"worker": keras_mgpu.worker_index(),
            "chief": keras_mgpu.is_chief(),
            "replicas": strategy.num_replicas_in_sync,
            "accuracy": float(accuracy)}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    # _common first: it quiets TensorFlow's start-up logs, and its
    # TF_CPP_MIN_LOG_LEVEL reaches the workers through their environment.
    from _common import parse_args
    from _interrupt import stops_cleanly

    args = parse_args(__doc__.splitlines()[0],
                      workers={"type": int, "default": 2})
    from keras_mgpu.launcher import run_local_workers

    # A worker's stderr (TensorFlow's gRPC and collective logs among it) is
    # shown only if it fails, in the WorkerError.
    # Ctrl-C: the launcher stops the workers; one line, exit code 130.
    with stops_cleanly():
        print(f"Training on {args.workers} worker processes (Ctrl-C stops "
              "them; nothing is saved)...", flush=True)
        results = run_local_workers(
            "multi_worker:train", args.workers,
            kwargs={"epochs": 2 if args.smoke else 10}, timeout=600)
    for r in results:
        print(json.dumps(r.result))
