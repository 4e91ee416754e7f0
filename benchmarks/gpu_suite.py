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
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

# A part's process counts its budget from here: TensorFlow's import (5 to
# 15 s) is part of what the budget pays for.
_STARTED = time.monotonic()

SCHEMA = "keras-mgpu-gpu-suite/1"
# 8 minutes on the GPU machine, with half a minute to spare for the
# processes' start and the files.
DEFAULT_BUDGET_S = 450.0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JSON_NAME, MARKDOWN_NAME = "gpu_suite.json", "gpu_suite.md"

# (name, share of the budget, what it measures). ResNet-50 gets the largest
# share: six configurations, three of them compiled by XLA (tens of seconds
# each on a GPU).
PARTS = (
    ("machine", 0.05, "keras-mgpu doctor --json and the driver version"),
    ("gpu_tests", 0.20, "pytest -m gpu"),
    ("resnet50", 0.40, "ResNet-50 examples/s and peak memory, 3 policies x "
                       "jit_compile"),
    ("logical_gpus", 0.10, "2 logical GPUs: accumulation exactness and "
                           "all-reduces per step"),
    ("overheads", 0.25, "accumulation, DistributedLogger and "
                        "BackupAndRestore against plain fit"),
)
PART_NAMES = tuple(name for name, _, _ in PARTS)

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
# ResNet-50's configurations, in the order they run: the baseline first,
# then by interest on a Hopper GPU (bfloat16 is its native half type), the
# XLA ones last, so that when time runs out, float32 with XLA goes first.
RESNET_CONFIGS = (("float32", False), ("mixed_bfloat16", False),
                  ("mixed_float16", False), ("mixed_bfloat16", True),
                  ("mixed_float16", True), ("float32", True))
NO_GPU = ("no GPU: TensorFlow keeps memory statistics for GPUs only "
          "(tf.config.experimental.get_memory_info)")

# Sizes per mode. The GPU sizes are what fits the budget on one H200 with
# room to spare (estimated, not yet measured there); the dry-run sizes are
# the smallest that still run every code path.
RESNET_SIZES = {
    "gpu": dict(image_size=224, classes=1000, batch_size=256,
                warmup_steps=5, steps=10, repeats=3),
    "dry-run": dict(image_size=32, classes=10, batch_size=2,
                    warmup_steps=1, steps=2, repeats=1),
}
# The GPU run's ResNet-50 input; the dry run builds it at this size too.
RESNET_GPU_INPUT = (224, 224, 3)
OVERHEAD_SIZES = {
    # Keras's per-step overhead dominates a ~1 ms step: where a callback's
    # cost shows most. `steps` is a multiple of ACCUM_STEPS, so in-step
    # mode's big batches hold every micro-batch.
    "gpu": dict(features=784, width=2048, classes=10, batch_size=256,
                steps=200, epochs=3, rounds=7),
    # 100 steps per epoch, so that BackupAndRestore(save_freq=100) saves in
    # the timed epoch.
    "dry-run": dict(features=16, width=32, classes=10, batch_size=16,
                    steps=100, epochs=2, rounds=2),
}
ACCUM_STEPS = 4
# Each of the two logical GPUs; the models of that part need a few MiB.
LOGICAL_GPU_MIB = 4096
# Each is measured with and without TensorFloat-32 on a GPU.
EXACTNESS_OPTIMIZERS = {"gpu": ("adam", "sgd_momentum"), "dry-run": ("adam",)}
EXACTNESS_TOLERANCE = 1e-5
TAIL_LINES, TAIL_CHARS = 25, 3000
# TensorFlow's start-up INFO lines: noise in a failure's stderr tail.
_NOISE = re.compile(r"^(I\d{4} |WARNING: All log messages before absl"
                    r"|To enable the following instructions:)")
# In the dry run, CUDA_VISIBLE_DEVICES=-1 makes this error line certain.
_DRY_RUN_NOISE = re.compile(r"^E\d{4} .*failed call to cuInit")


# --- Parent: runs the parts, writes the files (standard library only) --------


class _Stop(Exception):
    """SIGTERM or SIGINT arrived: stop the running part, write the files."""


def _tail(text: str) -> str:
    lines = [line for line in (text or "").splitlines()
             if line.strip() and not _NOISE.match(line)]
    return "\n".join(lines[-TAIL_LINES:])[-TAIL_CHARS:]


def _child_env(dry_run: bool) -> dict:
    env = dict(os.environ)
    # The suite is local: a cluster's TF_CONFIG would make the parts wait
    # for workers that are not there.
    env.pop("TF_CONFIG", None)
    # A pytest running this suite (tests/test_gpu_suite.py) must not leak
    # its own worker settings into the nested pytest.
    for key in [k for k in env if k.startswith("PYTEST_")]:
        env.pop(key)
    env.setdefault("KERAS_BACKEND", "tensorflow")
    # Errors still show (a failed part's stderr tail is its note); INFO and
    # warnings do not.
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # The checkout's keras_mgpu, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO, env.get("PYTHONPATH")) if p)
    if dry_run:
        # "Every part on the CPU", even on a machine with GPUs.
        env["CUDA_VISIBLE_DEVICES"] = "-1"
        # The dry run checks that XLA compiles and runs the steps, not how
        # fast XLA's CPU code is: unoptimised code compiles in 2 s instead
        # of 3.5 s per configuration on 2 cores.
        env.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
    return env


class _Runner:
    """Runs one command at a time in its own process group, within a budget."""

    def __init__(self, env: dict, workdir: str, dry_run: bool):
        self.env = env
        self.workdir = workdir
        self.dry_run = dry_run
        self.process = None
        self.stopping = False

    def run(self, command: list, budget_s: float, name: str,
            env: dict = None):
        """(exit code or None if killed at the budget, stdout, stderr, s).

        Output goes to files, not pipes: a process the command started and
        that outlives it cannot keep the suite waiting on a pipe.
        """
        out_path = os.path.join(self.workdir, f"{name}.stdout")
        err_path = os.path.join(self.workdir, f"{name}.stderr")
        start = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                env={**self.env, **(env or {})}, cwd=REPO,
                start_new_session=True)
            try:
                code = self.process.wait(timeout=max(budget_s, 0.001))
            except subprocess.TimeoutExpired:
                self.kill()
                code = None
            except _Stop:
                self.kill()
                raise
            finally:
                self.process = None
        seconds = time.monotonic() - start
        with open(out_path, errors="replace") as f:
            stdout = f.read()
        with open(err_path, errors="replace") as f:
            stderr = "".join(line for line in f if not (
                self.dry_run and _DRY_RUN_NOISE.match(line)))
        return code, stdout, stderr, seconds

    def kill(self) -> None:
        process = self.process
        if process is None:
            return
        # The whole group: pytest's and TensorFlow's own child processes too.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        process.wait()


