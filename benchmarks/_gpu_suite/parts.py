"""The parent's side of each part: the command it runs, the entry it records.

`machine` (keras-mgpu doctor, nvidia-smi) and `gpu_tests` (pytest) are
commands whose output the parent reads; the other parts run as
`gpu_suite.py --_part NAME` and write their results to a file (`child`).
Standard library only, like everything the suite's parent process imports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

from . import ENTRY, REPO
from .runner import (Runner, exit_note, over_budget_note, part_entry,
                     read_json, stderr_tail)


def run_machine(runner: Runner, budget_s: float) -> dict:
    """The `machine` part: the doctor's report and the driver version."""
    # `-m keras_mgpu.cli` works from the checkout without the console script.
    code, stdout, stderr, seconds = runner.run(
        [sys.executable, "-m", "keras_mgpu.cli", "doctor", "--json"],
        budget_s, "machine")
    if code is None:
        return part_entry("skipped", seconds, budget_s,
                          over_budget_note(budget_s, seconds, stderr, False))
    try:
        report = json.loads(stdout)
    except ValueError:
        return part_entry("failed", seconds, budget_s,
                          "keras-mgpu doctor --json printed no JSON; "
                          + exit_note(code, stderr, stdout))
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
                f"{stderr_tail(smi_err) or smi_code}")
    # Exit code 1 is the doctor's "a finding of level error": the report is
    # still the figure, with its findings.
    note = None if code == 0 else (
        "keras-mgpu doctor reported an error finding: "
        + "; ".join(f["message"] for f in report.get("findings", [])
                    if f.get("level") == "error"))
    return part_entry("ok", seconds, budget_s, note, results)


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


def run_gpu_tests(runner: Runner, budget_s: float, dry_run: bool) -> dict:
    """The `gpu_tests` part: `pytest -m gpu`, or its collection when dry."""
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
        return part_entry("skipped", seconds, budget_s,
                          over_budget_note(budget_s, seconds, stderr, seen),
                          results if seen else None)
    if code == 5:
        return part_entry("failed", seconds, budget_s,
                          "no test is marked gpu (pytest exit code 5).",
                          results)
    if code == 1 and not dry_run:
        failed = [f["test"] for f in results["failures"]]
        return part_entry("failed", seconds, budget_s,
                          f"{len(failed)} test(s) failed: "
                          + ", ".join(failed), results)
    if code != 0:
        return part_entry("failed", seconds, budget_s,
                          exit_note(code, stderr, stdout), results)
    return part_entry("ok", seconds, budget_s, None, results)


def run_child_part(runner: Runner, name: str, budget_s: float,
                   dry_run: bool) -> dict:
    """A part with a process of its own: `gpu_suite.py --_part NAME`."""
    result_path = os.path.join(runner.workdir, f"{name}.json")
    command = [sys.executable, ENTRY, "--_part", name,
               "--_result", result_path, "--_budget-s", f"{budget_s:.3f}"]
    if dry_run:
        command.append("--dry-run")
    code, stdout, stderr, seconds = runner.run(command, budget_s, name)
    written = read_json(result_path) or {}
    results, note = written.get("results"), written.get("note")
    for line in stdout.splitlines():
        print(f"    {line}")
    if code is None:
        return part_entry("skipped", seconds, budget_s,
                          over_budget_note(budget_s, seconds, stderr,
                                           results is not None), results)
    if code != 0:
        return part_entry("failed", seconds, budget_s,
                          exit_note(code, stderr), results)
    if results is None:
        return part_entry("failed", seconds, budget_s,
                          "exited without writing its results.")
    return part_entry("ok", seconds, budget_s, note, results)
