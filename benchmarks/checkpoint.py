"""Benchmark: cost of backups, keras-mgpu's BackupAndRestore against Keras's.

Trains an MLP on synthetic data with no callback,
`keras.callbacks.BackupAndRestore` and `keras_mgpu.callbacks.BackupAndRestore`,
each at the same save frequencies (`--freqs`, default every 25 and 100
batches), and prints:

- the training-thread stall per save: the callbacks' own save path, timed
  directly (Keras's `_save_model`, which writes the file; keras-mgpu's
  `_save`, which takes the snapshot and hands it to the background writer,
  waiting first for the previous write if it still runs), median over all
  saves; and keras-mgpu's background write per save (file, checksums,
  commit, pruning), which overlaps training;
- the epoch time relative to no callback: per round, each configuration's
  epoch against the no-callback epoch of the same round (configurations
  take turns, so drifts in machine load touch them all alike), median over
  the rounds; and the fastest epoch of each configuration against the
  fastest without a callback (noise only adds time, so on a shared machine
  this is the steadier figure).

Both callbacks keep their defaults otherwise (`delete_checkpoint=True`, one
checkpoint): each fit starts without a backup and removes it at the end, so
nothing is restored. The first epoch of each fit (tracing, first save setup)
is not timed.

Run from the repository root (the defaults: MLP 256-512-512-10, batch 32,
256 steps per epoch, Adam, 5 rounds of 6 epochs; about 4 minutes on 2 CPU
cores):

    .venv/bin/python benchmarks/checkpoint.py
    # about 25M parameters:
    .venv/bin/python benchmarks/checkpoint.py --features 1024 --width 4500 \\
        --steps 100 --rounds 3 --epochs 3
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

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _timed_backup import TimedBackup, TimedKerasBackup  # noqa: E402
from _timing import EpochTimer  # noqa: E402

NONE = "no callback"
KERAS = "keras"
OURS = "keras-mgpu"


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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--freqs", type=parse_freqs, default="25,100",
                        help="save frequencies, comma-separated")
    parser.add_argument("--steps", type=int, default=256,
                        help="train batches per epoch")
    parser.add_argument("--rounds", type=int, default=5,
                        help="fits per configuration, taken in turns")
    parser.add_argument("--epochs", type=int, default=6,
                        help="epochs per fit; the first one is not timed")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
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
    # epoch[i][r]: configuration i's median timed epoch in round r.
    epoch = [[] for _ in configs]
    every_epoch = [[] for _ in configs]
    stalls = [[] for _ in configs]
    writes = [[] for _ in configs]
    sizes = {}
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, "
          f"keras-mgpu {keras_mgpu.__version__}, Python "
          f"{platform.python_version()}, {os.cpu_count()} CPU cores")
    print(f"MLP {args.features}-{args.width}-{args.width}-10 ({params:,} "
          f"parameters, Adam), batch {args.batch}, {args.steps} steps/epoch; "
          f"{args.rounds} rounds of one fit of {args.epochs} epochs per "
          "configuration, first epoch of each fit untimed.\n", flush=True)
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
                epoch[i].append(statistics.median(timer.times[1:]))
                every_epoch[i] += timer.times[1:]
                if callback is not None:
                    stalls[i] += callback.save_seconds
                    writes[i] += getattr(callback, "write_seconds", [])
                    if size_probe.bytes:
                        sizes[kind] = size_probe.bytes
                label = kind if freq is None else f"{kind} save_freq={freq}"
                print(f"  round {round_index + 1}: {label}: epochs "
                      + ", ".join(f"{t:.2f}s" for t in timer.times), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    elapsed = time.perf_counter() - start_all

    rows = []
    for i, (kind, freq) in enumerate(configs):
        rows.append({
            "callback": kind, "save_freq": "-" if freq is None else freq,
            "epoch_s": statistics.median(epoch[i]),
            "slowdown": statistics.median(
                mine / none for mine, none in zip(epoch[i], epoch[0])),
            # Machine noise only ever adds time: the fastest epochs are
            # the steadiest estimate of what the configuration costs.
            "fastest_slowdown": min(every_epoch[i]) / min(every_epoch[0]),
            "saves": len(stalls[i]),
            "stall_ms": (1000 * statistics.median(stalls[i])
                         if stalls[i] else None),
            "write_ms": (1000 * statistics.median(writes[i])
                         if writes[i] else None),
        })

    header = (f"| {'callback':<11} | {'save_freq':>9} | {'saves':>5} | "
              f"{'stall ms/save':>13} | {'background ms/save':>18} | "
              f"{'epoch s':>8} | {'x none':>6} | {'x none, fastest':>15} |")
    widths = [len(c) for c in header.split("|")[1:-1]]
    print("\n" + header)
    print("|" + "-" * widths[0] + "|"
          + "|".join("-" * (w - 1) + ":" for w in widths[1:]) + "|")
    for r in rows:
        stall = "-" if r["stall_ms"] is None else f"{r['stall_ms']:.1f}"
        write = "-" if r["write_ms"] is None else f"{r['write_ms']:.1f}"
        print(f"| {r['callback']:<11} | {str(r['save_freq']):>9} | "
              f"{r['saves']:>5} | {stall:>13} | {write:>18} | "
              f"{r['epoch_s']:>8.3f} | {r['slowdown']:>6.3f} | "
              f"{r['fastest_slowdown']:>15.3f} |")

    fastest = min(every_epoch[0])
    print(f"\nFastest epoch without a callback: {fastest:.3f} s "
          f"({1000 * fastest / args.steps:.2f} ms per step).")
    print("keras-mgpu / keras, same save_freq:")
    ratios = {}
    for freq in args.freqs:
        ours = next(r for r in rows if r["callback"] == OURS
                    and r["save_freq"] == freq)
        theirs = next(r for r in rows if r["callback"] == KERAS
                      and r["save_freq"] == freq)
        ratios[freq] = {
            "stall_per_save": (ours["stall_ms"] / theirs["stall_ms"]
                               if ours["saves"] and theirs["saves"]
                               else float("nan")),
            "slowdown": ours["slowdown"] / theirs["slowdown"],
        }
        print(f"  save_freq={freq}: stall per save "
              f"{ratios[freq]['stall_per_save']:.2f}x; epoch time vs no "
              f"callback {ours['slowdown']:.3f}x, fastest epochs "
              f"{ours['fastest_slowdown']:.3f}x (Keras "
              f"{theirs['slowdown']:.3f}x, {theirs['fastest_slowdown']:.3f}x)")
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
        # list), once per epoch. keras-mgpu's background write may be
        # moving files as this walks: those it misses count next epoch.
        total = 0
        for dirpath, _, files in os.walk(str(self.backup.backup_dir)):
            for name in files:
                try:
                    total += os.path.getsize(os.path.join(dirpath, name))
                except FileNotFoundError:
                    pass
        self.bytes = max(self.bytes, total)


if __name__ == "__main__":
    main()