def missing_packages() -> list:
    """What the parts need and this Python lacks (nothing is imported).

    Checked first: a GPU machine's own Python may hold other frameworks
    and not TensorFlow, and one clear note beats five tracebacks.
    """
    return [name for name in ("tensorflow", "keras", "numpy", "pytest")
            if importlib.util.find_spec(name) is None]


def _part_budget(index: int, total: float, elapsed: float) -> float:
    """This part's share plus what the earlier parts left unused."""
    planned = sum(share for _, share, _ in PARTS[:index + 1]) * total
    return planned - elapsed


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _entry(status, seconds, budget_s, note=None, results=None) -> dict:
    # A budget the earlier parts used up is recorded as 0, not negative.
    return {"status": status, "seconds": round(seconds, 3),
            "budget_s": round(max(budget_s, 0.0), 3), "note": note,
            "results": results}


def _s(seconds: float) -> str:
    """Seconds for people: 450, 22.5, 0.0025."""
    return format(max(seconds, 0.0), ".3g")


def _over_budget(budget_s: float, seconds: float, stderr: str,
                 kept: bool) -> str:
    note = (f"over its budget of {_s(budget_s)} s: stopped after "
            f"{_s(seconds)} s")
    note += "; the figures it wrote before are kept." if kept else "."
    tail = _tail(stderr)
    return note + (f"\nstderr:\n{tail}" if tail else "")


def _failed(code: int, stderr: str, stdout: str = "") -> str:
    tail = _tail(stderr) or _tail(stdout)
    return f"exited with code {code}." + (f"\nstderr:\n{tail}" if tail
                                          else "")


def _run_machine(runner: _Runner, budget_s: float) -> dict:
    # `-m keras_mgpu.cli` works from the checkout without the console script.
    code, stdout, stderr, seconds = runner.run(
        [sys.executable, "-m", "keras_mgpu.cli", "doctor", "--json"],
        budget_s, "machine")
    if code is None:
        return _entry("skipped", seconds, budget_s,
                      _over_budget(budget_s, seconds, stderr, False))
    try:
        report = json.loads(stdout)
    except ValueError:
        return _entry("failed", seconds, budget_s,
                      "keras-mgpu doctor --json printed no JSON; "
                      + _failed(code, stderr, stdout))
    results = {"doctor": report, "driver_version": None,
               "driver_reason": None}
    # The doctor does not report the driver; nvidia-smi does.
    if shutil.which("nvidia-smi") is None:
        results["driver_reason"] = "nvidia-smi not found (no NVIDIA driver)"
    else:
        smi_code, smi_out, smi_err, smi_s = runner.run(
            ["nvidia-smi", "--query-gpu=driver_version",
             "--format=csv,noheader"], budget_s - seconds, "nvidia-smi")
        seconds += smi_s
        versions = sorted({line.strip() for line in smi_out.splitlines()
                           if line.strip()})
        if smi_code == 0 and versions:
            results["driver_version"] = ", ".join(versions)
        else:
            results["driver_reason"] = (
                f"nvidia-smi --query-gpu=driver_version failed: "
                f"{_tail(smi_err) or smi_code}")
    # Exit code 1 is the doctor's "a finding of level error": the report is
    # still the figure, with its findings.
    note = None if code == 0 else (
        "keras-mgpu doctor reported an error finding: "
        + "; ".join(f["message"] for f in report.get("findings", [])
                    if f.get("level") == "error"))
    return _entry("ok", seconds, budget_s, note, results)


def _gpu_test_files() -> list:
    """The test files that mark tests gpu (all of tests/ if none does).

    `pytest -m gpu` over these collects what it collects over tests/, a few
    seconds sooner: the other modules (the tuner's, TensorBoard's) are not
    imported.
    """
    tests = os.path.join(REPO, "tests")
    files = []
    for name in sorted(os.listdir(tests)):
        if name.startswith("test_") and name.endswith(".py"):
            with open(os.path.join(tests, name), errors="replace") as f:
                if "pytest.mark.gpu" in f.read():
                    files.append(f"tests/{name}")
    return files or ["tests"]


