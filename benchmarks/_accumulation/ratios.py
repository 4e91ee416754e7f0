"""The accumulation benchmark's target ratios, from the timed results.

Each compares two medians from the same group of configurations, measured
side by side: (a) window mode against Keras's built-in, (b) window mode
against plain fit on several replicas, (c) in-step mode against Keras's
built-in, (d) in-step against window mode on several replicas.
"""

from __future__ import annotations

import argparse
from typing import Optional

from .configs import (BUILTIN, IN_STEP_CONFIGS, IN_STEP_VS_BUILTIN_TARGET,
                      IN_STEP_VS_WINDOW_TARGET, PLAIN, WRAPPER, ratio_lines,
                      short_label)
from .timing import Result

RATIO_ACCUM_STEPS = (4, 8)


def find(results: list[Result], model: str, replicas: int, config: str,
         accum_steps: int = 1) -> Optional[Result]:
    for r in results:
        if (r.model, r.replicas, r.config, r.accum_steps) == (
            model, replicas, config, accum_steps
        ):
            return r
    return None


def _time_ratio(ours: Result, theirs: Result, target: float) -> dict:
    ratio = ours.ms_per_micro_batch / theirs.ms_per_micro_batch
    return {
        "model": ours.model, "replicas": ours.replicas, "config": ours.config,
        "accum_steps": ours.accum_steps, "ratio": ratio,
        "target": f"<= {target:.2f}", "met": ratio <= target,
    }


def compute_ratios(results: list[Result], args: argparse.Namespace) -> dict:
    """The target ratios, per model (and per N for all but the second).

    Each compares two medians from the same group, measured side by side.
    """
    wrapper_vs_builtin = []
    for model in args.models:
        for n in RATIO_ACCUM_STEPS:
            ours = find(results, model, 1, WRAPPER, n)
            theirs = find(results, model, 1, BUILTIN, n)
            if ours and theirs:
                wrapper_vs_builtin.append({
                    "model": model, "replicas": 1, "accum_steps": n,
                    "ratio": ours.ms_per_micro_batch / theirs.ms_per_micro_batch,
                    "target": "<= 1.00",
                    "met": ours.ms_per_micro_batch <= theirs.ms_per_micro_batch,
                })
    wrapper_vs_plain = []
    multi = max(args.replicas)
    for model in args.models if multi > 1 else ():
        ours = find(results, model, multi, WRAPPER, 4)
        plain = find(results, model, multi, PLAIN)
        if ours and plain:
            ratio = ours.samples_per_second / plain.samples_per_second
            wrapper_vs_plain.append({
                "model": model, "replicas": multi, "accum_steps": 4,
                "ratio": ratio, "target": "> 1", "met": ratio > 1.0,
            })
    in_step_vs_builtin, in_step_vs_window = [], []
    for model in args.models:
        for n in RATIO_ACCUM_STEPS:
            for config in IN_STEP_CONFIGS:
                ours = find(results, model, 1, config, n)
                theirs = find(results, model, 1, BUILTIN, n)
                if ours and theirs:
                    in_step_vs_builtin.append(
                        _time_ratio(ours, theirs, IN_STEP_VS_BUILTIN_TARGET))
                ours = find(results, model, multi, config, n)
                window = find(results, model, multi, WRAPPER, n)
                if multi > 1 and ours and window:
                    in_step_vs_window.append(
                        _time_ratio(ours, window, IN_STEP_VS_WINDOW_TARGET))
    return {
        "wrapper_vs_builtin_time_per_micro_batch": wrapper_vs_builtin,
        "wrapper_vs_plain_samples_per_second": wrapper_vs_plain,
        "in_step_vs_builtin_time_per_micro_batch": in_step_vs_builtin,
        "in_step_vs_window_time_per_micro_batch": in_step_vs_window,
    }



def format_ratios(ratios: dict) -> str:
    """The four comparisons, each ratio with its verdict."""
    lines = ratio_lines(
        "(a) GradientAccumulationModel (window) / Keras built-in, time "
        "per micro-batch, 1 replica (target <= 1.00):",
        ratios["wrapper_vs_builtin_time_per_micro_batch"],
        lambda r: f"{r['model']:8s} N={r['accum_steps']}",
        "not measured: needs --replicas 1 and --accum 4 or 8")
    lines += ratio_lines(
        "(b) GradientAccumulationModel (window) N=4 / plain fit, "
        "samples/s, multi-replica (target > 1):",
        ratios["wrapper_vs_plain_samples_per_second"],
        lambda r: f"{r['model']:8s} {r['replicas']} replicas",
        "not measured: needs --replicas 2 and --accum 4")
    lines += ratio_lines(
        "(c) in-step / Keras built-in, time per micro-batch, 1 "
        f"replica (target <= {IN_STEP_VS_BUILTIN_TARGET:.2f}):",
        ratios["in_step_vs_builtin_time_per_micro_batch"],
        lambda r: (f"{r['model']:8s} N={r['accum_steps']} "
                   f"{short_label(r['config']):12s}"),
        "not measured: needs --replicas 1 and --accum 4 or 8")
    lines += ratio_lines(
        "(d) in-step / window mode, time per micro-batch, "
        f"multi-replica (target <= {IN_STEP_VS_WINDOW_TARGET:.2f}):",
        ratios["in_step_vs_window_time_per_micro_batch"],
        lambda r: (f"{r['model']:8s} {r['replicas']} replicas N="
                   f"{r['accum_steps']} {short_label(r['config']):12s}"),
        "not measured: needs --replicas 2 and --accum 4 or 8")
    return "\n".join(lines)
