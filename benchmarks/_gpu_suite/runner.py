"""Runs a part's command in its own process group, within its budget.

Also the entry a part leaves in the JSON (`entry`) and the notes that say
why a part failed or was stopped, with the end of its stderr. Standard
library only, like everything the suite's parent process imports.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

from . import REPO
from .report import fmt_s

TAIL_LINES, TAIL_CHARS = 25, 3000
# TensorFlow's start-up INFO lines: noise in a failure's stderr tail.
_NOISE = re.compile(r"^(I\d{4} |WARNING: All log messages before absl"
                    r"|To enable the following instructions:)")
# In the dry run, CUDA_VISIBLE_DEVICES=-1 makes this error line certain.
_DRY_RUN_NOISE = re.compile(r"^E\d{4} .*failed call to cuInit")


class Stop(Exception):
    """SIGTERM or SIGINT arrived: stop the running part, write the files."""


def stderr_tail(text: str) -> str:
    """The last lines of a part's output, without TensorFlow's start-up
    noise: what its note shows."""
    lines = [line for line in (text or "").splitlines()
             if line.strip() and not _NOISE.match(line)]
    return "\n".join(lines[-TAIL_LINES:])[-TAIL_CHARS:]


def child_env(dry_run: bool) -> dict:
    """The environment every part's command runs in."""
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


class Runner:
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
            except Stop:
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


def read_json(path: str):
    """A JSON file's content, or None if it is missing or cut short."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def part_entry(status, seconds, budget_s, note=None,
               results=None) -> dict:
    """A part's entry in the payload's `parts`."""
    # A budget the earlier parts used up is recorded as 0, not negative.
    return {"status": status, "seconds": round(seconds, 3),
            "budget_s": round(max(budget_s, 0.0), 3), "note": note,
            "results": results}


def over_budget_note(budget_s: float, seconds: float, stderr: str,
                      kept: bool) -> str:
    """The note of a part stopped at its budget."""
    note = (f"over its budget of {fmt_s(budget_s)} s: stopped after "
            f"{fmt_s(seconds)} s")
    note += "; the figures it wrote before are kept." if kept else "."
    tail = stderr_tail(stderr)
    return note + (f"\nstderr:\n{tail}" if tail else "")


def exit_note(code: int, stderr: str, stdout: str = "") -> str:
    """The note of a part whose command exited with an error."""
    tail = stderr_tail(stderr) or stderr_tail(stdout)
    return f"exited with code {code}." + (f"\nstderr:\n{tail}" if tail
                                          else "")