_TEST_LINE = re.compile(
    r"^(tests/\S.*?::\S.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_SUMMARY_FAILURE = re.compile(r"^(FAILED|ERROR) (tests/\S+)(?: - (.*))?$")
_DURATION = re.compile(r"^=+ .* in ([0-9.]+)s")


def _run_gpu_tests(runner: _Runner, budget_s: float, dry_run: bool) -> dict:
    # -p no:cacheprovider: the GPU machine's copy of the checkout, or CI's,
    # gets no .pytest_cache.
    command = [sys.executable, "-m", "pytest", "-m", "gpu",
               "-p", "no:cacheprovider", *_gpu_test_files()]
    command += ["--collect-only", "-q"] if dry_run else ["-v"]
    # A wide "terminal": pytest cuts its summary lines, the failures'
    # messages with them, to the terminal's width.
    code, stdout, stderr, seconds = runner.run(command, budget_s,
                                               "gpu_tests",
                                               env={"COLUMNS": "400"})
    results = {"mode": "collect-only" if dry_run else "run",
               "command": ["python"] + command[1:], "collected": 0,
               "tests": [], "passed": None, "failed": None, "skipped": None,
               "errors": None, "duration_s": None, "failures": []}
    lines = stdout.splitlines()
    if dry_run:
        results["tests"] = [line.strip() for line in lines
                            if line.startswith("tests/") and "::" in line]
    else:
        outcomes = {}
        for line in lines:
            match = _TEST_LINE.match(line)
            if match:
                outcomes[match.group(1)] = match.group(2)
        counts = [list(outcomes.values()).count(kind) for kind in
                  ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS")]
        results.update(tests=list(outcomes), passed=counts[0] + counts[5],
                       failed=counts[1], skipped=counts[2] + counts[4],
                       errors=counts[3])
        for line in lines:
            match = _SUMMARY_FAILURE.match(line)
            if match:
                results["failures"].append(
                    {"test": match.group(2), "message": match.group(3) or ""})
            match = _DURATION.match(line)
            if match:
                results["duration_s"] = float(match.group(1))
    results["collected"] = len(results["tests"])
    if code is None:
        seen = bool(results["tests"])
        return _entry("skipped", seconds, budget_s,
                      _over_budget(budget_s, seconds, stderr, seen),
                      results if seen else None)
    if code == 5:
        return _entry("failed", seconds, budget_s,
                      "no test is marked gpu (pytest exit code 5).", results)
    if code == 1 and not dry_run:
        failed = [f["test"] for f in results["failures"]]
        return _entry("failed", seconds, budget_s,
                      f"{len(failed)} test(s) failed: " + ", ".join(failed),
                      results)
    if code != 0:
        return _entry("failed", seconds, budget_s,
                      _failed(code, stderr, stdout), results)
    return _entry("ok", seconds, budget_s, None, results)


def _run_child_part(runner: _Runner, name: str, budget_s: float,
                    dry_run: bool) -> dict:
    result_path = os.path.join(runner.workdir, f"{name}.json")
    command = [sys.executable, os.path.abspath(__file__), "--_part", name,
               "--_result", result_path, "--_budget-s", f"{budget_s:.3f}"]
    if dry_run:
        command.append("--dry-run")
    code, stdout, stderr, seconds = runner.run(command, budget_s, name)
    written = _read_json(result_path) or {}
    results, note = written.get("results"), written.get("note")
    for line in stdout.splitlines():
        print(f"    {line}")
    if code is None:
        return _entry("skipped", seconds, budget_s,
                      _over_budget(budget_s, seconds, stderr,
                                   results is not None), results)
    if code != 0:
        return _entry("failed", seconds, budget_s, _failed(code, stderr),
                      results)
    if results is None:
        return _entry("failed", seconds, budget_s,
                      "exited without writing its results.")
    return _entry("ok", seconds, budget_s, note, results)


def machine_summary(parts: dict) -> dict:
    """The top-level `machine` object, from the machine part's results."""
    summary = {"gpus": [], "tensorflow_gpus": 0, "driver_version": None,
               "interconnect": None, "cuda_version": None,
               "cudnn_version": None,
               "python": platform.python_version(), "tensorflow": None,
               "keras": None, "keras_mgpu": None,
               "cpu_count": os.cpu_count() or 1, "reason": None}
    results = (parts.get("machine") or {}).get("results") or {}
    report = results.get("doctor")
    if not report:
        summary["reason"] = "the machine part has no report (see its note)"
        return summary
    software = report.get("software", {})
    build = report.get("tensorflow_build", {})
    summary.update(
        gpus=[{key: gpu.get(key) for key in
               ("name", "memory_mib", "compute_capability",
                "visible_to_tensorflow")} for gpu in report.get("gpus", [])],
        tensorflow_gpus=sum(d.get("type") == "GPU"
                            for d in report.get("devices", [])),
        driver_version=results.get("driver_version"),
        interconnect=(report.get("interconnect") or {}).get("kind"),
        cuda_version=build.get("cuda_version"),
        cudnn_version=build.get("cudnn_version"),
        tensorflow=software.get("TensorFlow"), keras=software.get("Keras"),
        keras_mgpu=software.get("keras-mgpu"))
    if not summary["tensorflow_gpus"]:
        summary["reason"] = "no GPU visible to TensorFlow" + (
            "; " + results["driver_reason"]
            if results.get("driver_reason") else "")
    return summary


def write_files(payload: dict, out_dir: str) -> None:
    """Writes both files, each atomically (a reader never sees half)."""
    for name, text in ((JSON_NAME, json.dumps(payload, indent=2,
                                              allow_nan=False) + "\n"),
                       (MARKDOWN_NAME, format_markdown(payload))):
        path = os.path.join(out_dir, name)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


def run_suite(out_dir: str, dry_run: bool, budget_s: float,
              argv: list) -> int:
    """Runs every part, writing the files after each; the exit code."""
    mode = "dry-run" if dry_run else "gpu"
    payload = {"schema": SCHEMA,
               "date": datetime.datetime.now(datetime.timezone.utc)
               .isoformat(timespec="seconds"),
               "mode": mode, "command": list(argv),
               "budget_s": budget_s, "seconds": 0.0, "machine": {},
               "parts": {}}
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="keras_mgpu_gpu_suite_")
    runner = _Runner(_child_env(dry_run), workdir, dry_run)

    def stop(signum, frame):
        if not runner.stopping:
            runner.stopping = True
            raise _Stop(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, stop)
                for sig in (signal.SIGTERM, signal.SIGINT)}
    print(f"keras-mgpu GPU suite ({mode}): budget {_s(budget_s)} s, "
          f"writing {os.path.join(out_dir, JSON_NAME)} and {MARKDOWN_NAME}")
    for name, share, what in PARTS:
        print(f"  {name}: {100 * share:.0f}% = {_s(share * budget_s)} s "
              f"({what})")
    parts = payload["parts"]
    missing = missing_packages()
    try:
        for index, (name, share, _) in enumerate(PARTS):
            elapsed = time.monotonic() - start
            budget = _part_budget(index, budget_s, elapsed)
            print(f"[{index + 1}/{len(PARTS)}] {name}: budget {_s(budget)} s"
                  f" ({100 * share:.0f}% of {_s(budget_s)} s, plus "
                  f"{_s(budget - share * budget_s)} s the earlier parts "
                  "left)", flush=True)
            no_gpu = (not dry_run and name != "machine"
                      and parts["machine"]["status"] == "ok"
                      and not payload["machine"]["tensorflow_gpus"])
            if missing:
                parts[name] = _entry(
                    "skipped", 0.0, budget,
                    f"{sys.executable} has no {', '.join(missing)}: install "
                    "keras-mgpu's test extra (pip install -e '.[test]'; "
                    "TensorFlow with CUDA on a GPU machine: pip install "
                    "'tensorflow[and-cuda]'), or run the suite with a Python "
                    "that has them.")
            elif no_gpu:
                parts[name] = _entry(
                    "skipped", 0.0, budget,
                    "no GPU visible to TensorFlow (keras-mgpu doctor): at "
                    "GPU sizes this part would take hours on the CPU; "
                    "`--dry-run` runs it at CPU sizes.")
            elif budget <= 0:
                parts[name] = _entry("skipped", 0.0, budget,
                                     "no time left in the budget.")
            elif name == "machine":
                parts[name] = _run_machine(runner, budget)
            elif name == "gpu_tests":
                parts[name] = _run_gpu_tests(runner, budget, dry_run)
            else:
                parts[name] = _run_child_part(runner, name, budget, dry_run)
            entry = parts[name]
            first_line = (entry["note"] or "").splitlines()[:1]
            print(f"    {entry['status']} in {_s(entry['seconds'])} s"
                  + (f": {first_line[0]}" if first_line else ""), flush=True)
            payload["machine"] = machine_summary(parts)
            payload["seconds"] = round(time.monotonic() - start, 3)
            write_files(payload, out_dir)
    except _Stop as e:
        for name in PART_NAMES:
            if name not in parts:
                # The running part's figures so far, if it wrote any.
                written = _read_json(os.path.join(workdir, f"{name}.json"))
                parts[name] = _entry(
                    "skipped", 0.0, 0.0,
                    f"the suite was stopped ({e}) before this part ended.",
                    (written or {}).get("results"))
        print(f"stopped by {e}", file=sys.stderr)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(workdir, ignore_errors=True)
    payload["machine"] = machine_summary(parts)
    payload["seconds"] = round(time.monotonic() - start, 3)
    write_files(payload, out_dir)
    statuses = {name: parts[name]["status"] for name in PART_NAMES}
    print(f"done in {_s(payload['seconds'])} s: "
          + ", ".join(f"{n} {s}" for n, s in statuses.items()))
    return 0 if set(statuses.values()) == {"ok"} else 1


