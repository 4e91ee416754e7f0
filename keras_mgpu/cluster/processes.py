"""The worker processes' limits and ends: the open files they need, a stop
that gives them time, the kill of each whole process group, and their end
with the launcher's.

Only the standard library (`resource` where there is one).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time


# Files the launcher holds per worker (its stdout and stderr, and the
# file Popen's error pipe briefly takes), and what it keeps for itself.
_FILES_PER_WORKER = 3
_FILES_SPARE = 64


def check_open_files(num_workers: int) -> None:
    """Raises the open-file limit to what `num_workers` need (up to the
    hard limit), or refuses before any worker starts, naming it: past it,
    the launcher failed with `Too many open files` midway through starting
    them."""
    try:
        import resource
    except ImportError:  # not POSIX: no such limit to read
        return
    need = num_workers * _FILES_PER_WORKER + _FILES_SPARE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard == resource.RLIM_INFINITY or hard >= need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        return
    raise ValueError(
        f"{num_workers} workers need about {need} open files in the "
        f"launcher, above this process's limit of {hard} (ulimit -Hn). "
        "Raise it (ulimit -n, or the scheduler's setting), or start fewer "
        "workers per launcher.")


def stop_gracefully(procs, grace_period: float, stop, echo) -> None:
    """SIGTERM to every worker's process group; SIGKILL to what is left
    after `grace_period` seconds, or at once on a second stop signal."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_period
    while (any(p.poll() is None for p in procs) and not stop.at_once
           and time.monotonic() < deadline):
        echo()
        time.sleep(0.1)
    kill_all(procs)


def kill_all(procs) -> None:
    """Kills each worker's whole process group, a worker that exited
    included: what it started (its own children) would outlive the
    attempt. Linux reuses no group's id while the group has a member."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    # A SIGKILL takes effect a moment later: the call returns once nothing
    # of the groups runs.
    groups = {p.pid for p in procs}
    deadline = time.monotonic() + 30
    while _running_groups(groups) and time.monotonic() < deadline:
        time.sleep(0.02)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def _running_groups(groups: set) -> set:
    """Which of the process `groups` still have a running member (zombies
    run nothing), from Linux's /proc; elsewhere none is known to."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    running = set()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        # After the command name (which may hold spaces and parentheses):
        # state, parent, process group.
        fields = stat[stat.rindex(b")") + 2:].split()
        if fields[0] != b"Z" and int(fields[2]) in groups:
            running.add(int(fields[2]))
    return running


# Run in each worker's process before its command (which replaces it, same
# pid): Linux's parent-death signal kills the worker when the launcher
# ends, even by SIGKILL, which no handler of the launcher's can see. It is
# kept across the exec. A launcher already gone by then (between the fork
# and the prctl) is seen by the parent pid.
_TIED = """
import ctypes, os, signal, sys
PR_SET_PDEATHSIG = 1
ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
if os.getppid() != int(sys.argv[1]):
    os.kill(os.getpid(), signal.SIGKILL)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def tied_to_launcher(command: list) -> list:
    """`command`, made to end with this process (Linux; elsewhere as it
    is): its parent-death signal is SIGKILL."""
    if not sys.platform.startswith("linux"):
        return command
    # -I -S: the few lines above start in milliseconds and ignore the
    # worker's PYTHON* variables, which are its command's.
    return [sys.executable, "-I", "-S", "-c", _TIED, str(os.getpid()),
            *command]
