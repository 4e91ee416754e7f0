"""`launch`: a local cluster started again when a worker dies, until it
finishes, fails for good, runs out of restarts or is asked to stop."""

from __future__ import annotations

import math
import numbers
import os
import time
from typing import (
    Any,
    Callable,
    Iterable,
    Mapping,
    Optional,
    Sequence,
    TextIO,
    Union,
)

from keras_mgpu._checks import is_integer
from keras_mgpu.cluster import attempts as _attempts
from keras_mgpu.cluster import options
from keras_mgpu.cluster.attempts import LaunchError
from keras_mgpu.cluster.attempts import LaunchResult
from keras_mgpu.cluster.echo import say
from keras_mgpu.cluster.exit_codes import LAUNCH_RESTART_EXIT_CODES
from keras_mgpu.cluster.options import Target
from keras_mgpu.cluster.output import _describe
from keras_mgpu.cluster.signals import GROW_REASON
from keras_mgpu.cluster.signals import Stopped
from keras_mgpu.cluster.signals import StopSignals
from keras_mgpu.cluster.signals import stopped_message
from keras_mgpu.cluster.workers import _run_cluster
from keras_mgpu._args import DEFAULT_GRACE_PERIOD

# The attempt number `launch` gives each worker: 1, then 2 after a restart.
ATTEMPT_ENV = "KERAS_MGPU_ATTEMPT"
"""The environment variable holding the attempt number `launch` gives each
worker: 1, then 2 after a restart, and so on."""
# Unix times `launch` gives each worker, which the goodput ledger
# (keras_mgpu/goodput/ledger.py) records: when the launch began, when it
# started this attempt, and when the previous attempt's last worker ended.
JOB_STARTED_ENV = "KERAS_MGPU_JOB_STARTED"
ATTEMPT_STARTED_ENV = "KERAS_MGPU_ATTEMPT_STARTED"
PREVIOUS_ENDED_ENV = "KERAS_MGPU_PREVIOUS_ENDED"