# --- Markdown ----------------------------------------------------------------


def _cell(value, spec: str = "", missing: str = "n/a") -> str:
    if value is None:
        return missing
    if isinstance(value, float) and spec:
        return format(value, spec)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: list, rows: list) -> list:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def _mib(value) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.0f}"


def _md_machine(results: dict) -> list:
    report = results.get("doctor") or {}
    lines = [f"Driver: {results.get('driver_version') or 'n/a'}"
             + (f" ({results['driver_reason']})"
                if results.get("driver_reason") else ""), ""]
    gpus = report.get("gpus") or []
    if gpus:
        lines += _table(["index", "GPU", "memory MiB", "compute capability",
                         "PCI bus", "visible to TensorFlow"],
                        [[_cell(g.get("index")), _cell(g.get("name")),
                          _cell(g.get("memory_mib")),
                          _cell(".".join(map(str, g["compute_capability"]))
                                if g.get("compute_capability") else None),
                          _cell(g.get("pci_bus_id")),
                          _cell(g.get("visible_to_tensorflow"))]
                         for g in gpus])
    topo = report.get("interconnect")
    if topo:
        lines += [f"Interconnect: {topo.get('kind')}", ""]
        lines += _table([""] + list(topo.get("gpus", [])),
                        [[_cell(gpu)] + [_cell(c) for c in row] for gpu, row
                         in zip(topo.get("gpus", []), topo.get("matrix", []))])
    for finding in report.get("findings", []):
        lines.append(f"- {finding.get('level')}: {finding.get('message')}")
    return lines + [""]


def _md_gpu_tests(results: dict) -> list:
    lines = [f"`{' '.join(results.get('command', []))}`", ""]
    if results.get("mode") == "collect-only":
        lines += [f"Collected only (dry run): {results.get('collected')} "
                  "tests marked gpu.", ""]
    else:
        lines += _table(["collected", "passed", "failed", "skipped",
                         "errors", "pytest s"],
                        [[_cell(results.get(k), ".1f") for k in
                          ("collected", "passed", "failed", "skipped",
                           "errors", "duration_s")]])
    for failure in results.get("failures", []):
        lines.append(f"- FAILED `{failure['test']}`: "
                     f"{_cell(failure['message'])}")
    return lines + [""]


def _md_resnet(results: dict) -> list:
    lines = [f"{results.get('model')} ({results.get('model_params', 0):,} "
             f"parameters); trained: {results.get('trained')} "
             f"({results.get('trained_params', 0):,} parameters), image "
             f"{results.get('image_size')}, batch {results.get('batch_size')}"
             f", {results.get('steps')} steps x {results.get('repeats')} "
             f"timed epochs (median) after {results.get('warmup_steps')} "
             f"warm-up steps, on {results.get('device')}; TensorFloat-32: "
             f"{_cell(results.get('tensor_float_32'))}.", ""]
    lines += _table(
        ["policy", "jit_compile", "examples/s", "x float32", "peak MiB",
         "memory x float32", "status"],
        [[_cell(c["policy"]), _cell(c["jit_compile"]),
          _cell(c.get("examples_per_s"), ",.1f"),
          _cell(c.get("speedup"), ".2f"), _mib(c.get("peak_memory_bytes")),
          _cell(c.get("memory_ratio"), ".2f"),
          _cell(c["status"] + (f": {c['error']}" if c.get("error")
                               else ""))]
         for c in results.get("configs", [])])
    if results.get("memory_reason"):
        lines += [f"Peak memory n/a: {results['memory_reason']}.", ""]
    return lines


def _md_logical(results: dict) -> list:
    lines = [f"{len(results.get('devices', []))} logical "
             f"{results.get('device_kind')} devices: "
             f"{', '.join(results.get('devices', []))}"
             + (f", {results['memory_limit_mib']} MiB each"
                if results.get("memory_limit_mib") else "") + ".", ""]
    exact = results.get("exactness") or {}
    if exact:
        lines += [f"Exactness: {exact.get('micro_batches')} micro-batches of "
                  f"{exact.get('micro_batch')}, accum_steps="
                  f"{exact.get('accum_steps')} on 2 replicas, against the "
                  f"big-batch step on one device (tolerance "
                  f"{exact.get('tolerance')}).", ""]
        lines += _table(["optimizer", "TensorFloat-32", "optimizer steps",
                         "reference moved", "max abs weight diff"],
                        [[_cell(r["optimizer"]),
                          _cell(r["tensor_float_32"]),
                          _cell(r["optimizer_steps"]),
                          _cell(r["reference_moved"], ".3g"),
                          _cell(r["max_abs_weight_diff"], ".3g")]
                         for r in exact.get("runs", [])])
    counts = results.get("all_reduce") or {}
    if counts:
        executed = counts.get("executed", {})
        lines += [f"All-reduces run (eagerly) over "
                  f"{counts.get('micro_batches')} micro-batches "
                  f"(accum_steps={counts.get('accum_steps')}); expected: 1 "
                  "per optimizer step.", ""]
        lines += _table(["", "all-reduces run", "optimizer steps",
                         "per optimizer step"],
                        [[name, _cell(row.get("all_reduces")),
                          _cell(row.get("optimizer_steps")),
                          _cell(row.get("per_optimizer_step"), ".2f")]
                         for name, row in executed.items()])
    return lines


