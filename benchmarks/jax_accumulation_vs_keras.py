"""Benchmark: gradient accumulation on Keras's JAX backend, against one big batch.

Under `keras.distribution.DataParallel` (2 devices: logical CPU devices
without accelerators), each case trains the same seeded MLP (float32, from
the same initial weights, on the same samples in the same order) four ways:

- **big batch**: the plain Keras model, `fit` at the big batch
  (`accum_steps` x the micro-batch): the reference, one optimizer step per
  big batch;
- **Keras's own**: the plain model, `fit` at the micro-batch, with the
  optimizer's `gradient_accumulation_steps=accum_steps`;
- **keras-mgpu window**: `GradientAccumulationModel(mode="window")`, `fit`
  at the micro-batch;
- **keras-mgpu in_step**: `GradientAccumulationModel(mode="in_step")`,
  `fit` at the big batch;

and prints, per case and method, the largest absolute difference of any
weight from the big-batch run's, and `optimizer.iterations`. The cases: SGD;
Adam; SGD with `global_clipnorm`; SGD with an `ExponentialDecay` schedule
(`decay_steps=1`); a partial trailing window (40 samples, micro-batch 8,
accum 4: the big-batch run takes two steps, of 32 and 8); non-uniform
sample weights. Nothing is asserted: Keras's own accumulation differs from
the big batch on purpose in some cases (its learning-rate schedule counts
micro-batches; a trailing partial window is not applied).

Then it times each method on a larger MLP: one untimed warm-up epoch each
(it compiles the train step), then epochs taken in turns (round-robin,
several rounds), the median epoch per method. Every method trains on the
same samples per epoch, so optimizer steps/s (samples/s over the big
batch) compare directly; the ratios are to Keras's own accumulation,
measured side by side in the same run. Without accelerators the devices
share the same CPU cores, so the figures show the mechanics (work per
micro-batch, steps saved), not accelerator performance.

`fit` waits for every fit step here (`WaitForEachStep` in
`_jax_accumulation.py`, with the methods), so
methods that take a fit step per micro-batch (Keras's own, window mode)
pay that wait N times per optimizer step, in-step mode and the big batch
once. `--async-callbacks` leaves Keras's default, asynchronous batch
callbacks on instead (see `WaitForEachStep` for why that is not the
default on a CPU).

Run from the repository root (about a minute and a half on 2 cores;
`--quick` trains for a few seconds):

    .venv/bin/python benchmarks/jax_accumulation_vs_keras.py
    .venv/bin/python benchmarks/jax_accumulation_vs_keras.py --quick \\
        --json /tmp/jax_accumulation.json

`KERAS_BACKEND` defaults to `jax` here, and unless `XLA_FLAGS` already sets
`--xla_force_host_platform_device_count`, the script asks XLA for 2 host
devices (ignored on accelerators).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Callable, Optional, Sequence

import numpy as np

# Runnable as a plain script from a checkout: the package lives one level up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Must be set before JAX starts: without accelerators, DataParallel needs
# several host devices to shard over.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2"
                               ).strip()

import keras_mgpu  # noqa: E402

import jax  # noqa: E402
import keras  # noqa: E402
from _jax_accumulation import (  # noqa: E402
    ACCUM_STEPS, BIG, DESCRIPTIONS, KERAS, METHODS, fit_batch, fresh_session,
    make_model, mlp, step_callbacks)
from _timing import markdown_table, round_robin, timed_epoch  # noqa: E402
from _timing import spread  # noqa: E402

MICRO_BATCH = 8
SEED = 0
FEATURES, WIDTH, CLASSES = 16, 32, 4
SGD_LR, ADAM_LR = 0.1, 1e-2
# Well below the windows' gradient norms here (about 0.7 to 0.9): every
# optimizer step is clipped.
GLOBAL_CLIPNORM = 0.05

TIMING_FEATURES, TIMING_WIDTH, TIMING_CLASSES = 256, 512, 10
TIMING_ADAM_LR = 1e-3


@dataclasses.dataclass(frozen=True)
class Case:
    """One correctness case: an optimizer, the data and how long to train."""

    name: str
    optimizer: Callable[[Optional[int]], keras.optimizers.Optimizer]
    samples: int = 64
    epochs: int = 2
    sample_weights: bool = False
    note: str = ""


def _sgd(accumulation: Optional[int], **kwargs) -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(
        kwargs.pop("learning_rate", SGD_LR),
        gradient_accumulation_steps=accumulation, **kwargs)


CASES = (
    Case("sgd", _sgd),
    Case("adam", lambda n: keras.optimizers.Adam(
        ADAM_LR, gradient_accumulation_steps=n)),
    Case("sgd global_clipnorm", lambda n: _sgd(
        n, global_clipnorm=GLOBAL_CLIPNORM),
        note=f"global_clipnorm={GLOBAL_CLIPNORM}"),
    Case("sgd lr schedule", lambda n: _sgd(
        n, learning_rate=keras.optimizers.schedules.ExponentialDecay(
            SGD_LR, decay_steps=1, decay_rate=0.5)),
        note="ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)"),
    Case("partial window", _sgd, samples=40, epochs=1,
         note="40 samples: 5 micro-batches, big batches of 32 and 8"),
    Case("sample weights", _sgd, sample_weights=True,
         note="weights uniform in [0.1, 2)"),
)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="GradientAccumulationModel (window and in-step mode) and "
        "Keras's gradient_accumulation_steps against one big-batch step, on "
        "Keras's JAX backend under DataParallel.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=9,
                        help="timed epochs per method (round-robin), after "
                             "one untimed warm-up epoch")
    parser.add_argument("--steps", type=int, default=256,
                        help="timing: micro-batches per epoch (a multiple "
                             f"of accum_steps={ACCUM_STEPS})")
    parser.add_argument("--batch", type=int, default=64,
                        help="timing: the global micro-batch")
    parser.add_argument("--quick", action="store_true",
                        help="the SGD case only, and 2 rounds of 16 "
                             "micro-batches: a smoke run")
    parser.add_argument("--no-timing", action="store_true",
                        help="the correctness cases only")
    parser.add_argument("--async-callbacks", action="store_true",
                        help="leave Keras's asynchronous batch callbacks on "
                             "(fit does not wait for each step); on a CPU "
                             "with forced host devices, long epochs may then "
                             "abort in XLA's all-reduce rendezvous")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 16
    if args.rounds < 1 or args.batch < 1 or args.steps < ACCUM_STEPS:
        parser.error(f"--rounds and --batch must be positive, --steps at "
                     f"least {ACCUM_STEPS}")
    if args.steps % ACCUM_STEPS:
        parser.error(f"--steps must be a multiple of {ACCUM_STEPS}")
    return args


# --- Training -----------------------------------------------------------------


def _int(variable) -> int:
    return int(keras.ops.convert_to_numpy(variable))


def max_abs_diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(a, b))


def run_case(case: Case, args: argparse.Namespace) -> list[dict]:
    """Trains `case` with every method; one row per method."""
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((case.samples, FEATURES), dtype=np.float32)
    y = rng.integers(0, CLASSES, size=case.samples).astype(np.int32)
    weights = (rng.uniform(0.1, 2.0, size=case.samples).astype(np.float32)
               if case.sample_weights else None)
    build = lambda: mlp(FEATURES, WIDTH, CLASSES, depth=2)  # noqa: E731
    keras.utils.set_random_seed(SEED)
    initial = build().get_weights()
    rows, reference = [], None
    for method in METHODS:
        row = {"case": case.name, "method": method,
               "batch": fit_batch(method, MICRO_BATCH)}
        try:
            keras.utils.set_random_seed(SEED)
            model, holder = make_model(method, build, initial, case.optimizer)
            history = model.fit(x, y, sample_weight=weights,
                                batch_size=row["batch"], epochs=case.epochs,
                                shuffle=False, verbose=0,
                                callbacks=step_callbacks(args))
            final = holder.get_weights()
            row.update(
                fit_steps=-(-case.samples // row["batch"]) * case.epochs,
                iterations=_int(model.optimizer.iterations),
                # What Keras's learning-rate schedules read: with
                # gradient_accumulation_steps, one count per micro-batch
                # (`iterations` divides it by the steps).
                schedule_steps=_int(model.optimizer._iterations),
                moved=max_abs_diff(final, initial),
                loss=float(history.history["loss"][-1]))
            if method == BIG:
                reference = final
            row["diff"] = (None if reference is None
                           else max_abs_diff(final, reference))
        except Exception:  # noqa: BLE001  (reported, not fixed, here)
            row["error"] = traceback.format_exc()
        rows.append(row)
        fresh_session()
    gc.collect()
    return rows


def timing_data(batch: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(SEED)
    count = batch * steps
    x = rng.standard_normal((count, TIMING_FEATURES), dtype=np.float32)
    y = rng.integers(0, TIMING_CLASSES, size=count).astype(np.int32)
    return x, y


def train_epoch(model: keras.Model, x: np.ndarray, y: np.ndarray,
                batch: int, args: argparse.Namespace) -> float:
    """Seconds of one epoch, without `fit`'s per-call setup."""
    return timed_epoch(model, x, y, batch_size=batch,
                       callbacks=step_callbacks(args))


