"""Epoch-time cost of logging callbacks, against no callback, in one run.

Trains an MLP on synthetic data with no callback, Keras's TensorBoard
(`update_freq="batch"` and `"epoch"`) and `DistributedLogger`
(`update_freq=1` and `100`), and prints the median epoch time of each and
its ratio to no callback. Configurations take turns epoch by epoch, so
drifts in machine load touch them all alike.

    python benchmarks/logging_overhead.py
    python benchmarks/logging_overhead.py --steps 300 --epochs 7 --batch 64
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _timing import EpochTimer  # noqa: E402

from keras_mgpu.callbacks.distributed_logger import DistributedLogger  # noqa: E402


def configurations(log_root: str) -> dict:
    def path(name):
        return os.path.join(log_root, name)

    return {
        "no callback": lambda: [],
        "TensorBoard(update_freq='batch')": lambda: [
            keras.callbacks.TensorBoard(path("tb_batch"), update_freq="batch")],
        "TensorBoard(update_freq='epoch')": lambda: [
            keras.callbacks.TensorBoard(path("tb_epoch"), update_freq="epoch")],
        "DistributedLogger(update_freq=1)": lambda: [
            DistributedLogger(path("dl_1"), update_freq=1, console=False)],
        "DistributedLogger(update_freq=100)": lambda: [
            DistributedLogger(path("dl_100"), update_freq=100, console=False)],
    }


def build(features: int, width: int) -> keras.Model:
    model = keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(1),
    ])
    model.compile(keras.optimizers.Adam(1e-3), "mse", metrics=["mae"])
    return model


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300,
                        help="train batches per epoch")
    parser.add_argument("--rounds", type=int, default=3,
                        help="fits per configuration, taken in turns")
    parser.add_argument("--epochs", type=int, default=3,
                        help="epochs per fit; the first one is not timed")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--width", type=int, default=128)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    n = args.steps * args.batch
    x = rng.standard_normal((n, args.features), "float32")
    y = rng.standard_normal((n, 1), "float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        args.batch, drop_remainder=True).cache().prefetch(2)

    log_root = tempfile.mkdtemp(prefix="logging_overhead_")
    try:
        configs = configurations(log_root)
        models = {name: build(args.features, args.width) for name in configs}
        times = {name: [] for name in configs}
        for _ in range(args.rounds):
            for name, model in models.items():
                timer = EpochTimer()
                model.fit(data, epochs=args.epochs, verbose=0,
                          callbacks=[timer.start, *configs[name](),
                                     timer.stop])
                # The first epoch of a fit holds tracing, cache filling and
                # the callbacks' setup (writers, files): not timed.
                times[name] += timer.times[1:]
    finally:
        shutil.rmtree(log_root, ignore_errors=True)

    medians = {name: float(np.median(t)) for name, t in times.items()}
    base = medians["no callback"]
    gpus = tf.config.list_physical_devices("GPU")
    print(f"\nDevice: {gpus[0].name if gpus else 'CPU'}; MLP "
          f"{args.features}-{args.width}-{args.width}-1, batch {args.batch}, "
          f"{args.steps} steps/epoch, median of "
          f"{len(times['no callback'])} timed epochs")
    header = f"{'callback':<36} {'epoch s':>9} {'x none':>8}"
    print(header)
    print("-" * len(header))
    for name, seconds in medians.items():
        print(f"{name:<36} {seconds:>9.3f} {seconds / base:>8.3f}")
    return {name: seconds / base for name, seconds in medians.items()}


if __name__ == "__main__":
    main()