def _md_overheads(results: dict) -> list:
    lines = [f"{results.get('model')} ({results.get('params', 0):,} "
             f"parameters), batch {results.get('batch_size')}, "
             f"{results.get('steps_per_epoch')} steps per epoch (in-step "
             f"mode: one per {ACCUM_STEPS} micro-batches; ms/step is per "
             "micro-batch), "
             f"{results.get('rounds')} rounds of one fit of "
             f"{results.get('epochs_per_fit')} epochs per configuration "
             f"(first untimed), jit_compile=False, on "
             f"{results.get('device')}.", ""]
    lines += _table(["configuration", "epoch s", "ms/step", "examples/s"],
                    [[_cell(c["name"]), _cell(c["epoch_s"], ".3f"),
                      _cell(c["step_ms"], ".2f"),
                      _cell(c["examples_per_s"], ",.0f")]
                     for c in results.get("configs", [])])
    lines += _table(["ratio", "median", "quartiles"],
                    [[_cell(r["name"]), _cell(r["median"], ".3f"),
                      f"{_cell(r['q1'], '.3f')}-{_cell(r['q3'], '.3f')}"]
                     for r in results.get("ratios", [])])
    backup = results.get("backup") or {}
    if backup:
        lines += [f"BackupAndRestore: {backup.get('saves')} saves, "
                  f"{_cell(backup.get('stall_ms'), '.1f')} ms median stall "
                  "of the training thread per save.", ""]
    return lines


_MD_PARTS = {"machine": _md_machine, "gpu_tests": _md_gpu_tests,
             "resnet50": _md_resnet, "logical_gpus": _md_logical,
             "overheads": _md_overheads}


def format_markdown(payload: dict) -> str:
    """The report: the machine, a line per part, then each part's figures."""
    machine = payload.get("machine") or {}
    gpus = machine.get("gpus") or []
    lines = ["# keras-mgpu GPU suite", "",
             f"Mode: {payload['mode']}; {payload['date']}; budget "
             f"{_s(payload['budget_s'])} s, took {_s(payload['seconds'])} s;"
             f" schema {payload['schema']}.", ""]
    if payload["mode"] == "dry-run":
        lines += ["Dry run: every part on the CPU at tiny sizes. It shows "
                  "the code runs, not GPU performance.", ""]
    lines += _table(
        ["GPU", "memory MiB", "compute capability", "driver", "CUDA / cuDNN",
         "interconnect", "TensorFlow", "Keras", "keras-mgpu", "CPUs"],
        [[_cell(", ".join(sorted({g.get("name") or "?" for g in gpus}))
                + (f" x{len(gpus)}" if len(gpus) > 1 else "")
                if gpus else None, missing="none"),
          _cell(gpus[0].get("memory_mib") if gpus else None),
          _cell(".".join(map(str, gpus[0]["compute_capability"]))
                if gpus and gpus[0].get("compute_capability") else None),
          _cell(machine.get("driver_version")),
          f"{_cell(machine.get('cuda_version'))} / "
          f"{_cell(machine.get('cudnn_version'))}",
          _cell(machine.get("interconnect")), _cell(machine.get("tensorflow")),
          _cell(machine.get("keras")), _cell(machine.get("keras_mgpu")),
          _cell(machine.get("cpu_count"))]])
    if machine.get("reason"):
        lines += [f"GPU fields n/a: {machine['reason']}.", ""]
    lines += _table(["part", "status", "seconds", "budget s", "note"],
                    [[name, entry["status"], _s(entry["seconds"]),
                      _s(entry["budget_s"]),
                      _cell((entry["note"] or "").splitlines()[0]
                            if entry["note"] else "", missing="")]
                     for name, entry in payload["parts"].items()])
    for name, entry in payload["parts"].items():
        lines += [f"## {name}", "", f"Status: {entry['status']}.", ""]
        if entry["note"]:
            lines += ["```", entry["note"], "```", ""]
        if entry["results"]:
            lines += _MD_PARTS[name](entry["results"])
    return "\n".join(lines).rstrip() + "\n"


# --- Children: one part each, in its own process -----------------------------


class _Recorder:
    """A child's results, written to its file after every change."""

    def __init__(self, path: str):
        self.path = path
        # The suite's own temporary folder: removed by the suite even when
        # it kills this process.
        self.workdir = os.path.dirname(os.path.abspath(path))
        self.results = {}
        self.note = None

    def save(self) -> None:
        with open(self.path + ".tmp", "w") as f:
            json.dump({"results": self.results, "note": self.note}, f,
                      allow_nan=False)
        os.replace(self.path + ".tmp", self.path)


def _finite(value):
    """`value` as a float, or None when it is not a finite number."""
    value = float(value)
    return value if math.isfinite(value) else None


def _quartiles(values: list) -> tuple:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def _gpus(tf, dry_run: bool) -> list:
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus and not dry_run:
        raise RuntimeError("No GPU visible to TensorFlow: this part is sized "
                           "for a GPU. Run the suite with --dry-run on a "
                           "CPU.")
    return gpus