def run_timing(args: argparse.Namespace) -> list[dict]:
    """Times every method on the timing MLP, interleaved epoch by epoch."""
    x, y = timing_data(args.batch, args.steps)
    build = lambda: mlp(TIMING_FEATURES, TIMING_WIDTH,  # noqa: E731
                        TIMING_CLASSES, depth=2)
    keras.utils.set_random_seed(SEED)
    initial = build().get_weights()
    optimizer = lambda n: keras.optimizers.Adam(  # noqa: E731
        TIMING_ADAM_LR, gradient_accumulation_steps=n)
    models, rows = [], []
    for method in METHODS:
        row = {"method": method, "batch": fit_batch(method, args.batch),
               "epoch_seconds": []}
        row["fit_steps"] = args.steps * args.batch // row["batch"]
        try:
            model, _ = make_model(method, build, initial, optimizer)
            began = time.perf_counter()
            train_epoch(model, x, y, row["batch"], args)
            row["warmup_seconds"] = time.perf_counter() - began
        except Exception:  # noqa: BLE001
            row["error"] = traceback.format_exc()
            model = None
        models.append(model)
        rows.append(row)
    live = [i for i, m in enumerate(models) if m is not None]
    timings = round_robin(len(live), args.rounds, lambda k: train_epoch(
        models[live[k]], x, y, rows[live[k]]["batch"], args))
    for i, seconds in zip(live, timings):
        rows[i]["epoch_seconds"] = seconds
    samples = args.steps * args.batch
    updates = samples // (args.batch * ACCUM_STEPS)
    for row in rows:
        if "error" in row:
            continue
        median = statistics.median(row["epoch_seconds"])
        row["median_seconds"] = median
        row["samples_per_second"] = samples / median
        row["optimizer_steps_per_second"] = updates / median
        row["fit_steps_per_second"] = row["fit_steps"] / median
        row["spread"] = spread(row["epoch_seconds"])
    keras_row = next(r for r in rows if r["method"] == KERAS)
    for row in rows:
        if "error" not in row and "error" not in keras_row:
            row["vs_keras"] = (row["optimizer_steps_per_second"]
                               / keras_row["optimizer_steps_per_second"])
    return rows