def launch(
    target: Target,
    num_workers: int = 2,
    *,
    min_workers: Optional[int] = None,
    max_restarts: int = 0,
    restart_exit_codes: Iterable[int] = LAUNCH_RESTART_EXIT_CODES,
    backoff: float = 1.0,
    hang_timeout: Optional[float] = None,
    progress_file: Optional[str] = None,
    kwargs: Optional[Mapping[str, Any]] = None,
    args: Sequence[str] = (),
    env: Union[None, Mapping[str, str], Callable[[int], Mapping[str, str]]] = None,
    cwd: Optional[str] = None,
    timeout: Optional[float] = None,
    echo: Optional[TextIO] = None,
    report: Optional[TextIO] = None,
    labels: Optional[Sequence[str]] = None,
    grace_period: float = DEFAULT_GRACE_PERIOD,
) -> LaunchResult:
    """Runs `target` as a local cluster, started again when a worker dies.

    Each attempt starts `num_workers` processes with their `TF_CONFIG` on
    fresh localhost ports, as `run_local_workers` does, and
    `KERAS_MGPU_ATTEMPT` (1, 2, ...) in their environment. When a worker
    dies by a signal or exits with one of `restart_exit_codes` (the code
    `BackupAndRestore`'s presets exit with after a SIGTERM save is one),
    the others are stopped and, while restarts are left, all of them start
    again after a backoff; a `BackupAndRestore` in the program resumes
    where the last save left it. A worker that exits 0 while others train
    is fine. Any other exit code is a failure of the program itself: not
    restarted.

    Args:
        target: What each worker runs: a command line (a list of strings),
            a script path or a `"module:function"` string or module-level
            function (see `run_local_workers`).
        num_workers: Defaults to 2. A positive integer.
        min_workers: Defaults to `None` (as many as `num_workers`). The
            fewest workers a restart may go on with: a worker that failed
            in 2 attempts in a row (by a signal or a restart code) is left
            out of the next attempt while more than `min_workers` are
            left. The others keep their environment (`env` of their index)
            and label, and take the ranks 0, 1, ... in `TF_CONFIG`. Every
            restart counts against `max_restarts`. While some are left
            out, a SIGUSR1 to the launcher stops the workers with SIGTERM
            (a `BackupAndRestore(save_on_sigterm=True)` saves) and starts
            every one again, not counted as a restart.
        max_restarts: Defaults to 0. How many times to start every worker
            again after a restartable failure.
        restart_exit_codes: Defaults to `LAUNCH_RESTART_EXIT_CODES` (137,
            138, 143). Exit codes that are worth a restart; a death by any
            signal always is.
        backoff: Defaults to 1.0. Seconds before the first restart,
            doubling for each next one (at most 60).
        hang_timeout: Defaults to `None` (no watchdog). Seconds without a
            change to `progress_file` after which every worker is stopped
            and the attempt counts as failed (restartable).
        progress_file: Defaults to `None`. A file the workers rewrite while
            they make progress: `BackupAndRestore`'s `LOCK.json` in its
            `backup_dir` (its heartbeat is rewritten at a batch end at most
            every 30 s: use a `hang_timeout` well above that) or
            `DistributedLogger`'s JSONL file. Needed with `hang_timeout`.
        kwargs: Defaults to `None`. Keyword arguments for a function target.
        args: Defaults to `()`. Arguments for a script target.
        env: Defaults to `None`. Extra environment, or a function of the
            worker index returning it.
        cwd: Defaults to `None`, the current directory.
        timeout: Defaults to `None`, no limit. Seconds for all attempts
            together; past it every worker is killed and `WorkerError`
            raised, with no restart.
        echo: Defaults to `None`. A text stream for the workers' output,
            each line after its worker's label (`[worker 1] ...`).
        report: Defaults to `None`. A text stream for one line per attempt
            that ended: why, and what happens next.
        labels: Defaults to `None`: `worker <index>`.
        grace_period: Defaults to 90. Seconds the workers have to exit
            after the launcher passed on a stop signal, before they are
            killed: within SLURM's `--signal=TERM@120`.

    A SIGTERM, SIGHUP or SIGINT (Ctrl-C) to the launcher (on the main
    thread) is passed on to every worker's process group as SIGTERM, so
    a `BackupAndRestore` saves and exits; what still runs after
    `grace_period` (or at a second signal) is killed, and `LaunchError`
    says so, its `exit_code` 128 plus the signal's number (143, 129, 130).

    Returns:
        A `LaunchResult`: every `Attempt` and the last attempt's
        `WorkerResult`s.

    Raises:
        LaunchError: a failure that is not restarted, or a restartable
            one with no restarts left; its message names every attempt
            and how it ended, and its `exit_code` is the status a shell
            would report for the last failure.

    Example:

    >>> import sys
    >>> result = launch([sys.executable, "-c", "print('hello')"], 2,
    ...                 max_restarts=1)
    >>> [a.why for a in result.attempts], result.restarts
    (['finished'], 0)
    """
    restart_codes = _check_restarts(max_restarts, restart_exit_codes,
                                    backoff, hang_timeout, progress_file,
                                    timeout)
    options.check_timeout(grace_period, "grace_period")
    num_workers = options.worker_count(num_workers)
    min_workers = _check_min_workers(min_workers, num_workers)
    command, labels, extras = options.worker_setup(
        target, num_workers, kwargs, args, env, cwd, labels)
    attempts: list[_attempts.Attempt] = []
    with StopSignals(grow=min_workers < num_workers) as stop:
        try:
            return _supervise(
                attempts, command, extras, labels, stop, grace_period,
                _attempts.Membership(num_workers, min_workers),
                max_restarts=max_restarts, restart_codes=restart_codes,
                backoff=backoff, hang_timeout=hang_timeout,
                progress_file=progress_file, cwd=cwd, timeout=timeout,
                echo=echo, report=report)
        except Stopped as e:
            message = stopped_message(e.signum, grace_period)
            say(report, message)
            # The attempts that ended before the stop; the stopped one is
            # the message.
            raise LaunchError(message, tuple(attempts), (), (),
                              128 + e.signum) from None


