"""Benchmark: cost of backups, keras-mgpu's BackupAndRestore against Keras's.

Trains an MLP of a few million parameters (so that a save writes tens of
megabytes: weights plus Adam's two moments) on synthetic data with no
callback, `keras.callbacks.BackupAndRestore` and
`keras_mgpu.callbacks.BackupAndRestore`, each at the same save frequencies
(`--freqs`, default every 10 and 50 batches and every epoch), and prints:

- time per save: the callbacks' own save path, timed directly (Keras's
  `_save_model`, keras-mgpu's `_save`), median over all saves;
- the epoch time (median of the timed epochs) and its ratio to no callback:
  the training slowdown;
- the epoch-time difference to no callback divided by the saves per epoch: a
  cross-check of the direct timing.

Both callbacks keep their defaults otherwise (`delete_checkpoint=True`, one
checkpoint: Keras's `double_checkpoint=False`, keras-mgpu's `keep=1`): each
fit starts without a backup and removes it at the end, so nothing is
restored. Saves run on the training thread in both, so their time adds to
the epoch. Configurations take turns fit by fit, so drifts in machine load
touch them all alike; the first epoch of each fit (tracing, first save
setup) is not timed.

Run from the repository root (about 5 minutes on 2 CPU cores):

    .venv/bin/python benchmarks/checkpoint.py
    .venv/bin/python benchmarks/checkpoint.py --freqs 10,epoch --rounds 2 \\
        --steps 100 --width 1024
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

# Runnable as a plain script from a checkout: the package lives one level up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_mgpu  # noqa: E402  (sets KERAS_BACKEND before keras loads)
from keras_mgpu.callbacks import backup_and_restore as ours_lib  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _timing import EpochTimer  # noqa: E402

NONE = "no callback"
KERAS = "keras"
OURS = "keras-mgpu"


class TimedKerasBackup(keras.callbacks.BackupAndRestore):
    """Keras's callback, timing each call of its save path."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.save_seconds = []

    def _save_model(self):
        start = time.perf_counter()
        super()._save_model()
        self.save_seconds.append(time.perf_counter() - start)