# --- Output -------------------------------------------------------------------


def format_cases(rows: list[dict]) -> str:
    header = ("case", "method", "batch", "fit steps", "iterations",
              "max abs diff vs big batch", "max abs change from init")
    cells = []
    for r in rows:
        if "error" in r:
            cells.append((r["case"], r["method"], str(r["batch"]), "-", "-",
                          "error (below)", "-"))
            continue
        diff = ("-" if r["method"] == BIG else
                "n/a" if r["diff"] is None else f"{r['diff']:.2e}")
        iterations = str(r["iterations"])
        if r["schedule_steps"] != r["iterations"]:
            iterations += f" ({r['schedule_steps']})"
        cells.append((r["case"], r["method"], str(r["batch"]),
                      str(r["fit_steps"]), iterations, diff,
                      f"{r['moved']:.2e}"))
    return markdown_table(header, cells, {0, 1})


def format_timing(rows: list[dict]) -> str:
    header = ("method", "batch", "fit steps/epoch", "median epoch s",
              "fit steps/s", "optimizer steps/s", "samples/s",
              "vs Keras's own", "spread")
    cells = []
    for r in rows:
        if "error" in r:
            cells.append((r["method"], str(r["batch"]), str(r["fit_steps"]),
                          "error (below)", "-", "-", "-", "-", "-"))
            continue
        vs = r.get("vs_keras")
        cells.append((
            r["method"], str(r["batch"]), str(r["fit_steps"]),
            f"{r['median_seconds']:.3f}",
            f"{r['fit_steps_per_second']:.1f}",
            f"{r['optimizer_steps_per_second']:.1f}",
            f"{r['samples_per_second']:,.0f}",
            "-" if vs is None else f"{vs:.2f}x",
            f"{100 * r['spread']:.0f}%",
        ))
    return markdown_table(header, cells, {0})


def _errors(rows: list[dict]) -> list[str]:
    return [f"{r.get('case', 'timing')} / {r['method']}:\n{r['error']}"
            for r in rows if "error" in r]