def _error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def part_resnet50(rec: _Recorder, dry_run: bool, budget_s: float) -> None:
    """ResNet-50 throughput and peak memory per policy and jit_compile."""
    import keras
    import numpy as np
    import tensorflow as tf

    gpus = _gpus(tf, dry_run)
    size = RESNET_SIZES["dry-run" if dry_run else "gpu"]
    device = "/gpu:0" if gpus else "/cpu:0"
    # One device, with its distributed iterator: the repeated batch is
    # prefetched to the GPU, so the step is what is timed, not the copy.
    strategy = tf.distribute.OneDeviceStrategy(device)
    image, classes = size["image_size"], size["classes"]

    def resnet50():
        return keras.applications.ResNet50(
            weights=None, input_shape=(image, image, 3), classes=classes)

    def stand_in():
        # The dry run's model: ResNet's ingredients (convolution, batch
        # normalization, a residual add, pooling, a softmax head), small
        # enough that six traces, three of them by XLA, fit a CI run.
        layers = keras.layers
        inputs = keras.Input((image, image, 3))
        x = layers.Conv2D(8, 3, strides=2, padding="same")(inputs)
        y = layers.Conv2D(8, 3, padding="same", use_bias=False)(x)
        y = layers.BatchNormalization()(y)
        x = layers.ReLU()(layers.Add()([x, y]))
        x = layers.GlobalAveragePooling2D()(x)
        return keras.Model(inputs, layers.Dense(classes,
                                                activation="softmax")(x),
                           name="resnet_stand_in")

    # ResNet-50 at the GPU run's size: in the dry run, the same constructor
    # call is checked and its size reported, without training it.
    model_params = keras.applications.ResNet50(
        weights=None, input_shape=RESNET_GPU_INPUT).count_params()
    build = stand_in if dry_run else resnet50
    trained_params = build().count_params() if dry_run else model_params
    keras.backend.clear_session()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((size["batch_size"], image, image, 3),
                            dtype=np.float32)
    y = rng.integers(0, classes, size["batch_size"]).astype(np.int32)
    data = tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(2)
    rec.results = {
        "model": "ResNet50", "model_params": int(model_params),
        "trained": ("small ResNet-style stand-in (dry run)" if dry_run
                    else "ResNet50"),
        "trained_params": int(trained_params), **size, "device": device,
        "tensor_float_32": (bool(tf.config.experimental
                                 .tensor_float_32_execution_enabled())
                            if gpus else None),
        "memory_reason": None if gpus else NO_GPU, "configs": []}
    if dry_run:
        rec.note = ("dry run: a small ResNet-style stand-in is trained; "
                    "ResNet-50 is only built")
    rec.save()

    from _timing import EpochTimer

    longest = 0.0
    for policy, jit in RESNET_CONFIGS:
        row = {"policy": policy, "jit_compile": jit, "status": "not run",
               "error": None, "seconds": None, "epoch_seconds": [],
               "step_ms": None, "examples_per_s": None,
               "start_memory_bytes": None, "peak_memory_bytes": None,
               "speedup": None, "memory_ratio": None}
        rec.results["configs"].append(row)
        left = budget_s - (time.monotonic() - _STARTED)
        if left < 1.2 * longest:
            row["error"] = (f"not started: {left:.0f} s of the part's budget "
                            f"left, the longest configuration took "
                            f"{longest:.0f} s")
            rec.save()
            continue
        began = time.monotonic()
        # What the row says if the part is stopped while this one runs.
        row["error"] = "did not finish: the part was stopped while it ran"
        rec.save()
        # The previous configuration's model and its compiled step go first
        # (clear_session also runs Python's garbage collection), so that
        # this one's peak is its own.
        keras.backend.clear_session()
        if gpus:
            tf.config.experimental.reset_memory_stats("GPU:0")
            row["start_memory_bytes"] = int(
                tf.config.experimental.get_memory_info("GPU:0")["current"])
        try:
            keras.mixed_precision.set_global_policy(policy)
            try:
                with strategy.scope():
                    model = build()
                    # jit_compile explicit: Keras's default ("auto") turns
                    # XLA on when a GPU is visible.
                    model.compile(
                        keras.optimizers.SGD(0.01, momentum=0.9),
                        keras.losses.SparseCategoricalCrossentropy(),
                        jit_compile=jit)
            finally:
                keras.mixed_precision.set_global_policy("float32")
            # Traces (and with XLA compiles) the step, untimed.
            model.fit(data, epochs=1, steps_per_epoch=size["warmup_steps"],
                      verbose=0)
            timer = EpochTimer()
            model.fit(data, epochs=size["repeats"],
                      steps_per_epoch=size["steps"], verbose=0,
                      callbacks=[timer.start, timer.stop])
            median = statistics.median(timer.times)
            row.update(status="ok", error=None,
                       epoch_seconds=[round(t, 6) for t in timer.times],
                       step_ms=_finite(1000 * median / size["steps"]),
                       examples_per_s=_finite(
                           size["steps"] * size["batch_size"] / median))
            if gpus:
                row["peak_memory_bytes"] = int(
                    tf.config.experimental.get_memory_info("GPU:0")["peak"])
        except Exception as e:  # one configuration's failure (e.g. OOM)
            row.update(status="failed", error=_error(e))
        row["seconds"] = round(time.monotonic() - began, 3)
        longest = max(longest, row["seconds"])
        base = rec.results["configs"][0]
        for r in rec.results["configs"]:
            if base["examples_per_s"] and r["examples_per_s"]:
                r["speedup"] = r["examples_per_s"] / base["examples_per_s"]
            if base["peak_memory_bytes"] and r["peak_memory_bytes"]:
                r["memory_ratio"] = (r["peak_memory_bytes"]
                                     / base["peak_memory_bytes"])
        rec.save()
        print(f"{policy:<15} jit_compile={str(jit):<5} "
              + (f"{row['examples_per_s']:>10,.1f} examples/s, peak "
                 f"{_mib(row['peak_memory_bytes'])} MiB"
                 if row["status"] == "ok" else row["error"]), flush=True)


def _counting_all_reduce(tf, gradient_shape):
    """tests/test_accumulation.py's `CountingAllReduce`, built on demand.

    Counts the cross-replica reductions whose payload includes a tensor of
    `gradient_shape` (the first kernel's); a batched reduction counts once:
    one all-reduce, however it is carried out. Defined inside a function
    because its base class is TensorFlow's, imported by the part only.
    """

    class CountingAllReduce(tf.distribute.ReductionToOneDevice):
        def __init__(self):
            super().__init__()
            self.calls = 0
            self.in_batch = False

        def _count(self, values):
            for value in values:
                for v in getattr(value, "values", (value,)):
                    if tuple(v.shape) == tuple(gradient_shape):
                        self.calls += 1
                        return

        def reduce_implementation(self, reduce_op, per_replica_value,
                                  destinations, options):
            if not self.in_batch:
                self._count([per_replica_value])
            return super().reduce_implementation(
                reduce_op, per_replica_value, destinations, options)

        def batch_reduce_implementation(self, reduce_op,
                                        value_destination_pairs, options):
            self._count([v for v, _ in value_destination_pairs])
            self.in_batch = True
            try:
                return super().batch_reduce_implementation(
                    reduce_op, value_destination_pairs, options)
            finally:
                self.in_batch = False

    return CountingAllReduce()