def _supervise(attempts, command, extras, labels, stop, grace_period,
               membership, *, max_restarts, restart_codes, backoff,
               hang_timeout, progress_file, cwd, timeout, echo,
               report) -> LaunchResult:
    """`launch`'s attempts, its arguments checked, each on the slots
    `membership` gives it; each one that ended is added to `attempts`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    job_started, previous_ended = repr(time.time()), None
    while True:
        number = len(attempts) + 1
        slots = membership.slots
        shrunk = len(slots) < len(labels)
        if stop.grow_requested and not shrunk:
            stop.grow_requested = False
            say(report, f"keras-mgpu launch: SIGUSR1: all {len(slots)} "
                         "workers already run; nothing to start again.")
        extras_now = [extras[slot] for slot in slots]
        labels_now = [labels[slot] for slot in slots]
        for extra in extras_now:
            extra[ATTEMPT_ENV] = str(number)
            extra[JOB_STARTED_ENV] = job_started
            extra[ATTEMPT_STARTED_ENV] = repr(time.time())
            if previous_ended is not None:
                extra[PREVIOUS_ENDED_ENV] = previous_ended
        watchdog = None if progress_file is None else (
            _attempts.ProgressWatchdog(progress_file, hang_timeout))
        left = None if deadline is None else max(
            deadline - time.monotonic(), 1e-3)
        results, first, stopped, held = _run_cluster(
            command, len(slots), extras_now, timeout=left, cwd=cwd,
            echo=echo, labels=labels_now, watchdog=watchdog, stop=stop,
            grow=shrunk, grace_period=grace_period,
            held_as=f"attempt{number}")
        previous_ended = repr(time.time())
        attempt = _attempts.ending(number, results, first, stopped,
                                   restart_codes, labels_now)
        attempts.append(attempt)
        if attempt.finished:
            say(echo, *held)
            return LaunchResult(tuple(attempts), results)
        if attempt.why == GROW_REASON:
            stop.grow_requested = False
            back = _named(membership.grow(), labels)
            say(report, f"keras-mgpu launch: attempt {number} ended: "
                         f"{attempt.why}. Restarting all {len(labels)} "
                         f"workers, {back} back (not counted against "
                         "max_restarts).")
            say(echo, *held)
            continue
        restart = _attempts.restarts_made(attempts) + 1
        if not attempt.restartable or restart > max_restarts:
            summary = _attempts.gave_up(attempts, restart_codes,
                                        max_restarts)
            # The failure first, then what the others printed after it.
            say(report, summary)
            say(echo, *held)
            raise LaunchError(
                summary + "\n" + _describe(results, "failed", labels_now,
                                           first),
                attempts, results, first, _attempts.exit_code(attempt))
        wait = _attempts.backoff_seconds(backoff, restart)
        left_out = membership.after(attempt)
        going_on = (f"Restarting all {len(slots)} workers" if not left_out
                    else _without(left_out, labels, membership))
        say(report, f"keras-mgpu launch: attempt {number} ended: "
                     f"{attempt.why}. {going_on} in {wait:g} s (restart "
                     f"{restart} of {max_restarts}).")
        say(echo, *held)
        stop.sleep(wait)


def _without(left_out, labels, membership) -> str:
    """The report's words for a restart that leaves slots out."""
    return (f"{_named(left_out, labels)} failed in {_attempts.SHRINK_AFTER} attempts in a "
            f"row: restarting without {'it' if len(left_out) == 1 else 'them'}"
            f", on {len(membership.slots)} workers (min_workers="
            f"{membership.min_workers}; SIGUSR1 to this launcher, pid "
            f"{os.getpid()}, starts every worker again),")


def _named(slots, labels) -> str:
    return " and ".join(labels[slot] for slot in slots)


def _check_min_workers(min_workers, num_workers: int) -> int:
    if min_workers is None:
        return num_workers
    if not is_integer(min_workers) or not 1 <= min_workers <= num_workers:
        raise ValueError(
            f"min_workers must be an integer from 1 to num_workers "
            f"({num_workers}), got {min_workers!r}: the fewest workers a "
            "restart may go on with.")
    return int(min_workers)


def _check_restarts(max_restarts, restart_exit_codes, backoff, hang_timeout,
                    progress_file, timeout) -> frozenset:
    """Checks `launch`'s own options; returns the restart codes."""
    if not is_integer(max_restarts) or max_restarts < 0:
        raise ValueError(
            f"max_restarts must be an integer >= 0, got {max_restarts!r}.")
    if (isinstance(restart_exit_codes, (str, bytes))
            or not isinstance(restart_exit_codes, Iterable)):
        raise TypeError(f"restart_exit_codes must be a collection of exit "
                        f"codes, got {restart_exit_codes!r}.")
    restart_codes = frozenset(restart_exit_codes)
    bad = [c for c in restart_codes if not is_integer(c) or not 1 <= c <= 255]
    if bad:
        raise ValueError(
            f"restart_exit_codes must hold exit codes from 1 to 255, got "
            f"{sorted(map(repr, bad))}: 0 is success, and a process can "
            "exit with 1 to 255 only.")
    if (not isinstance(backoff, numbers.Real) or isinstance(backoff, bool)
            or not math.isfinite(backoff) or backoff < 0):
        raise ValueError(f"backoff must be a number of seconds >= 0, got "
                         f"{backoff!r}.")
    if (hang_timeout is None) != (progress_file is None):
        raise ValueError(
            f"hang_timeout ({hang_timeout!r}) and progress_file "
            f"({progress_file!r}) go together: the watchdog stops the "
            "workers when that file has not changed for that long. Pass "
            "both, or neither.")
    if hang_timeout is not None:
        options.check_timeout(hang_timeout, "hang_timeout")
    if timeout is not None:
        options.check_timeout(timeout, "timeout")
    return restart_codes

