"""Epoch-time cost of logging callbacks, against no callback, in one run.

Trains an MLP on synthetic data with no callback, Keras's TensorBoard
(`update_freq="batch"` and `"epoch"`) and `DistributedLogger`
(`update_freq=1` and `100`). Configurations take turns fit by fit, so
drifts in machine load touch them all alike, and each ratio is paired: a
configuration's epoch time over the no-callback epoch time of the same
round, the median over rounds (with the quartiles, to show the noise).

A second figure is steadier on a shared machine: the share of the epoch
spent inside the callback's own hooks on the training thread (Keras runs
them between steps). It leaves out work a callback moves to other threads.

Then the fixed cost per `fit`: fits of 2 steps, again and again with the
same model and the same callback objects (a `fit(epochs=1)` loop, or many
short fits), each configuration's median fit time against no callback.

    python benchmarks/logging_overhead.py
    python benchmarks/logging_overhead.py --rounds 10 --width 512 --batch 256
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _timing import EpochTimer  # noqa: E402

from keras_mgpu.callbacks import DistributedLogger  # noqa: E402

_HOOKS = ("on_train_batch_begin", "on_train_batch_end", "on_epoch_begin",
          "on_epoch_end", "on_test_begin", "on_batch_begin", "on_batch_end")


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


def time_hooks(callback, timer: EpochTimer) -> None:
    """Adds the seconds spent in `callback`'s hooks to `timer.hook_seconds`.

    Only hooks the callback overrides are wrapped, so Keras's choice of
    synchronous or asynchronous batch-end dispatch is unchanged.
    """
    for name in _HOOKS:
        method = getattr(callback, name)
        default = getattr(keras.callbacks.Callback, name)
        if getattr(type(callback), name) is default:
            continue

        @functools.wraps(method)
        def timed(*args, _method=method, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                timer.hook_seconds += time.perf_counter() - start

        setattr(callback, name, timed)


def mlp_arguments(description: str) -> argparse.ArgumentParser:
    """The options of the MLP and its timed fits (shared with
    goodput_overhead.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=300,
                        help="train batches per epoch")
    parser.add_argument("--rounds", type=int, default=6,
                        help="fits per configuration, taken in turns")
    parser.add_argument("--epochs", type=int, default=3,
                        help="epochs per fit; the first one is not timed")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--width", type=int, default=128)
    return parser


def mlp_data(args) -> tuple:
    """`args.steps` batches of random regression data: (the cached
    dataset, x, y)."""
    rng = np.random.default_rng(0)
    n = args.steps * args.batch
    x = rng.standard_normal((n, args.features), "float32")
    y = rng.standard_normal((n, 1), "float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(
        args.batch, drop_remainder=True).cache().prefetch(2), x, y


def main(argv=None) -> dict:
    parser = mlp_arguments(__doc__.splitlines()[0])
    parser.add_argument("--short-fits", type=int, default=20,
                        help="2-step fits per configuration for the "
                             "per-fit cost (0: skip)")
    args = parser.parse_args(argv)
    data, x, y = mlp_data(args)

    log_root = tempfile.mkdtemp(prefix="logging_overhead_")
    try:
        configs = configurations(log_root)
        models = {name: build(args.features, args.width) for name in configs}
        # times[name][round] and hooks[name][round]: per timed epoch.
        times = {name: [] for name in configs}
        hooks = {name: [] for name in configs}
        for _ in range(args.rounds):
            for name, model in models.items():
                timer = EpochTimer()
                callbacks = configs[name]()
                for callback in callbacks:
                    time_hooks(callback, timer)
                model.fit(data, epochs=args.epochs, verbose=0,
                          callbacks=[timer.start, *callbacks, timer.stop])
                # The first epoch of a fit holds tracing, cache filling and
                # the callbacks' setup (writers, files): not timed.
                times[name].append(timer.times[1:])
                hooks[name].append(timer.hook_times[1:])
    finally:
        shutil.rmtree(log_root, ignore_errors=True)

    base = np.array(times["no callback"])
    gpus = tf.config.list_physical_devices("GPU")
    print(f"\nDevice: {gpus[0].name if gpus else 'CPU'}; MLP "
          f"{args.features}-{args.width}-{args.width}-1, batch {args.batch}, "
          f"{args.steps} steps/epoch, {args.rounds} rounds of "
          f"{args.epochs - 1} timed epochs")
    header = (f"{'callback':<36} {'epoch s':>8} {'x none':>7} "
              f"{'quartiles':>13} {'in hooks':>9}")
    print(header)
    print("-" * len(header))
    ratios = {}
    for name in configs:
        seconds = np.array(times[name])
        paired = (seconds / base).ravel()
        share = (np.array(hooks[name]) / seconds).ravel()
        q1, median, q3 = np.percentile(paired, [25, 50, 75])
        ratios[name] = float(median)
        print(f"{name:<36} {np.median(seconds):>8.3f} {median:>7.3f} "
              f"{q1:>6.3f}-{q3:<6.3f} {100 * np.median(share):>8.2f}%")
    if args.short_fits:
        ratios.update(short_fits(args, x[:2 * args.batch], y[:2 * args.batch]))
    return ratios


def short_fits(args, x, y) -> dict:
    """Median time of a 2-step `fit` per configuration, the same model and
    callback objects every time, configurations taking turns."""
    log_root = tempfile.mkdtemp(prefix="logging_short_fits_")
    names = ["no callback", "TensorBoard(update_freq='epoch')",
             "DistributedLogger(update_freq=100)"]
    try:
        configs = configurations(log_root)
        runs = {name: (build(args.features, args.width), configs[name]())
                for name in names}
        times = {name: [] for name in names}
        for round_ in range(args.short_fits + 2):
            for name, (model, callbacks) in runs.items():
                start = time.perf_counter()
                model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0,
                          callbacks=callbacks)
                if round_ >= 2:  # the first fits trace and open files
                    times[name].append(time.perf_counter() - start)
    finally:
        shutil.rmtree(log_root, ignore_errors=True)
    base = np.array(times["no callback"])
    print(f"\nFixed cost per fit: {args.short_fits} fits of 2 steps each, "
          f"the same model and callbacks")
    header = f"{'callback':<36} {'fit ms':>8} {'+ ms':>7} {'x none':>7}"
    print(header)
    print("-" * len(header))
    out = {}
    for name in names:
        seconds = np.array(times[name])
        ratio = float(np.median(seconds / base))
        out[f"{name} per fit"] = ratio
        print(f"{name:<36} {1000 * np.median(seconds):>8.1f} "
              f"{1000 * (np.median(seconds) - np.median(base)):>7.1f} "
              f"{ratio:>7.3f}")
    return out


if __name__ == "__main__":
    main()
