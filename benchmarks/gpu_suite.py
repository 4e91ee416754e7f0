"""Every figure a GPU machine should give, from one command: gpu_suite.json, .md.

GPU time is scarce and brief (minutes, with a limit per command), so one
command gets every GPU figure the project needs, in at most 8 minutes on
one GPU:

    python benchmarks/gpu_suite.py --out DIR        # on the GPU machine
    OUT=DIR python benchmarks/gpu_suite.py          # the same, into $OUT
    python benchmarks/gpu_suite.py --dry-run --out DIR   # on CPU, tiny sizes
    python benchmarks/gpu_suite.py --budget-s 300 --out DIR

`--out` wins over `$OUT`; one of them is required. The dry run runs every
part on the CPU (GPUs hidden) with tiny sizes, in about a minute on 2 cores:
the test suite runs it (`tests/test_gpu_suite.py`), so the GPU run's code
has run before it reaches a GPU. On a machine where TensorFlow sees
no GPU, a run without `--dry-run` records the machine and skips the other
parts: at GPU sizes they would take hours on a CPU. A Python without
TensorFlow, Keras, NumPy or pytest (a GPU machine's own Python may hold
other frameworks only) gets every part skipped, with one note naming what
is missing; nothing is imported to find out.

Parts, in the order they run:

1. `machine`: `keras-mgpu doctor --json` (GPU name, memory, compute
   capability, CUDA/cuDNN of the TensorFlow build, interconnect topology)
   and the driver version from `nvidia-smi`.
2. `gpu_tests`: `pytest -m gpu`, the tests that mean something on a GPU
   (mixed precision with `FP32OutputHead`, `LossScaleOptimizer` under
   accumulation, the non-finite counters, GPU memory telemetry): passed,
   failed, skipped and error counts, the failures, the duration. The dry run
   only collects them (`--collect-only`).
3. `resnet50`: `keras.applications.ResNet50(weights=None)` on synthetic
   data (one batch, repeated, prefetched to the GPU): examples/s and peak
   GPU memory (`tf.config.experimental.get_memory_info`, reset between
   configurations) in float32, `mixed_float16` and `mixed_bfloat16`, each
   with `jit_compile=False` and `True`, with ratios against float32 without
   XLA. The dry run builds ResNet-50 (its parameter count) but trains a
   small ResNet-style stand-in: ResNet-50's first step alone takes 10 to
   90 s per configuration on 2 CPU cores.
4. `logical_gpus`: the one physical GPU split into two logical GPUs
   (`tf.config.set_logical_device_configuration`) under `MirroredStrategy`:
   `GradientAccumulationModel` against the big-batch step (largest absolute
   weight difference; on a GPU with and without TensorFloat-32) and the
   all-reduces run per optimizer step (eagerly, counted as
   `tests/test_accumulation.py` counts them). The dry run uses 2 logical
   CPUs.
5. `overheads`, each a ratio of epoch times measured side by side in one
   run (configurations take turns, round by round; each ratio is paired
   within a round, the median over rounds, with the quartiles):
   `GradientAccumulationModel(accum_steps=4)` (window mode), the same with
   `mode="in_step"` (the same samples batched to 4 micro-batches, a
   quarter of the steps), Keras's `gradient_accumulation_steps=4` and
   plain `fit`; `DistributedLogger` at `update_freq=1` and `100` against no
   callback; `BackupAndRestore` saving every 100 steps against none. Every
   configuration's epoch holds the same micro-batches, so its epoch time
   (and `step_ms`, per micro-batch) compares with the others'.

Each part runs in its own process: device configuration (logical devices,
memory statistics) stays per part, and a part is killed when its time
budget is spent. A part's budget is its share of `--budget-s` plus what the
earlier parts left unused (printed as each part starts). A part that fails
or overruns is recorded with status `"failed"` or `"skipped"` and a note
(the reason and the end of its stderr); the figures it wrote before that
and every other part's figures are kept. The files are written after every
part, so even a suite killed from outside leaves the parts it finished;
SIGTERM (as `timeout` sends) stops the running part and writes the files.
Exit code: 0 when every part is `"ok"`, 1 otherwise, 2 on a usage error.

No figure is made up: a figure that cannot be measured here (GPU memory,
the driver, TensorFloat-32 on a CPU) is `null`, with the reason beside it.

JSON schema (`gpu_suite.json`), schema id `keras-mgpu-gpu-suite/1`, the same
for the dry run and the GPU run:

    {"schema": "keras-mgpu-gpu-suite/1",
     "date": str,                 # UTC start, ISO 8601
     "mode": "dry-run"|"gpu",
     "command": [str],            # argv
     "budget_s": float, "seconds": float,     # the suite's wall time
     "machine": {"gpus": [{"name": str|null, "memory_mib": int|null,
                           "compute_capability": [int, int]|null,
                           "visible_to_tensorflow": bool}],
                 "tensorflow_gpus": int,      # GPUs TensorFlow sees
                 "driver_version": str|null,
                 "interconnect": str|null,    # doctor's kind: nvlink, pcie...
                 "cuda_version": str|null, "cudnn_version": str|null,
                 "python": str, "tensorflow": str|null, "keras": str|null,
                 "keras_mgpu": str|null, "cpu_count": int,
                 "reason": str|null},         # why GPU fields are null
     "parts": {name: {"status": "ok"|"failed"|"skipped",
                      "seconds": float, "budget_s": float,
                      "note": str|null,       # why, and the stderr tail
                      "results": dict|null}}} # below, per part

    parts.machine.results:
        {"doctor": {...},                     # keras-mgpu-doctor/1, whole
         "driver_version": str|null, "driver_reason": str|null}
    parts.gpu_tests.results:
        {"mode": "run"|"collect-only", "command": [str],
         "collected": int, "tests": [str],    # node ids
         "passed": int|null, "failed": int|null, "skipped": int|null,
         "errors": int|null,                  # null when only collected
         "duration_s": float|null,            # pytest's own
         "failures": [{"test": str, "message": str}]}
    parts.resnet50.results:
        {"model": "ResNet50", "model_params": int,   # at the GPU size
         "trained": str, "trained_params": int,      # the stand-in when dry
         "image_size": int, "classes": int, "batch_size": int,
         "warmup_steps": int, "steps": int, "repeats": int,
         "device": str, "tensor_float_32": bool|null,
         "memory_reason": str|null,
         "configs": [{"policy": str, "jit_compile": bool,
                      "status": "ok"|"failed"|"not run",
                      "error": str|null,
                      "seconds": float|null,  # build, compile, warm-up, timed
                      "epoch_seconds": [float],
                      "step_ms": float|null, "examples_per_s": float|null,
                      "start_memory_bytes": int|null,
                      "peak_memory_bytes": int|null,
                      "speedup": float|null,      # examples/s / float32's
                      "memory_ratio": float|null}]}  # peak / float32's
    parts.logical_gpus.results:
        {"device_kind": "GPU"|"CPU", "devices": [str],
         "memory_limit_mib": int|null,
         "exactness": {"micro_batch": int, "micro_batches": int,
                       "accum_steps": int, "tolerance": float,
                       "runs": [{"optimizer": str,
                                 "tensor_float_32": bool|null,
                                 "optimizer_steps": int,
                                 "reference_moved": float,
                                 "max_abs_weight_diff": float}],
                       "max_abs_weight_diff": float|null},
         "all_reduce": {"micro_batches": int, "accum_steps": int,
                        "executed": {"plain"|"accumulated":
                                     {"all_reduces": int,
                                      "optimizer_steps": int,
                                      "per_optimizer_step": float}},
                        "expected": {"per_optimizer_step": 1.0}}}
    parts.overheads.results:
        {"model": str, "params": int, "batch_size": int,
         "steps_per_epoch": int, "epochs_per_fit": int,
         "timed_epochs_per_fit": int, "rounds": int, "jit_compile": false,
         "device": str,
         "configs": [{"name": str, "epoch_s": float,
                      "step_ms": float,       # per micro-batch
                      "examples_per_s": float}],
         "ratios": [{"name": str, "of": str, "against": str,
                     "median": float, "q1": float, "q3": float}],
         "backup": {"saves": int, "stall_ms": float|null}}

`mode` differs between the two runs, and so do sizes and values; the keys
do not.

This file is the command line; the suite itself is the package
`benchmarks/_gpu_suite/` (the runner, the report, a module per part).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

# Imported first: the package notes when this process started, and a part's
# budget counts from then. Standard library only, as is all the parent
# imports, so that a Python without TensorFlow still gets both files.
from _gpu_suite import CHILD_PARTS, DEFAULT_BUDGET_S, child
from _gpu_suite.suite import run_suite


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpu_suite.py",
        description=__doc__.splitlines()[0],
        epilog="The JSON schema is in this file's docstring.")
    parser.add_argument("--out", metavar="DIR",
                        help="where gpu_suite.json and gpu_suite.md go "
                             "(created if missing); default: $OUT")
    parser.add_argument("--dry-run", action="store_true",
                        help="every part on the CPU at tiny sizes (under a "
                             "minute on 2 cores)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        metavar="SECONDS",
                        help="time for all parts together, shared as printed "
                             f"(default {DEFAULT_BUDGET_S:.0f})")
    # A part's own process (the parent runs this file again).
    parser.add_argument("--_part", choices=sorted(CHILD_PARTS),
                        help=argparse.SUPPRESS)
    parser.add_argument("--_result", help=argparse.SUPPRESS)
    parser.add_argument("--_budget-s", type=float, help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args._part:
        return child.main(args._part, args._result, args.dry_run,
                          args._budget_s)
    if not (args.budget_s > 0 and math.isfinite(args.budget_s)):
        parser.error(f"--budget-s must be a positive number of seconds, got "
                     f"{args.budget_s!r}.")
    out_dir = args.out or os.environ.get("OUT")
    if not out_dir:
        parser.error("no output folder: pass --out DIR or set $OUT (the "
                     "folder gpu_suite.json and gpu_suite.md are written "
                     "to).")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        parser.error(f"cannot create the output folder {out_dir!r}: {e}")
    if not os.access(out_dir, os.W_OK):
        parser.error(f"the output folder {out_dir!r} is not writable.")
    return run_suite(out_dir, args.dry_run, args.budget_s,
                     [os.path.basename(sys.argv[0])] + list(
                         sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
