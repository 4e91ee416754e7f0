"""The suite: runs the parts in order, each within its budget; the files.

Standard library only, like everything the suite's parent process imports:
a Python without TensorFlow still gets both files.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time

from . import JSON_NAME, MARKDOWN_NAME, PART_NAMES, PARTS, SCHEMA
from .parts import run_child_part, run_gpu_tests, run_machine
from .report import fmt_s, format_markdown
from .runner import Runner, Stop, child_env, part_entry, read_json


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
    runner = Runner(child_env(dry_run), workdir, dry_run)

    def stop(signum, frame):
        if not runner.stopping:
            runner.stopping = True
            raise Stop(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, stop)
                for sig in (signal.SIGTERM, signal.SIGINT)}
    print(f"keras-mgpu GPU suite ({mode}): budget {fmt_s(budget_s)} s, "
          f"writing {os.path.join(out_dir, JSON_NAME)} and {MARKDOWN_NAME}")
    for name, share, what in PARTS:
        print(f"  {name}: {100 * share:.0f}% = {fmt_s(share * budget_s)} s "
              f"({what})")
    parts = payload["parts"]
    missing = missing_packages()
    try:
        for index, (name, share, _) in enumerate(PARTS):
            elapsed = time.monotonic() - start
            budget = _part_budget(index, budget_s, elapsed)
            print(f"[{index + 1}/{len(PARTS)}] {name}: budget "
                  f"{fmt_s(budget)} s ({100 * share:.0f}% of "
                  f"{fmt_s(budget_s)} s, plus "
                  f"{fmt_s(budget - share * budget_s)} s the earlier parts "
                  "left)", flush=True)
            no_gpu = (not dry_run and name != "machine"
                      and parts["machine"]["status"] == "ok"
                      and not payload["machine"]["tensorflow_gpus"])
            if missing:
                parts[name] = part_entry(
                    "skipped", 0.0, budget,
                    f"{sys.executable} has no {', '.join(missing)}: install "
                    "keras-mgpu's test extra (pip install -e '.[test]'; "
                    "TensorFlow with CUDA on a GPU machine: pip install "
                    "'tensorflow[and-cuda]'), or run the suite with a Python "
                    "that has them.")
            elif no_gpu:
                parts[name] = part_entry(
                    "skipped", 0.0, budget,
                    "no GPU visible to TensorFlow (keras-mgpu doctor): at "
                    "GPU sizes this part would take hours on the CPU; "
                    "`--dry-run` runs it at CPU sizes.")
            elif budget <= 0:
                parts[name] = part_entry("skipped", 0.0, budget,
                                         "no time left in the budget.")
            elif name == "machine":
                parts[name] = run_machine(runner, budget)
            elif name == "gpu_tests":
                parts[name] = run_gpu_tests(runner, budget, dry_run)
            else:
                parts[name] = run_child_part(runner, name, budget, dry_run)
            entry = parts[name]
            first_line = (entry["note"] or "").splitlines()[:1]
            print(f"    {entry['status']} in {fmt_s(entry['seconds'])} s"
                  + (f": {first_line[0]}" if first_line else ""), flush=True)
            payload["machine"] = machine_summary(parts)
            payload["seconds"] = round(time.monotonic() - start, 3)
            write_files(payload, out_dir)
    except Stop as e:
        for name in PART_NAMES:
            if name not in parts:
                # The running part's figures so far, if it wrote any.
                written = read_json(os.path.join(workdir, f"{name}.json"))
                parts[name] = part_entry(
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
    print(f"done in {fmt_s(payload['seconds'])} s: "
          + ", ".join(f"{n} {s}" for n, s in statuses.items()))
    return 0 if set(statuses.values()) == {"ok"} else 1

