"""Benchmark: steps redone per failure and the cost of saving, with the
durable tier of `BackupAndRestore` alone and with its local tier.

For each workload (the checkpoint benchmark's MLP, and MobileNetV3Small
from `keras.applications` on 32x32 images), two parts:

- **Failures.** A training run is SIGKILLed at `--kills` random points,
  each rerun resuming from what the last one saved: each attempt is killed
  a random number of steps (1 to `2 * save_freq`) after it resumed, at a
  random fraction of a step. Per failure, the steps redone are the furthest
  step the killed attempt reported minus the step the next attempt resumed
  from. Once for `BackupAndRestore(save_freq=S, local_dir=None)` (durable
  only, to local disk) and once with `local_dir` in `/dev/shm` and
  `local_save_freq=L`, with the same random draws. Each attempt is a fork
  of this process (TensorFlow imported once, not started), so a rerun
  starts in milliseconds.
- **Cost.** Fits without a callback, with each configuration, and with
  Keras's own `BackupAndRestore(save_freq=L)` writing to `/dev/shm`, taken
  in turns (`--rounds`): each configuration's median epoch against the
  no-callback epoch of the same round (median over rounds), the fastest
  epochs' ratio, and the training thread's stall per save (median).

Run from the repository root (defaults: S=50, L=5, 20 kills; about 26
minutes on 2 CPU cores):

    .venv/bin/python benchmarks/recovery.py
    .venv/bin/python benchmarks/recovery.py --workloads mlp --kills 5
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import select
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback

# Runnable as a plain script from a checkout: the package lives one level up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_mgpu  # noqa: E402  (sets KERAS_BACKEND before keras loads)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _timed_backup import TimedBackup, TimedKerasBackup  # noqa: E402
from _timing import EpochTimer  # noqa: E402

from keras_mgpu.runtime import training_runtime  # noqa: E402

# Seconds an attempt may go without a line before it counts as hung.
LINE_TIMEOUT = 600
RAM = "/dev/shm"


def build(workload: str, steps: int) -> tuple:
    """(compiled model, data repeated forever) of `workload`; batch 32."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if workload == "mlp":
        # checkpoint.py's MLP 256-512-512-10.
        x = rng.standard_normal((steps * 32, 256), "float32")
        model = keras.Sequential([
            keras.Input((256,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ])
    else:
        x = rng.standard_normal((steps * 32, 32, 32, 3), "float32")
        model = keras.applications.MobileNetV3Small(
            input_shape=(32, 32, 3), weights=None, classes=10,
            include_preprocessing=False, classifier_activation=None)
    y = rng.integers(0, 10, size=len(x), dtype=np.int32)
    model.compile(keras.optimizers.Adam(1e-4),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        32, drop_remainder=True).cache().repeat().prefetch(2)
    return model, data


def backup(kind: str, root: str, args, timed: bool = True):
    """The callback of configuration `kind` ("durable", "local", "keras")
    writing under `root`."""
    if kind == "keras":
        return TimedKerasBackup(os.path.join(RAM, os.path.basename(root),
                                             "keras"),
                                save_freq=args.local_save_freq)
    local = ({} if kind == "durable" else {
        "local_dir": os.path.join(RAM, os.path.basename(root), "local"),
        "local_save_freq": args.local_save_freq})
    cls = TimedBackup if timed else keras_mgpu.callbacks.BackupAndRestore
    return cls(os.path.join(root, "backup"), save_freq=args.save_freq,
               local_dir=local.pop("local_dir", None), **local)


# --- failures ---------------------------------------------------------------

def _attempt(workload: str, kind: str, root: str, args, out: int) -> None:
    """One attempt, in a fork: resumes, then trains until it is killed,
    writing `RESUMED <step>` and `STEP <step>` lines to `out`."""
    model, data = build(workload, args.steps)

    class Markers(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            step = training_runtime(self.model).global_step
            os.write(out, f"RESUMED {step}\n".encode())

        def on_train_batch_end(self, batch, logs=None):
            step = training_runtime(self.model).global_step
            os.write(out, f"STEP {step}\n".encode())

    model.fit(data, steps_per_epoch=args.steps, epochs=10**6, verbose=0,
              callbacks=[backup(kind, root, args, timed=False), Markers()])


def _lines(fd: int):
    """The lines written to pipe `fd`, each within `LINE_TIMEOUT` seconds;
    ends at end of file."""
    buffer = b""
    while True:
        while b"\n" not in buffer:
            ready, _, _ = select.select([fd], [], [], LINE_TIMEOUT)
            if not ready:
                raise RuntimeError(f"no line from the attempt in "
                                   f"{LINE_TIMEOUT} s")
            data = os.read(fd, 65536)
            if not data:
                return
            buffer += data
        line, buffer = buffer.split(b"\n", 1)
        yield line.decode()


def fail_repeatedly(workload: str, kind: str, args, seed: int) -> dict:
    """`args.kills` SIGKILLs of one run, each rerun resuming from the last;
    the steps redone per failure."""
    rng = random.Random(seed)
    root = tempfile.mkdtemp(prefix=f"recovery_{kind}_")
    redone, furthest, pids = [], None, []
    try:
        for kill in range(args.kills + 1):
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read)
                code = 1
                try:
                    _attempt(workload, kind, root, args, write)
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(code)
            os.close(write)
            pids.append(pid)
            after = rng.randint(1, 2 * args.save_freq)
            fraction = rng.random()
            resumed, times = None, []
            # Read to the end: the lines written before the kill landed
            # count too.
            for line in _lines(read):
                number = int(line.split()[1])
                if line.startswith("RESUMED "):
                    resumed = number
                    if furthest is not None:
                        redone.append(furthest - resumed)
                    if kill == args.kills:
                        # The last rerun only says where it resumed.
                        os.kill(pid, signal.SIGKILL)
                    continue
                furthest = number
                times.append(time.monotonic())
                if resumed is not None and number - resumed == after:
                    step_time = times[-1] - times[-2] if len(times) > 1 else 0
                    time.sleep(fraction * step_time)
                    os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            pids.remove(pid)
            os.close(read)
            if os.waitstatus_to_exitcode(status) != -signal.SIGKILL:
                raise RuntimeError(f"attempt {kill + 1} of {kind} ended with "
                                   f"{os.waitstatus_to_exitcode(status)}")
            print(f"  {workload} {kind}: failure {kill}: "
                  + (f"redone {redone[-1]} steps" if kill else "first kill")
                  + f" (resumed at {resumed})", flush=True)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(os.path.join(RAM, os.path.basename(root)),
                      ignore_errors=True)
    return {"redone": redone, "mean": statistics.mean(redone),
            "median": statistics.median(redone), "max": max(redone)}


# --- cost ---------------------------------------------------------------------

def cost(workload: str, args) -> dict:
    """Per configuration: epoch time against no callback, and the stall
    per save."""
    kinds = ["none", "durable", "local", "keras"]
    models = {kind: build(workload, args.steps) for kind in kinds}
    ratios = {kind: [] for kind in kinds}
    epochs = {kind: [] for kind in kinds}
    stalls = {kind: [] for kind in kinds}
    for round_index in range(args.rounds):
        medians = {}
        for k in range(len(kinds)):
            kind = kinds[(k + round_index) % len(kinds)]
            root = tempfile.mkdtemp(prefix=f"recovery_cost_{kind}_")
            try:
                model, data = models[kind]
                callback = None if kind == "none" else backup(kind, root, args)
                timer = EpochTimer()
                model.fit(data, steps_per_epoch=args.steps,
                          epochs=args.epochs, verbose=0, callbacks=[
                              timer.start,
                              *([] if callback is None else [callback]),
                              timer.stop])
            finally:
                shutil.rmtree(root, ignore_errors=True)
                shutil.rmtree(os.path.join(RAM, os.path.basename(root)),
                              ignore_errors=True)
            medians[kind] = statistics.median(timer.times[1:])
            epochs[kind] += timer.times[1:]
            if callback is not None:
                stalls[kind] += callback.save_seconds
        for kind in kinds:
            ratios[kind].append(medians[kind] / medians["none"])
        print(f"  {workload} cost, round {round_index + 1}: "
              + ", ".join(f"{kind} {medians[kind]:.3f} s" for kind in kinds),
              flush=True)
    fastest = min(epochs["none"])
    return {kind: {
        "x_none": statistics.median(ratios[kind]),
        "x_none_fastest": min(epochs[kind]) / fastest,
        "saves": len(stalls[kind]),
        "stall_ms": (1000 * statistics.median(stalls[kind])
                     if stalls[kind] else None),
    } for kind in kinds} | {"fastest_epoch_s": fastest}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,mobilenet",
                        help="comma-separated: mlp, mobilenet")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--save-freq", type=int, default=50)
    parser.add_argument("--local-save-freq", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100,
                        help="batches per epoch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4,
                        help="epochs per timed fit; the first is not timed")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    workloads = [w.strip() for w in args.workloads.split(",")]
    for workload in workloads:
        if workload not in ("mlp", "mobilenet"):
            parser.error(f"unknown workload {workload!r}: use mlp or "
                         "mobilenet")
    if not os.access(RAM, os.W_OK):
        parser.error(f"the local tier's figures need a writable {RAM}")
    if not 1 <= args.local_save_freq < args.save_freq or args.kills < 1:
        parser.error("need 1 <= --local-save-freq < --save-freq and "
                     "--kills >= 1")
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, "
          f"keras-mgpu {keras_mgpu.__version__}, Python "
          f"{platform.python_version()}, {os.cpu_count()} CPU cores; "
          f"save_freq={args.save_freq}, local_save_freq="
          f"{args.local_save_freq}, {args.kills} kills\n", flush=True)
    started = time.perf_counter()
    # Every fork first: this process starts TensorFlow in the cost part.
    failures = {(workload, kind): fail_repeatedly(workload, kind, args,
                                                  args.seed)
                for workload in workloads for kind in ("durable", "local")}
    costs = {workload: cost(workload, args) for workload in workloads}
    results = {}
    for workload in workloads:
        c = costs[workload]
        print(f"\n{workload} (fastest epoch without a callback "
              f"{c['fastest_epoch_s']:.3f} s, {args.steps} steps):\n")
        print("| configuration | x none | x none, fastest | stall ms/save | "
              "redone per failure: mean | median | max |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        labels = {
            "none": "no callback",
            "durable": f"durable, save_freq={args.save_freq}",
            "local": (f"durable {args.save_freq} + local "
                      f"{args.local_save_freq} ({RAM})"),
            "keras": (f"Keras's, save_freq={args.local_save_freq} "
                      f"({RAM})"),
        }
        for kind, label in labels.items():
            f = failures.get((workload, kind))
            stall = c[kind]["stall_ms"]
            print(f"| {label} | {c[kind]['x_none']:.3f} | "
                  f"{c[kind]['x_none_fastest']:.3f} | "
                  + ("-" if stall is None else f"{stall:.1f}") + " | "
                  + ("- | - | -" if f is None else
                     f"{f['mean']:.1f} | {f['median']:.1f} | {f['max']}")
                  + " |")
        ratio = (failures[(workload, "local")]["mean"]
                 / failures[(workload, "durable")]["mean"])
        print(f"\nsteps redone per failure, local tier / durable alone: "
              f"{ratio:.3f}")
        results[workload] = {"cost": c, "ratio": ratio, "failures": {
            kind: failures[(workload, kind)] for kind in ("durable", "local")}}
    print(f"\nTotal {time.perf_counter() - started:.0f} s.")
    return results


if __name__ == "__main__":
    main()
