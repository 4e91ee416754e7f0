"""The accumulation benchmark's `--memory` run: peak memory per configuration.

In-step against window mode and plain `fit` at the micro-batch and at the
big batch, for an MLP 512-4x1024-10, each configuration in a fresh
subprocess (`accumulation.py --memory-child SPEC`), from TensorFlow's
allocator statistics (`MEMORY_METHOD` says how).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from typing import Optional

import keras
import tensorflow as tf
from _timing import markdown_table

from .configs import (IN_STEP, IN_STEP_CONFIGS,
                      IN_STEP_VS_WINDOW_MEMORY_TARGET, IN_STEP_XLA,
                      NUM_CLASSES, PLAIN, SEED, WRAPPER, make_config,
                      ratio_lines, short_label)

# The command: each configuration runs it again with --memory-child.
ENTRY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "accumulation.py")

# The model and sizes of issue #20's memory comparison.
MEMORY_FEATURES, MEMORY_WIDTH, MEMORY_DEPTH = 512, 1024, 4
# Measured over this many optimizer steps, after a warm-up fit of one.
MEMORY_OPTIMIZER_STEPS = 2
MEMORY_CHILD_PREFIX = "MEMORY_RESULT "
MEMORY_CHILD_TIMEOUT_S = 600

MEMORY_METHOD = (
    "Each configuration runs in a fresh subprocess on 1 replica: build, "
    "compile, a warm-up fit of 1 optimizer step (traces the step, creates "
    "the optimizer's and the wrapper's variables), then "
    "tf.config.experimental.reset_memory_stats(device) and a measured fit "
    f"of {MEMORY_OPTIMIZER_STEPS} optimizer steps on one fixed batch "
    "(tf.data.Dataset.from_tensors(...).repeat()). 'peak' is "
    "tf.config.experimental.get_memory_info(device)['peak'] after it: the "
    "most bytes TensorFlow's allocator (it keeps statistics for CPU:0 too) "
    "held at once: weights, optimizer slots, window mode's accumulators, "
    "the input batch, activations, gradients, XLA's buffers. 'over start' "
    "is that peak minus the bytes in use when the measured fit began (the "
    "step's transient memory; persistent state such as window mode's "
    "accumulators is not in it). 'RSS growth' is a cross-check from the "
    "OS: the process's peak resident set (VmHWM, reset by writing 5 to "
    "/proc/self/clear_refs) minus its resident set when the measured fit "
    "began; it includes memory outside TensorFlow's allocator but misses "
    "heap that malloc kept from the warm-up and reused. The ratios use "
    "'peak'."
)


def build_memory_model() -> keras.Model:
    """The MLP of issue #20's memory comparison: 512 -> 4 x 1024 -> 10."""
    return keras.Sequential(
        [keras.Input((MEMORY_FEATURES,))]
        + [keras.layers.Dense(MEMORY_WIDTH, activation="relu")
           for _ in range(MEMORY_DEPTH)]
        + [keras.layers.Dense(NUM_CLASSES)],
        name=f"mlp_{MEMORY_FEATURES}_{MEMORY_DEPTH}x{MEMORY_WIDTH}")


def memory_specs(args: argparse.Namespace) -> list[dict]:
    """The configurations --memory measures, one subprocess each.

    `batch` is the samples per `fit` step, `micro_batch` the samples per
    forward and backward pass.
    """
    micro = args.memory_batch
    specs = [dict(config=PLAIN, accum_steps=1, batch=micro, micro_batch=micro)]
    for n in args.memory_accum:
        if n > 1:
            # Plain fit on the big batch: what accumulation saves memory
            # against.
            specs.append(dict(config=PLAIN, accum_steps=1, batch=n * micro,
                              micro_batch=n * micro, big_batch_of=n))
        specs.append(dict(config=WRAPPER, accum_steps=n, batch=micro,
                          micro_batch=micro))
        specs.append(dict(config=IN_STEP, accum_steps=n, batch=n * micro,
                          micro_batch=micro))
        if args.xla and n > 1:
            specs.append(dict(config=IN_STEP_XLA, accum_steps=n,
                              batch=n * micro, micro_batch=micro))
    return specs