class TimedBackup(ours_lib.BackupAndRestore):
    """keras-mgpu's callback, timing each save (write, checksums, commit)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.save_seconds = []

    def _save(self, epoch, step_in_epoch):
        start = time.perf_counter()
        try:
            return super()._save(epoch, step_in_epoch)
        finally:
            self.save_seconds.append(time.perf_counter() - start)


def build(features: int, width: int) -> keras.Model:
    model = keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(keras.optimizers.Adam(1e-4),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def parse_freqs(text: str) -> list:
    freqs = []
    for part in text.split(","):
        part = part.strip()
        if part == "epoch":
            freqs.append("epoch")
        elif part.isdigit() and int(part) > 0:
            freqs.append(int(part))
        else:
            raise argparse.ArgumentTypeError(
                f"expected positive integers or 'epoch', got {part!r}")
    return freqs


def saves_per_epoch(freq, steps: int) -> float:
    return 1.0 if freq == "epoch" else steps / freq


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--freqs", type=parse_freqs, default="10,50,epoch",
                        help="save frequencies, comma-separated")
    parser.add_argument("--steps", type=int, default=200,
                        help="train batches per epoch")
    parser.add_argument("--rounds", type=int, default=2,
                        help="fits per configuration, taken in turns")
    parser.add_argument("--epochs", type=int, default=3,
                        help="epochs per fit; the first one is not timed")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--dir", default=None,
                        help="where backups go (default: a temporary "
                             "directory on local disk)")
    args = parser.parse_args(argv)
    if min(args.steps, args.rounds, args.batch) < 1 or args.epochs < 2:
        parser.error("--steps, --rounds, --batch >= 1 and --epochs >= 2")

    rng = np.random.default_rng(0)
    n = args.steps * args.batch
    x = rng.standard_normal((n, args.features), "float32")
    y = rng.integers(0, 10, size=n, dtype=np.int32)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        args.batch, drop_remainder=True).cache().prefetch(2)

    root = tempfile.mkdtemp(prefix="checkpoint_bench_", dir=args.dir)
    configs = [(NONE, None)] + [
        (kind, freq) for freq in args.freqs for kind in (KERAS, OURS)]

    def make_callback(kind, freq, index):
        path = os.path.join(root, f"{index}")
        if kind == KERAS:
            return TimedKerasBackup(path, save_freq=freq)
        if kind == OURS:
            return TimedBackup(path, save_freq=freq)
        return None

    keras.utils.set_random_seed(0)
    models = [build(args.features, args.width) for _ in configs]
    params = models[0].count_params()
    times = [[] for _ in configs]
    save_times = [[] for _ in configs]
    sizes = {}
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, "
          f"keras-mgpu {keras_mgpu.__version__}, Python "
          f"{platform.python_version()}, {os.cpu_count()} CPU cores")
    print(f"MLP {args.features}-{args.width}-{args.width}-10 ({params:,} "
          f"parameters, Adam), batch {args.batch}, {args.steps} steps/epoch; "
          f"{args.rounds} fits of {args.epochs} epochs per configuration, "
          "first epoch of each fit untimed.\n", flush=True)
    start_all = time.perf_counter()
    try:
        for round_index in range(args.rounds):
            for k in range(len(configs)):
                # Start one place later each round.
                i = (k + round_index) % len(configs)
                kind, freq = configs[i]
                callback = make_callback(kind, freq, i)
                timer = EpochTimer()
                size_probe = _SizeProbe(callback) if callback else None
                extra = [callback, size_probe] if callback else []
                models[i].fit(data, epochs=args.epochs, verbose=0,
                              shuffle=False,
                              callbacks=[timer.start, *extra, timer.stop])
                times[i] += timer.times[1:]
                if callback is not None:
                    save_times[i] += callback.save_seconds
                    if size_probe.bytes:
                        sizes[kind] = size_probe.bytes
                label = kind if freq is None else f"{kind} save_freq={freq}"
                print(f"  round {round_index + 1}: {label}: epochs "
                      + ", ".join(f"{t:.2f}s" for t in timer.times), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    elapsed = time.perf_counter() - start_all

    base = statistics.median(times[0])
    rows = []
    for (kind, freq), seconds, saves in zip(configs, times, save_times):
        epoch = statistics.median(seconds)
        row = {"callback": kind, "save_freq": "-" if freq is None else freq,
               "epoch_s": epoch, "slowdown": epoch / base,
               "save_ms": None, "diff_ms": None, "saves": len(saves)}
        if freq is not None:
            row["save_ms"] = 1000 * statistics.median(saves) if saves else None
            row["diff_ms"] = 1000 * (epoch - base) / saves_per_epoch(
                freq, args.steps)
        rows.append(row)

    header = (f"| {'callback':<11} | {'save_freq':>9} | {'saves':>5} | "
              f"{'ms/save':>8} | {'(epoch-none)/save ms':>20} | "
              f"{'epoch s':>8} | {'x none':>6} |")
    widths = [len(c) for c in header.split("|")[1:-1]]
    print("\n" + header)
    print("|" + "-" * widths[0] + "|"
          + "|".join("-" * (w - 1) + ":" for w in widths[1:]) + "|")
    for r in rows:
        save = "-" if r["save_ms"] is None else f"{r['save_ms']:.0f}"
        diff = "-" if r["diff_ms"] is None else f"{r['diff_ms']:.0f}"
        print(f"| {r['callback']:<11} | {str(r['save_freq']):>9} | "
              f"{r['saves']:>5} | {save:>8} | {diff:>20} | "
              f"{r['epoch_s']:>8.2f} | {r['slowdown']:>6.2f} |")

    print("\nkeras-mgpu / keras, same save_freq:")
    ratios = {}
    for freq in args.freqs:
        ours = next(r for r in rows if r["callback"] == OURS
                    and r["save_freq"] == freq)
        theirs = next(r for r in rows if r["callback"] == KERAS
                      and r["save_freq"] == freq)
        ratios[freq] = {
            "time_per_save": ours["save_ms"] / theirs["save_ms"],
            "epoch_time": ours["epoch_s"] / theirs["epoch_s"],
        }
        print(f"  save_freq={freq}: time per save "
              f"{ratios[freq]['time_per_save']:.2f}x, epoch time "
              f"{ratios[freq]['epoch_time']:.2f}x")
    for kind, size in sizes.items():
        print(f"Backup on disk, {kind}: {size / 2**20:.1f} MiB")
    print(f"\nTotal {elapsed:.0f} s.")
    return {"rows": rows, "ratios": ratios}


class _SizeProbe(keras.callbacks.Callback):
    """Records the size of the callback's backup directory at its largest."""

    def __init__(self, backup):
        super().__init__()
        self.backup = backup
        self.bytes = 0

    def on_epoch_end(self, epoch, logs=None):
        # Runs after the backup's own on_epoch_end (it comes later in the
        # list); keras-mgpu's epoch save lands at the next epoch's begin, so
        # sizes are taken here, once per epoch, at most one save behind.
        total = 0
        for dirpath, _, files in os.walk(str(self.backup.backup_dir)):
            total += sum(os.path.getsize(os.path.join(dirpath, f))
                         for f in files)
        self.bytes = max(self.bytes, total)


if __name__ == "__main__":
    main()