def part_logical_gpus(rec: _Recorder, dry_run: bool, budget_s: float) -> None:
    """2 logical devices: accumulation exactness and all-reduces per step."""
    import tensorflow as tf

    gpus = _gpus(tf, dry_run)
    # Before anything initialises the devices: this process's first act.
    if gpus:
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(
                memory_limit=LOGICAL_GPU_MIB)] * 2)
        devices = [d.name for d in tf.config.list_logical_devices("GPU")][:2]
    else:
        from keras_mgpu import strategy as strategy_lib

        devices = strategy_lib.configure_virtual_cpus(2)
    import keras
    import numpy as np

    from keras_mgpu import GradientAccumulationModel

    features, hidden = 8, 16
    # tests/test_accumulation.py's optimizers, by the same names.
    optimizers = {
        "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(0.01),
    }

    def build_mlp():
        # tests/workers.py's model, with its deterministic weights.
        model = keras.Sequential([keras.Input((features,)),
                                  keras.layers.Dense(hidden,
                                                     activation="tanh"),
                                  keras.layers.Dense(1)])
        rng = np.random.RandomState(1)
        model.set_weights([0.3 * rng.randn(*w.shape).astype("float32")
                           for w in model.get_weights()])
        return model

    def micro_batches(count, size=8):
        rng = np.random.RandomState(0)
        x = rng.randn(count * size, features).astype("float32")
        w = rng.randn(features, 1).astype("float32")
        y = (np.tanh(x @ w) + 0.1 * rng.randn(count * size, 1)).astype(
            "float32")
        return [(x[i:i + size], y[i:i + size])
                for i in range(0, count * size, size)]

    def dataset(batches):
        # Exactly these batches, in order (tests/test_accumulation.py's
        # batches_dataset).
        out = None
        for batch in batches:
            one = tf.data.Dataset.from_tensors(batch)
            out = one if out is None else out.concatenate(one)
        return out

    def train(strategy, batches, accum_steps=None, optimizer="adam",
              run_eagerly=False):
        with strategy.scope():
            inner = build_mlp()
            model = inner if accum_steps is None else \
                GradientAccumulationModel(inner, accum_steps=accum_steps)
            # jit_compile explicit: "auto" would compile the one-device
            # reference with XLA on a GPU and not the mirrored run.
            model.compile(optimizers[optimizer](), "mse",
                          run_eagerly=run_eagerly, jit_compile=False)
        model.fit(dataset(batches), epochs=1, verbose=0, shuffle=False)
        return model

    def weights(model):
        return [v.numpy() for v in model.trainable_variables]

    def max_diff(a, b):
        return max(float(np.abs(x - y).max()) for x, y in zip(a, b))

    key_base = [60_000]

    def mirrored(counting=None):
        # A collective key base per strategy, as tests/conftest.py gives
        # each: live strategies must not share collective groups.
        key_base[0] += 1000
        cls = type("SuiteMirroredStrategy", (tf.distribute.MirroredStrategy,),
                   {"_collective_key_base": key_base[0]})
        # Not NCCL, TensorFlow's choice on GPUs: it is not made for two
        # logical devices of one GPU. Through one device, as the tests'
        # counter reduces.
        return cls(devices, cross_device_ops=counting
                   or tf.distribute.ReductionToOneDevice())

    rec.results = {"device_kind": "GPU" if gpus else "CPU",
                   "devices": devices,
                   "memory_limit_mib": LOGICAL_GPU_MIB if gpus else None}
    rec.save()

    # Exactness: tests/test_accumulation.py's
    # test_accumulated_step_equals_big_batch_step at 2 replicas.
    micro = micro_batches(24)
    big = [tuple(np.concatenate(parts) for parts in zip(*micro[i:i + 4]))
           for i in range(0, 24, 4)]
    start_weights = weights(build_mlp())
    exact = {"micro_batch": 8, "micro_batches": len(micro),
             "accum_steps": ACCUM_STEPS, "tolerance": EXACTNESS_TOLERANCE,
             "runs": [], "max_abs_weight_diff": None}
    rec.results["exactness"] = exact
    strategy = mirrored()
    default = tf.distribute.get_strategy()
    # On a GPU, float32 matmuls use TensorFloat-32 by default; the claim is
    # about float32 arithmetic, so both settings are measured there.
    tf32_settings = (True, False) if gpus else (None,)
    for tf32 in tf32_settings:
        if tf32 is not None:
            tf.config.experimental.enable_tensor_float_32_execution(tf32)
        for name in EXACTNESS_OPTIMIZERS["dry-run" if dry_run else "gpu"]:
            reference = train(default, big, optimizer=name)
            model = train(strategy, micro, accum_steps=ACCUM_STEPS,
                          optimizer=name)
            exact["runs"].append({
                "optimizer": name, "tensor_float_32": tf32,
                "optimizer_steps": int(model.optimizer.iterations.numpy()),
                "reference_moved": max_diff(weights(reference),
                                            start_weights),
                "max_abs_weight_diff": max_diff(weights(model),
                                                weights(reference))})
            exact["max_abs_weight_diff"] = max(
                r["max_abs_weight_diff"] for r in exact["runs"])
            rec.save()
            print(f"exactness {name} (TF32 {tf32}): max abs weight "
                  f"difference {exact['runs'][-1]['max_abs_weight_diff']:.3g}",
                  flush=True)
    if gpus:
        tf.config.experimental.enable_tensor_float_32_execution(True)

    # All-reduces: tests/test_accumulation.py's
    # test_one_all_reduce_per_optimizer_step, run eagerly: Python then runs
    # every step, so the count is the all-reduces executed. (Its traced
    # variant counts the all-reduces in the step's graph, the same on any
    # device: the test suite checks it.)
    micro = micro_batches(12)
    counts = {"micro_batches": len(micro), "accum_steps": ACCUM_STEPS,
              "executed": {}, "expected": {"per_optimizer_step": 1.0}}
    rec.results["all_reduce"] = counts
    logger = tf.get_logger()
    for name, accum_steps in (("plain", None), ("accumulated", ACCUM_STEPS)):
        ops = _counting_all_reduce(tf, (features, hidden))
        # Eager on purpose: TensorFlow's warning that a mirrored strategy
        # is slow eagerly would fill a failure's stderr tail.
        level = logger.level
        logger.setLevel("ERROR")
        try:
            model = train(mirrored(ops), micro, accum_steps=accum_steps,
                          run_eagerly=True)
        finally:
            logger.setLevel(level)
        steps = int(model.optimizer.iterations.numpy())
        counts["executed"][name] = {
            "all_reduces": ops.calls, "optimizer_steps": steps,
            "per_optimizer_step": ops.calls / steps}
        rec.save()
    print(f"all-reduces run: {counts['executed']}", flush=True)