def machine_lines() -> list[str]:
    devices = jax.devices()
    return [
        f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
        "UTC",
        f"Machine: {platform.platform()}, {platform.machine()}, "
        f"{os.cpu_count()} CPU cores",
        f"JAX {jax.__version__}, Keras {keras.__version__} (backend "
        f"{keras.backend.backend()}), keras-mgpu {keras_mgpu.__version__}, "
        f"Python {platform.python_version()}",
        f"Devices: {len(devices)} x {devices[0].platform} "
        "(keras.distribution.DataParallel over all of them)",
    ]


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    if keras.backend.backend() != "jax":
        raise SystemExit(f"This benchmark needs KERAS_BACKEND=jax, got "
                         f"{keras.backend.backend()!r}.")
    fresh_session()
    start = time.perf_counter()
    for line in machine_lines():
        print(line)
    on_cpu = jax.devices()[0].platform == "cpu"
    if on_cpu:
        print("NOTE: the devices are logical CPU devices sharing the same "
              "cores: the timings show mechanics, not accelerator "
              "performance.")
    print()

    cases = CASES[:1] if args.quick else CASES
    print(f"## Against one big-batch step\n\nMLP {FEATURES}-2x{WIDTH}-"
          f"{CLASSES}, float32, sparse categorical crossentropy; micro-batch "
          f"{MICRO_BATCH}, accum_steps {ACCUM_STEPS} (big batch "
          f"{MICRO_BATCH * ACCUM_STEPS}); SGD lr {SGD_LR}, Adam lr "
          f"{ADAM_LR}; 64 samples x 2 epochs unless noted; no shuffling.\n",
          flush=True)
    case_rows = []
    for case in cases:
        case_rows.extend(run_case(case, args))
    print(format_cases(case_rows))
    print("\nCases:")
    for case in cases:
        if case.note:
            print(f"  {case.name}: {case.note}.")
    print("iterations: optimizer.iterations after fit; in parentheses, "
          "where it differs, the count learning-rate schedules read "
          "(optimizer._iterations: Keras's own counts micro-batches there)."
          "\nmax abs diff vs big batch: the largest "
          "|w - w_big| over all weights; max abs change from init: the "
          "largest |w - w_init|, for scale.")

    timing_rows: list[dict] = []
    if not args.no_timing:
        model = mlp(TIMING_FEATURES, TIMING_WIDTH, TIMING_CLASSES, depth=2)
        print(f"\n## Speed\n\n{model.name} ({model.count_params():,} "
              f"parameters), Adam, micro-batch {args.batch} (global), "
              f"accum_steps {ACCUM_STEPS}, {args.steps} micro-batches "
              f"({args.steps // ACCUM_STEPS} optimizer steps) per epoch; "
              f"1 warm-up epoch, then the median of {args.rounds} epochs, "
              "round-robin across the methods; "
              + ("Keras's asynchronous batch callbacks on.\n"
                 if args.async_callbacks else
                 "fit waits for each fit step (see --async-callbacks).\n"),
              flush=True)
        del model
        fresh_session()
        timing_rows = run_timing(args)
        print(format_timing(timing_rows))
        print("\noptimizer steps/s: samples/s / the big batch (the same "
              "for every method); vs Keras's own: optimizer steps/s over "
              "Keras's own, measured side by side (> 1: faster).\nspread: "
              "(slowest - fastest) / median of the timed epochs.")

    print("\nMethods:")
    for method in METHODS:
        print(f"  {method}: {DESCRIPTIONS[method]}.")
    errors = _errors(case_rows) + _errors(timing_rows)
    if errors:
        print("\nErrors:")
        for error in errors:
            print(error)
    elapsed = time.perf_counter() - start
    print(f"\nTotal {elapsed:.0f} s.")

    if args.json:
        payload = {
            "benchmark": "jax_accumulation_vs_keras",
            "date": datetime.date.today().isoformat(),
            "machine": {"platform": platform.platform(),
                        "cpu_count": os.cpu_count(),
                        "devices": [str(d) for d in jax.devices()]},
            "versions": {"jax": jax.__version__,
                         "keras": keras.__version__,
                         "keras_mgpu": keras_mgpu.__version__,
                         "python": platform.python_version()},
            "settings": {"accum_steps": ACCUM_STEPS,
                         "micro_batch": MICRO_BATCH,
                         "timing_batch": args.batch,
                         "timing_steps": args.steps,
                         "rounds": args.rounds, "quick": args.quick,
                         "async_callbacks": args.async_callbacks},
            "methods": DESCRIPTIONS,
            "cases": case_rows,
            "timing": timing_rows,
            "total_seconds": elapsed,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"Wrote {args.json}")


if __name__ == "__main__":
    main()
