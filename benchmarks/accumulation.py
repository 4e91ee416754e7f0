"""Benchmark: gradient accumulation, side by side with plain `fit`.

Compares, on the same synthetic data and the same number of micro-batches:

- plain `fit` (one optimizer step per micro-batch);
- Keras's built-in `Adam(gradient_accumulation_steps=N)` (1 replica only: it
  fails under `MirroredStrategy`; N >= 2 only, N = 1 being plain `fit`);
- `keras_mgpu.GradientAccumulationModel(model, accum_steps=N)`, the default
  `mode="window"`: the data batched to the micro-batch, one `fit` step per
  micro-batch;
- the same wrapper with `mode="in_step"`: the data batched to the big batch
  (N x the micro-batch, `steps / N` batches), one `fit` step per optimizer
  step, the micro-batches looped over inside the step;
- in-step with `compile(jit_compile=True)` ("+XLA"), which XLA-compiles
  the replica-local micro-batch loop only; for N >= 2, and by default for
  the MLP only (`--xla mlp,convnet` or `--xla none`): on a CPU, XLA's
  convolutions run several times slower than oneDNN's, and the ConvNet's
  XLA epochs would add minutes to the default run;

for an MLP and a small ConvNet, N = 1, 4, 8, on 1 and 2 replicas. Every
configuration is timed per micro-batch (epoch time / micro-batches in the
epoch), so in-step and window mode compare although their `fit` steps
differ. Without GPUs the replicas are logical CPU devices sharing the same
cores, so the figures show the mechanics (work added per micro-batch,
all-reduces and `fit` steps saved), not GPU performance.

Timing is paired: the configurations of one model and replica count are
built in one process, warmed up, then take turns epoch by epoch (round-
robin, several rounds); each figure is the median over rounds, and every
ratio printed compares medians measured side by side in that one run.

`--memory` measures peak memory instead (in-step against window mode and
plain `fit` at the micro-batch and at the big batch, for an MLP
512-4x1024-10 with a micro-batch of 1024 and N = 4 and 8), one fresh
subprocess per configuration, from TensorFlow's allocator statistics.

Run from the repository root (the default run takes a few minutes on 2 cores):

    .venv/bin/python benchmarks/accumulation.py
    .venv/bin/python benchmarks/accumulation.py --models mlp --accum 1,4 \\
        --replicas 1 --epochs 2 --steps 32 --json /tmp/accumulation.json
    .venv/bin/python benchmarks/accumulation.py --memory \\
        --json /tmp/accumulation_memory.json

This file is the command line; the benchmark itself is the package
`benchmarks/_accumulation/` (the configurations, the timed runs, the
ratios, the memory run).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
from typing import Optional, Sequence

# Runnable as a plain script from a checkout: the package lives one level up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# TensorFlow's C++ info lines would bury the progress lines and the table.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_mgpu  # noqa: E402  (sets KERAS_BACKEND before keras loads)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from _accumulation.configs import (  # noqa: E402
    BUILTIN, DESCRIPTIONS, IN_STEP, IN_STEP_VS_BUILTIN_TARGET,
    IN_STEP_VS_WINDOW_MEMORY_TARGET, IN_STEP_VS_WINDOW_TARGET, IN_STEP_XLA,
    MODELS, PLAIN, WRAPPER)
from _accumulation.memory import (  # noqa: E402
    MEMORY_CHILD_PREFIX, MEMORY_METHOD, build_memory_model, format_memory,
    memory_child, run_memory)
from _accumulation.ratios import compute_ratios, format_ratios  # noqa: E402
from _accumulation.timing import Result, format_table  # noqa: E402
from _accumulation.timing import make_strategies  # noqa: E402
from _accumulation.timing import run as run_timing  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    def int_list(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(
                f"expected positive integers such as 1,4,8, got {text!r}"
            )
        return sorted(set(values))

    def model_list(text: str, allow_none: bool = False) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        if allow_none and names == ["none"]:
            return []
        unknown = sorted(set(names) - set(MODELS))
        if not names or unknown:
            raise argparse.ArgumentTypeError(
                f"unknown model(s) {unknown}; choose from {','.join(MODELS)}"
            )
        return list(dict.fromkeys(names))

    parser = argparse.ArgumentParser(
        description="Gradient accumulation benchmark: plain fit, Keras's "
        "gradient_accumulation_steps and GradientAccumulationModel in window "
        "and in-step mode.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--models", type=model_list, default=",".join(MODELS),
                        help="comma-separated: mlp,convnet")
    parser.add_argument("--accum", type=int_list, default="1,4,8",
                        help="accumulation steps N, comma-separated")
    parser.add_argument("--replicas", type=int_list, default="1,2",
                        help="replica counts, comma-separated (logical CPUs "
                             "without GPUs)")
    parser.add_argument("--epochs", type=int, default=3,
                        help="timed epochs (rounds) per configuration, after "
                             "one untimed warm-up epoch")
    parser.add_argument("--steps", type=int, default=64,
                        help="micro-batches per epoch (in-step: steps / N "
                             "big batches)")
    parser.add_argument("--batch", type=int, default=32,
                        help="per-replica micro-batch size")
    # XLA's CPU convolutions run several times slower than oneDNN's: the
    # ConvNet's in-step+XLA epochs would add minutes to the default run and
    # say little, so only the MLP gets them by default.
    parser.add_argument("--xla", metavar="MODELS", default="mlp",
                        type=lambda text: model_list(text, allow_none=True),
                        help="models also timed in-step with "
                             "jit_compile=True (N >= 2), comma-separated, or "
                             "'none'; with --memory, 'none' leaves in-step+"
                             "XLA out")
    parser.add_argument("--memory", action="store_true",
                        help="measure peak memory (one subprocess per "
                             "configuration) instead of timing; uses "
                             "--memory-accum and --memory-batch")
    parser.add_argument("--memory-accum", type=int_list, default="4,8",
                        help="with --memory: accumulation steps N")
    parser.add_argument("--memory-batch", type=int, default=1024,
                        help="with --memory: the micro-batch (1 replica)")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the results as JSON here")
    # One --memory configuration, in its own process (internal).
    parser.add_argument("--memory-child", metavar="SPEC",
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.steps < 1 or args.batch < 1:
        parser.error("--epochs, --steps and --batch must be positive")
    if args.memory_batch < 1:
        parser.error("--memory-batch must be positive")
    if len([n for n in args.replicas if n > 1]) > 1:
        # Two MirroredStrategy objects over different device sets collide in
        # TensorFlow's collective executor, so one process gets one.
        parser.error("--replicas takes 1 and at most one other count")
    return args



def versions_line(on_gpu: bool) -> str:
    return (f"TensorFlow {tf.__version__}, Keras {keras.__version__}, "
            f"keras-mgpu {keras_mgpu.__version__}, Python "
            f"{platform.python_version()}, {os.cpu_count()} CPU cores, "
            f"{'GPUs' if on_gpu else 'no GPU'}")


def write_json(path: str, args: argparse.Namespace, on_gpu: bool,
               results: list[Result], ratios: dict, memory: Optional[dict],
               elapsed: float) -> None:
    """One schema for both runs: a timing run has `memory` null, a --memory
    run has no `results` and empty `ratios`."""
    payload = {
        "benchmark": "accumulation",
        "date": datetime.date.today().isoformat(),
        "versions": {
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "keras_mgpu": keras_mgpu.__version__,
            "python": platform.python_version(),
        },
        "cpu_count": os.cpu_count(),
        "gpu": on_gpu,
        "settings": {
            "models": args.models, "accum": args.accum,
            "replicas": args.replicas, "epochs": args.epochs,
            "steps": args.steps, "batch_per_replica": args.batch,
            "xla": args.xla, "memory": args.memory,
        },
        "configurations": DESCRIPTIONS,
        "targets": {
            "in_step_vs_builtin_time_per_micro_batch":
                IN_STEP_VS_BUILTIN_TARGET,
            "in_step_vs_window_time_per_micro_batch":
                IN_STEP_VS_WINDOW_TARGET,
            "in_step_vs_window_peak_memory": IN_STEP_VS_WINDOW_MEMORY_TARGET,
        },
        "results": [dataclasses.asdict(r) for r in results],
        "ratios": ratios,
        "memory": memory,
        "total_seconds": elapsed,
    }
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"Wrote {path}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    if args.memory_child:
        print(MEMORY_CHILD_PREFIX
              + json.dumps(memory_child(json.loads(args.memory_child))))
        return
    if args.memory:
        on_gpu = bool(tf.config.list_physical_devices("GPU"))
        print(versions_line(on_gpu))
        print(f"Peak memory, {build_memory_model().name}, micro-batch "
              f"{args.memory_batch}, N = "
              f"{', '.join(map(str, args.memory_accum))}.\n"
              f"How: {MEMORY_METHOD}\n", flush=True)
        start = time.perf_counter()
        memory = run_memory(args)
        elapsed = time.perf_counter() - start
        print()
        print(format_memory(memory))
        print(f"\nTotal {elapsed:.0f} s.")
        if args.json:
            write_json(args.json, args, on_gpu, [], {}, memory, elapsed)
        return

    strategies = make_strategies(args.replicas)
    on_gpu = bool(tf.config.list_physical_devices("GPU"))

    print(versions_line(on_gpu))
    if not on_gpu:
        print("NOTE: replicas are logical CPU devices sharing the same cores. "
              "These figures show the mechanics (work added per micro-batch, "
              "all-reduces saved), not GPU performance.")
    print(f"{args.steps} micro-batches of {args.batch} per replica per epoch "
          "(in-step: batches of N micro-batches); 1 warm-up epoch, then the "
          f"median of {args.epochs} timed epochs, interleaved (round-robin) "
          "across the configurations of each model and replica count.")
    uneven = [n for n in args.accum if args.steps % n and args.steps >= n]
    if uneven:
        print(f"NOTE: --steps {args.steps} is not a multiple of N = "
              f"{', '.join(map(str, uneven))}: in-step epochs there hold "
              "steps // N big batches, and are timed per micro-batch they "
              "hold.")
    print()

    start = time.perf_counter()
    results: list[Result] = run_timing(args, strategies)
    elapsed = time.perf_counter() - start

    ratios = compute_ratios(results, args)
    print()
    print(format_table(results))
    print("\nConfigurations:")
    for config in (PLAIN, BUILTIN, WRAPPER, IN_STEP, IN_STEP_XLA):
        if any(r.config == config for r in results):
            print(f"  {config}: {DESCRIPTIONS[config]}.")
    print("vs plain: time per micro-batch relative to plain fit with the "
          "same model and replicas.\nfit steps: fit steps per epoch (in-step: "
          "one per N micro-batches).\nspread: (slowest - fastest) / median "
          "of the timed epochs.\n")
    print(format_ratios(ratios))
    print(f"\nTotal {elapsed:.0f} s.")

    if args.json:
        write_json(args.json, args, on_gpu, results, ratios, None, elapsed)


if __name__ == "__main__":
    main()