def part_overheads(rec: _Recorder, dry_run: bool, budget_s: float) -> None:
    """Accumulation, logger and backup costs, as paired epoch-time ratios."""
    import keras
    import numpy as np
    import tensorflow as tf

    from _timing import EpochTimer
    from keras_mgpu import GradientAccumulationModel
    from keras_mgpu.callbacks import DistributedLogger
    from keras_mgpu.callbacks import BackupAndRestore

    class TimedBackup(BackupAndRestore):
        """Counts saves and times the training thread's stall in each (as
        benchmarks/checkpoint.py does)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.save_seconds = []

        def _save(self, epoch, step_in_epoch):
            began = time.perf_counter()
            try:
                return super()._save(epoch, step_in_epoch)
            finally:
                self.save_seconds.append(time.perf_counter() - began)

    gpus = _gpus(tf, dry_run)
    size = OVERHEAD_SIZES["dry-run" if dry_run else "gpu"]
    features, width, classes = size["features"], size["width"], \
        size["classes"]
    batch, steps, epochs = size["batch_size"], size["steps"], size["epochs"]

    def mlp():
        return keras.Sequential([
            keras.Input((features,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(classes)])

    plain, builtin, ours = ("plain fit",
                            f"keras gradient_accumulation_steps={ACCUM_STEPS}",
                            f"GradientAccumulationModel(accum_steps="
                            f"{ACCUM_STEPS})")
    in_step = (f"GradientAccumulationModel(accum_steps={ACCUM_STEPS}, "
               "mode='in_step')")
    logger_1, logger_100 = ("DistributedLogger(update_freq=1)",
                            "DistributedLogger(update_freq=100)")
    backup = "BackupAndRestore(save_freq=100)"
    names = [plain, builtin, ours, in_step, logger_1, logger_100, backup]
    root = tempfile.mkdtemp(prefix="overheads_", dir=rec.workdir)

    def make_model(name):
        model = mlp()
        optimizer = keras.optimizers.Adam(1e-3, **(
            {"gradient_accumulation_steps": ACCUM_STEPS}
            if name == builtin else {}))
        if name == ours:
            model = GradientAccumulationModel(model, accum_steps=ACCUM_STEPS)
        elif name == in_step:
            model = GradientAccumulationModel(model, accum_steps=ACCUM_STEPS,
                                              mode="in_step")
        # jit_compile explicit: "auto" means XLA on a GPU, and an XLA
        # compile of each configuration would cost more than it measures.
        model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), jit_compile=False)
        return model

    def make_callbacks(name, round_index):
        path = os.path.join(root, f"{names.index(name)}-{round_index}")
        if name == logger_1:
            return [DistributedLogger(path, update_freq=1, console=False)]
        if name == logger_100:
            return [DistributedLogger(path, update_freq=100, console=False)]
        if name == backup:
            return [TimedBackup(path, save_freq=100)]
        return []

    rng = np.random.default_rng(0)
    x = rng.standard_normal((steps * batch, features), dtype=np.float32)
    y = rng.integers(0, classes, steps * batch).astype(np.int32)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        batch, drop_remainder=True).cache().prefetch(2)
    # In-step mode takes the same samples as big batches of ACCUM_STEPS
    # micro-batches: a quarter of the steps, the same micro-batches.
    big_data = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        ACCUM_STEPS * batch, drop_remainder=True).cache().prefetch(2)
    keras.utils.set_random_seed(0)
    models = {name: make_model(name) for name in names}
    # epochs_of[name][r]: the median timed epoch of round r.
    epochs_of = {name: [] for name in names}
    stalls = []
    rec.results = {
        "model": f"MLP {features}-{width}-{width}-{classes}",
        "params": int(models[plain].count_params()), "batch_size": batch,
        "steps_per_epoch": steps, "epochs_per_fit": epochs,
        "timed_epochs_per_fit": epochs - 1, "rounds": 0,
        "jit_compile": False, "device": "/gpu:0" if gpus else "/cpu:0",
        "configs": [], "ratios": [], "backup": {"saves": 0,
                                                "stall_ms": None}}
    rec.save()

    def paired(of, against):
        values = [a / b for a, b in zip(epochs_of[of], epochs_of[against])]
        q1, median, q3 = _quartiles(values)
        return {"name": f"{of} / {against}", "of": of, "against": against,
                "median": _finite(median), "q1": _finite(q1),
                "q3": _finite(q3)}

    longest = 0.0
    try:
        for round_index in range(size["rounds"]):
            left = budget_s - (time.monotonic() - _STARTED)
            if round_index and left < 1.3 * longest:
                rec.note = (f"{round_index} of {size['rounds']} rounds: "
                            f"{left:.0f} s of the budget left, a round "
                            f"takes {longest:.0f} s")
                break
            began = time.monotonic()
            for k in range(len(names)):
                # One place later each round: no configuration always runs
                # right after the same other one.
                name = names[(k + round_index) % len(names)]
                timer = EpochTimer()
                callbacks = make_callbacks(name, round_index)
                models[name].fit(big_data if name == in_step else data,
                                 epochs=epochs, verbose=0,
                                 shuffle=False,
                                 callbacks=[timer.start, *callbacks,
                                            timer.stop])
                # The first epoch holds tracing, cache filling and the
                # callbacks' setup: not timed.
                epochs_of[name].append(statistics.median(timer.times[1:]))
                for callback in callbacks:
                    stalls += getattr(callback, "save_seconds", [])
            longest = max(longest, time.monotonic() - began)
            rec.results["rounds"] = round_index + 1
            rec.results["configs"] = [
                {"name": name,
                 "epoch_s": _finite(statistics.median(epochs_of[name])),
                 "step_ms": _finite(1000 * statistics.median(epochs_of[name])
                                    / steps),
                 "examples_per_s": _finite(
                     steps * batch / statistics.median(epochs_of[name]))}
                for name in names]
            rec.results["ratios"] = [
                paired(ours, plain), paired(builtin, plain),
                paired(ours, builtin), paired(in_step, plain),
                paired(in_step, builtin), paired(in_step, ours),
                paired(logger_1, plain), paired(logger_100, plain),
                paired(backup, plain)]
            rec.results["backup"] = {
                "saves": len(stalls),
                "stall_ms": (_finite(1000 * statistics.median(stalls))
                             if stalls else None)}
            rec.save()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for ratio in rec.results["ratios"]:
        print(f"{ratio['name']}: {ratio['median']:.3f}", flush=True)


CHILD_PARTS = {"resnet50": part_resnet50, "logical_gpus": part_logical_gpus,
               "overheads": part_overheads}


def _child_main(args) -> int:
    from keras_mgpu_cli import quiet_tensorflow

    quiet_tensorflow()
    recorder = _Recorder(args._result)
    CHILD_PARTS[args._part](recorder, args.dry_run, args._budget_s)
    recorder.save()
    return 0


# --- Command line ------------------------------------------------------------


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
        return _child_main(args)
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