def _proc_status_kib(field: str) -> Optional[int]:
    """A `kB` field of /proc/self/status (Linux), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Resets VmHWM to the current resident set (Linux 4.0+)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_child(spec: dict) -> dict:
    """Runs one --memory configuration in this (fresh) process."""
    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    config, n, batch = spec["config"], spec["accum_steps"], spec["batch"]
    keras.utils.set_random_seed(SEED)
    inner = build_memory_model()
    model = make_config(
        inner, config, n,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # Made by TensorFlow, so the batch is in its allocator's figures (a
    # tensor made from NumPy may alias NumPy's memory instead).
    x = tf.random.stateless_normal((batch, MEMORY_FEATURES), seed=(SEED, 0))
    y = tf.random.stateless_uniform((batch,), seed=(SEED, 1),
                                    maxval=NUM_CLASSES, dtype=tf.int32)
    fit_steps_per_update = n if config == WRAPPER else 1

    def fit(updates: int) -> None:
        data = tf.data.Dataset.from_tensors((x, y)).repeat(
            updates * fit_steps_per_update)
        model.fit(data, epochs=1, verbose=0, shuffle=False)

    fit(1)
    gc.collect()
    tf.config.experimental.reset_memory_stats(device)
    start = tf.config.experimental.get_memory_info(device)["current"]
    rss_start = _proc_status_kib("VmRSS")
    rss_reset = _reset_peak_rss()
    fit(MEMORY_OPTIMIZER_STEPS)
    info = tf.config.experimental.get_memory_info(device)
    rss_peak = _proc_status_kib("VmHWM") if rss_reset else None
    return {
        **spec, "device": device,
        "params": int(inner.count_params()),
        "optimizer_steps": int(model.optimizer.iterations.numpy()),
        "start_bytes": int(start), "peak_bytes": int(info["peak"]),
        "over_start_bytes": int(info["peak"]) - int(start),
        "rss_growth_bytes": (None if rss_peak is None or rss_start is None
                             else 1024 * (rss_peak - rss_start)),
        # The whole process's peak (Linux: ru_maxrss in KiB), TensorFlow's
        # own start-up included: context for the growth above.
        "process_max_rss_bytes":
            1024 * resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


def _memory_label(r: dict) -> str:
    if r["config"] == PLAIN:
        kind = "big batch" if r.get("big_batch_of") else "micro-batch"
        return f"plain fit, {kind}"
    return r["config"]


def run_memory(args: argparse.Namespace) -> dict:
    """Measures every --memory configuration, each in a fresh subprocess."""
    specs = memory_specs(args)
    results = []
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    for i, spec in enumerate(specs, 1):
        print(f"[{i}/{len(specs)}] {_memory_label(spec)}, N="
              f"{spec['accum_steps']}, {spec['batch']} samples per fit step",
              flush=True)
        began = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, ENTRY, "--memory-child", json.dumps(spec)],
                capture_output=True, text=True, env=env,
                timeout=MEMORY_CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            results.append({**spec, "error": "timed out"})
            print(f"    timed out after {MEMORY_CHILD_TIMEOUT_S} s")
            continue
        lines = [line for line in proc.stdout.splitlines()
                 if line.startswith(MEMORY_CHILD_PREFIX)]
        if proc.returncode or not lines:
            tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
            results.append({**spec, "error": f"exit {proc.returncode}: "
                                             f"{tail}"})
            print(f"    failed (exit {proc.returncode}):\n{tail}")
            continue
        result = json.loads(lines[-1][len(MEMORY_CHILD_PREFIX):])
        result["seconds"] = time.perf_counter() - began
        expected = 1 + MEMORY_OPTIMIZER_STEPS
        if result["optimizer_steps"] != expected:
            # The measured fit would not be the steps it claims to be.
            result["error"] = (f"{result['optimizer_steps']} optimizer steps, "
                               f"expected {expected}")
        results.append(result)
        print(f"    peak {result['peak_bytes'] / 2**20:.1f} MiB "
              f"({result['seconds']:.0f} s)", flush=True)
    ok = [r for r in results if "error" not in r]
    ratios = []
    for n in args.memory_accum:
        window = next((r for r in ok if r["config"] == WRAPPER
                       and r["accum_steps"] == n), None)
        for r in ok:
            if window is None or r["accum_steps"] != n:
                continue
            if r["config"] in IN_STEP_CONFIGS:
                ratio = r["peak_bytes"] / window["peak_bytes"]
                ratios.append({
                    "config": r["config"], "accum_steps": n,
                    "micro_batch": args.memory_batch, "ratio": ratio,
                    "target": f"<= {IN_STEP_VS_WINDOW_MEMORY_TARGET:.2f}",
                    "met": ratio <= IN_STEP_VS_WINDOW_MEMORY_TARGET,
                })
    return {
        "model": build_memory_model().name,
        "params": next((r["params"] for r in ok), None),
        "device": next((r["device"] for r in ok), None),
        "micro_batch": args.memory_batch, "accum": args.memory_accum,
        "optimizer_steps_measured": MEMORY_OPTIMIZER_STEPS,
        "method": MEMORY_METHOD,
        "results": results,
        "ratios": {"in_step_vs_window_peak_memory": ratios},
    }


def format_memory(memory: dict) -> str:
    """The --memory table and the in-step / window ratios."""
    mib = 2.0 ** 20
    window_peak = {r["accum_steps"]: r["peak_bytes"]
                   for r in memory["results"]
                   if r["config"] == WRAPPER and "error" not in r}

    def against_window(r: dict) -> str:
        if r["config"] == WRAPPER:
            return "-"
        # Plain fit on the micro-batch belongs to no one N.
        n = r.get("big_batch_of") if r["config"] == PLAIN else r["accum_steps"]
        if n not in window_peak:
            return "-"
        return f"{r['peak_bytes'] / window_peak[n]:.2f}x"

    header = ("configuration", "N", "samples/fit step", "micro-batch",
              "peak MiB", "over start MiB", "RSS growth MiB", "vs window")
    rows = []
    for r in memory["results"]:
        n = "-" if r["config"] == PLAIN else str(r["accum_steps"])
        if "error" in r:
            rows.append((_memory_label(r), n, str(r["batch"]),
                         str(r["micro_batch"]), "failed", "-", "-", "-"))
            continue
        rss = r["rss_growth_bytes"]
        rows.append((
            _memory_label(r), n, str(r["batch"]), str(r["micro_batch"]),
            f"{r['peak_bytes'] / mib:.1f}",
            f"{r['over_start_bytes'] / mib:.1f}",
            "n/a" if rss is None else f"{rss / mib:.1f}",
            against_window(r),
        ))
    lines = [markdown_table(header, rows, {0}), "",
             "vs window: peak over window mode's peak at the same N (plain "
             "fit, big batch: at N = its batch / the micro-batch).", ""]
    lines += ratio_lines(
        "(e) in-step / window mode, peak memory, 1 replica (target <= "
        f"{IN_STEP_VS_WINDOW_MEMORY_TARGET:.2f}):",
        memory["ratios"]["in_step_vs_window_peak_memory"],
        lambda r: f"N={r['accum_steps']} {short_label(r['config']):12s}",
        "not measured")
    return "\n".join(lines)

