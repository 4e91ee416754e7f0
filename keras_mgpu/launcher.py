"""Runs a program as a local multi-worker cluster: one process per worker.

Each process gets a `TF_CONFIG` naming every worker on a free localhost port,
so `keras_mgpu.auto_strategy()` returns a `MultiWorkerMirroredStrategy` in it.
Every wait has a timeout, every child is killed when anything fails, and a
failing worker's stderr is part of the error.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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

from keras_mgpu._checks import (
    is_flag,
    is_integer,
    is_nonempty_path,
    is_positive_integer,
)
# The workers' results, output and error message have their own module;
# `launcher.<name>` keeps naming them.
from keras_mgpu._launcher_output import WorkerError
from keras_mgpu._launcher_output import WorkerResult  # noqa: F401
from keras_mgpu._launcher_output import _collect
from keras_mgpu._launcher_output import _describe
from keras_mgpu._launcher_output import _Echo
from keras_mgpu._launcher_output import _Marker
from keras_mgpu import _supervisor
from keras_mgpu._supervisor import LaunchError  # noqa: F401
from keras_mgpu._supervisor import LaunchResult
from keras_mgpu._worker_processes import check_open_files
from keras_mgpu._worker_processes import kill_all
from keras_mgpu._worker_processes import stop_gracefully
from keras_mgpu.callbacks.backup.exit_codes import LAUNCH_RESTART_EXIT_CODES
from keras_mgpu.strategy import make_tf_config
from keras_mgpu_args import DEFAULT_GRACE_PERIOD
from keras_mgpu_args import check_program

RESULT_ENV = "KERAS_MGPU_RESULT"
# The attempt number `launch` gives each worker: 1, then 2 after a restart.
ATTEMPT_ENV = "KERAS_MGPU_ATTEMPT"

Target = Union[str, Sequence[str], Callable[..., Any]]


def free_ports(n: int) -> list:
    """Returns `n` distinct TCP ports that are free on localhost right now."""
    if not is_integer(n) or n < 0:
        raise ValueError(
            f"free_ports needs a number of ports (an integer >= 0), got {n!r}."
        )
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("localhost", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _command(target: Target, kwargs: Mapping[str, Any], args: Sequence[str]):
    if isinstance(target, (list, tuple)):
        # A command line, run as given (`keras-mgpu launch -- python ...`).
        if not target or not all(isinstance(a, str) for a in target):
            raise TypeError(
                f"A command target must be a non-empty list of strings, got "
                f"{target!r}, e.g. ['python', 'train.py', '--epochs', '2'].")
        if kwargs or args:
            raise ValueError(
                f"kwargs and args are for a function or script target, but "
                f"{list(target)!r} is a command line: put its arguments in "
                "the list.")
        return list(target)
    if callable(target):
        module = getattr(target, "__module__", None)
        qualname = getattr(target, "__qualname__", None)
        if module == "__main__":
            raise ValueError(
                f"Cannot run {target!r} in a worker: it is defined in "
                "__main__. Move it into an importable module, or pass the "
                "path of a script."
            )
        if not module or not qualname or "<" in qualname:
            # A lambda, a nested function or a partial has no name a worker
            # could import; it would fail only once every worker started.
            raise ValueError(
                f"Cannot run {target!r} in a worker: only a module-level "
                "function can be imported there. Define it at the top level "
                "of an importable module, or pass the path of a script."
            )
        target = f"{module}:{qualname}"
    if not isinstance(target, str):
        raise TypeError(
            f"target must be a script path, a 'module:function' string or a "
            f"module-level function, got {target!r}."
        )
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise FileNotFoundError(f"No script at {target!r}.")
        if kwargs:
            raise ValueError(
                f"kwargs are for a function target, but {target!r} is a "
                f"script (got kwargs={dict(kwargs)!r}). Pass command-line "
                "arguments with args=[...] instead."
            )
        return [sys.executable, target, *args]
    if ":" not in target:
        raise ValueError(
            f"target {target!r} is neither a '.py' script nor a "
            "'module:function' string."
        )
    if args:
        raise ValueError(
            f"args are for a script target, but {target!r} is a function "
            f"(got args={list(args)!r}). Pass its arguments with "
            "kwargs={...} instead."
        )
    try:
        encoded = json.dumps(dict(kwargs))
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"kwargs must be JSON-serialisable, as they reach each worker as "
            f"JSON ({e}); got {dict(kwargs)!r}. Pass lists, numbers and "
            "strings (e.g. array.tolist()) or paths to files."
        ) from None
    # The function's module is importable here: the worker, the same
    # interpreter, searches where this process does (given to the
    # bootstrap, not to PYTHONPATH, which every process the worker starts
    # would inherit).
    search_path = json.dumps([p for p in sys.path if p])
    return [sys.executable, "-c", _BOOTSTRAP, target, encoded, search_path]


def run_local_workers(
    target: Target,
    num_workers: int = 2,
    *,
    kwargs: Optional[Mapping[str, Any]] = None,
    args: Sequence[str] = (),
    timeout: float = 300.0,
    env: Union[None, Mapping[str, str], Callable[[int], Mapping[str, str]]] = None,
    cwd: Optional[str] = None,
    kill_when_printed: Optional[str] = None,
    kill_workers: Optional[Sequence[int]] = None,
    kill_signal: int = signal.SIGKILL,
    check: bool = True,
    echo: Optional[TextIO] = None,
    labels: Optional[Sequence[str]] = None,
) -> list:
    """Runs `target` as `num_workers` local worker processes and waits.

    Every argument is checked before the first worker starts. The workers'
    stdout and stderr go to files, not to the terminal: they come back in
    the `WorkerResult`s, and the `WorkerError` of a failed run names the
    worker that failed first and how (exit code or signal), marks the
    workers the launcher stopped after it, and quotes their stderr. With
    `echo`, each line is also copied there while the workers run. The
    files are removed before the call returns or raises.

    Args:
        target: A script path (`"train.py"`), a `"module:function"` string, or
            a module-level function. A function is called with `kwargs` and
            its JSON-serialisable return value becomes the worker's `result`.
            A script may write JSON to the file named by the
            `KERAS_MGPU_RESULT` environment variable.
        num_workers: Defaults to 2. A positive integer.
        kwargs: Defaults to `None`. Keyword arguments for a function target
            (a mapping of JSON-serialisable values).
        args: Defaults to `()`. Command-line arguments for a script target
            (a list of strings, not one string).
        timeout: Defaults to 300. Seconds for the whole cluster, a positive
            finite number (there is no unlimited wait); past it, every
            worker is killed and `WorkerError` is raised.
        env: Defaults to `None`. Extra environment (a mapping of strings to
            strings), or a function of the worker index returning it (e.g.
            for `CUDA_VISIBLE_DEVICES`).
        cwd: Defaults to `None`, the current directory. An existing
            directory.
        kill_when_printed: Defaults to `None`. When any worker prints a line
            containing this non-empty text to stdout, send `kill_signal` to
            the workers in `kill_workers`: a simulated crash or preemption.
            Once those have exited, the others are stopped within seconds,
            as after a failure (they would wait for the killed ones), and
            reported as killed too.
        kill_workers: Defaults to `None`, all workers. Worker indices, from
            0 to `num_workers - 1`; only with `kill_when_printed`.
        kill_signal: Defaults to `signal.SIGKILL`. A signal number this
            platform knows.
        check: Defaults to `True`: raise `WorkerError` if a worker that was
            not killed on request exits non-zero.
        echo: Defaults to `None` (nothing shown while the workers run). A
            text stream (e.g. `sys.stdout`) that gets each line the workers
            print, stdout and stderr, as it comes, after the worker's label
            in brackets (`[worker 1] ...`).
        labels: Defaults to `None`: `worker <index>`. One name per worker,
            used by `echo` and in `WorkerError` messages.

    Returns:
        One `WorkerResult` per worker, in rank order.

    Example:

    >>> results = run_local_workers("platform:python_implementation", 2,
    ...                             timeout=60)
    >>> [(r.index, r.returncode, r.result) for r in results]
    [(0, 0, 'CPython'), (1, 0, 'CPython')]
    """
    num_workers = _worker_count(num_workers)
    to_kill = _check_options(timeout, kill_when_printed, kill_workers,
                             num_workers, kill_signal, check)
    command, labels, extras = _worker_setup(
        target, num_workers, kwargs, args, env, cwd, labels)
    results, first, _ = _run_cluster(
        command, num_workers, extras, timeout=timeout, cwd=cwd,
        marker=kill_when_printed, to_kill=to_kill, kill_signal=kill_signal,
        echo=echo, labels=labels)
    if check:
        failed = [r for r in results if r.returncode != 0 and not r.killed]
        if failed:
            raise WorkerError(_describe(failed, "failed", labels, first),
                              results, first)
    return results


def launch(
    target: Target,
    num_workers: int = 2,
    *,
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
    _check_timeout(grace_period, "grace_period")
    num_workers = _worker_count(num_workers)
    command, labels, extras = _worker_setup(
        target, num_workers, kwargs, args, env, cwd, labels)
    with _supervisor.StopSignals() as stop:
        try:
            return _supervise(
                command, num_workers, extras, labels, stop, grace_period,
                max_restarts=max_restarts, restart_codes=restart_codes,
                backoff=backoff, hang_timeout=hang_timeout,
                progress_file=progress_file, cwd=cwd, timeout=timeout,
                echo=echo, report=report)
        except _supervisor.Stopped as e:
            message = _supervisor.stopped_message(e.signum, grace_period)
            _say(report, message)
            raise LaunchError(message, (), (), (), 128 + e.signum) from None


def _supervise(command, num_workers, extras, labels, stop, grace_period, *,
               max_restarts, restart_codes, backoff, hang_timeout,
               progress_file, cwd, timeout, echo, report) -> LaunchResult:
    """`launch`'s attempts, its arguments checked."""
    deadline = None if timeout is None else time.monotonic() + timeout
    attempts = []
    while True:
        number = len(attempts) + 1
        for extra in extras:
            extra[ATTEMPT_ENV] = str(number)
        watchdog = None if progress_file is None else (
            _supervisor.ProgressWatchdog(progress_file, hang_timeout))
        left = None if deadline is None else max(
            deadline - time.monotonic(), 1e-3)
        results, first, stopped = _run_cluster(
            command, num_workers, extras, timeout=left, cwd=cwd, echo=echo,
            labels=labels, watchdog=watchdog, stop=stop,
            grace_period=grace_period)
        attempt = _supervisor.ending(number, results, first, stopped,
                                     restart_codes, labels)
        attempts.append(attempt)
        if attempt.finished:
            return LaunchResult(tuple(attempts), results)
        if not attempt.restartable or number > max_restarts:
            summary = _supervisor.gave_up(attempts, restart_codes,
                                          max_restarts)
            _say(report, summary)
            raise LaunchError(
                summary + "\n" + _describe(results, "failed", labels, first),
                attempts, results, first, _supervisor.exit_code(attempt))
        wait = _supervisor.backoff_seconds(backoff, number)
        _say(report, f"keras-mgpu launch: attempt {number} ended: "
                     f"{attempt.why}. Restarting all {num_workers} workers "
                     f"in {wait:g} s (restart {number} of {max_restarts}).")
        stop.sleep(wait)


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
        _check_timeout(hang_timeout, "hang_timeout")
    if timeout is not None:
        _check_timeout(timeout, "timeout")
    return restart_codes


def _say(stream: Optional[TextIO], line: str) -> None:
    if stream is not None:
        stream.write(line + "\n")
        stream.flush()


def _check_timeout(value, name: str, hint: str = "") -> None:
    # A string would fail only in the wait, after every worker started; NaN
    # or inf would never time out.
    if (not isinstance(value, numbers.Real) or isinstance(value, bool)
            or not math.isfinite(value) or value <= 0):
        raise ValueError(
            f"{name} must be a positive, finite number of seconds, got "
            f"{value!r}.{hint}")


def _run_cluster(command: list, num_workers: int, extras: list, *,
                 timeout: Optional[float], cwd=None, marker=None,
                 to_kill=(), kill_signal=signal.SIGKILL, echo=None,
                 labels=(), watchdog: Optional[Callable[[], Optional[str]]]
                 = None, stop=None,
                 grace_period: float = DEFAULT_GRACE_PERIOD) -> tuple:
    """Starts `num_workers` processes of `command` on fresh ports and waits
    for them; (their `WorkerResult`s, the indices of the first to fail, why
    the watchdog stopped them or None). `timeout` None: no deadline.
    `watchdog()`, asked while they run, returns why to stop them all (a
    hang), or None. Raises `WorkerError` on the timeout, with every worker
    killed, and `_supervisor.Stopped` when `stop` (a
    `_supervisor.StopSignals`) is asked to, the workers given SIGTERM and
    `grace_period` seconds first."""
    addresses = [f"localhost:{p}" for p in free_ports(num_workers)]
    procs, files = [], []
    echoer = _Echo(echo, files, labels)
    # Holds each worker's stdout, stderr and result file until they are read
    # into its WorkerResult; removed however the run ends.
    workdir = tempfile.mkdtemp(prefix="keras_mgpu_workers_")
    try:
        for i in range(num_workers):
            child_env = dict(os.environ)
            child_env.update(
                TF_CONFIG=make_tf_config(addresses, i),
                PYTHONUNBUFFERED="1",
            )
            child_env[RESULT_ENV] = os.path.join(workdir, f"result{i}.json")
            child_env.update(extras[i])
            out = open(os.path.join(workdir, f"stdout{i}"), "w+")
            err = open(os.path.join(workdir, f"stderr{i}"), "w+")
            files.append((out, err))
            procs.append(
                subprocess.Popen(
                    command, env=child_env, cwd=cwd, stdout=out, stderr=err,
                    start_new_session=True,
                )
            )
        killed, stopped, first, stop_reason = _wait(
            procs, files, timeout, marker, to_kill, kill_signal,
            echoer.copy, labels, watchdog, stop, grace_period)
        results = _collect(procs, files, workdir, killed, stopped,
                           addresses)
    finally:
        # Whatever happened (a timeout, Ctrl-C, a failed start), no worker
        # outlives the call, and the files go only once no worker writes.
        kill_all(procs)
        echoer.copy(final=True)
        for out, err in files:
            out.close()
            err.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return results, first, stop_reason


def _worker_count(num_workers) -> int:
    if not is_positive_integer(num_workers):
        raise ValueError(
            f"num_workers must be a positive integer, got {num_workers!r}."
        )
    return int(num_workers)


def _worker_setup(target, num_workers: int, kwargs, args, env, cwd,
                  labels) -> tuple:
    """Checks what every cluster run starts its workers with; returns (the
    command, the labels, each worker's extra environment)."""
    if cwd is not None:
        if not is_nonempty_path(cwd):
            raise TypeError(
                f"cwd must be a directory path or None, got {cwd!r}."
            )
        if not os.path.isdir(cwd):
            raise FileNotFoundError(
                f"cwd {os.fspath(cwd)!r} is not a directory. Create it, or "
                "pass an existing one."
            )
    command = _command(target, _check_kwargs(kwargs), _check_args(args))
    labels = _check_labels(labels, num_workers)
    # A bad environment fails Popen for one worker after the others started.
    extras = [_check_env(env(i) if callable(env) else env, i, env)
              for i in range(num_workers)]
    # Popen would fail only once the launcher had started (the supervisor
    # imports TensorFlow), with a traceback.
    check_program(command, cwd, {**os.environ, **extras[0]})
    check_open_files(num_workers)
    return command, labels, extras


def _check_options(timeout, marker, kill_workers, num_workers, kill_signal,
                   check) -> set:
    """Checks the scalar options; returns the indices to kill on `marker`."""
    _check_timeout(timeout, "timeout", " Pass a number, e.g. timeout=300: "
                   "every cluster run has a deadline, so a hung worker "
                   "cannot hang the caller.")
    if marker is not None:
        if not isinstance(marker, str):
            raise TypeError(
                f"kill_when_printed must be a str (text a worker prints) or "
                f"None, got {marker!r}."
            )
        if not marker:
            raise ValueError(
                "kill_when_printed must be non-empty text, got '': every "
                "output contains it, so the workers would be killed at once."
            )
    to_kill = set(range(num_workers))
    if kill_workers is not None:
        if marker is None:
            raise ValueError(
                f"kill_workers={kill_workers!r} needs kill_when_printed: "
                "the workers are killed when that text is printed. Pass "
                "both, or neither."
            )
        if (isinstance(kill_workers, (str, bytes, Mapping))
                or not isinstance(kill_workers, Iterable)):
            raise TypeError(
                f"kill_workers must be a list of worker indices, got "
                f"{kill_workers!r}."
            )
        indices = list(kill_workers)
        bad = [i for i in indices
               if not is_integer(i) or not 0 <= i < num_workers]
        if bad:
            raise ValueError(
                f"kill_workers must hold worker indices from 0 to "
                f"{num_workers - 1} (num_workers={num_workers}), got "
                f"{kill_workers!r}."
            )
        to_kill = {int(i) for i in indices}
    if not is_integer(kill_signal) or kill_signal not in signal.valid_signals():
        # Signal 0 only probes a process: the workers would not be killed.
        raise ValueError(
            f"kill_signal must be a signal this platform knows, e.g. "
            f"signal.SIGTERM or signal.SIGKILL, got {kill_signal!r}."
        )
    if not is_flag(check):
        raise TypeError(
            f"check must be True or False, got {check!r} (a non-empty string "
            "such as 'false' would count as True)."
        )
    return to_kill


def _check_labels(labels, num_workers: int) -> list:
    if labels is None:
        return [f"worker {i}" for i in range(num_workers)]
    if (isinstance(labels, (str, bytes)) or not isinstance(labels, Sequence)
            or len(labels) != num_workers
            or not all(isinstance(label, str) for label in labels)):
        raise TypeError(
            f"labels must be a list of {num_workers} strings (one name per "
            f"worker), got {labels!r}."
        )
    return list(labels)


def _check_kwargs(kwargs) -> Mapping[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(
            isinstance(k, str) for k in kwargs):
        raise TypeError(
            f"kwargs must be a mapping of argument names to values, got "
            f"{kwargs!r}."
        )
    return kwargs


def _check_args(args) -> list:
    # A string would be spread into one argument per character.
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(
            f"args must be a list of command-line arguments, got {args!r}. "
            "Split it, e.g. args=['--epochs', '2']."
        )
    bad = [a for a in args if not isinstance(a, (str, os.PathLike))]
    if bad:
        raise TypeError(
            f"args must all be strings, got {bad!r} in {list(args)!r}. "
            "Convert them, e.g. str(2)."
        )
    return list(args)


def _check_env(extra, index: int, env) -> dict:
    if extra is None:
        return {}
    what = f"env({index})" if callable(env) else "env"
    if not isinstance(extra, Mapping):
        raise TypeError(
            f"{what} must be a mapping of variable names to values, got "
            f"{extra!r}."
        )
    bad = {k: v for k, v in extra.items()
           if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise TypeError(
            f"{what} must map strings to strings, got {bad!r}. Convert the "
            "values, e.g. {'CUDA_VISIBLE_DEVICES': str(index)}."
        )
    return dict(extra)


def _wait(procs, files, timeout, marker, to_kill, kill_signal, echo, labels,
          watchdog=None, stop=None, grace_period=DEFAULT_GRACE_PERIOD):
    """Waits for the workers; returns the indices killed on request, those
    stopped after a failure (or by the watchdog), those whose failure was
    seen first, and why the watchdog stopped them (or None)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    killed = set()
    watch = None if marker is None else _Marker(marker)
    while True:
        if stop is not None and stop.signum is not None:
            stop_gracefully(procs, grace_period, stop, echo)
            stop.check()
        echo()
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return killed, set(), [], None
        first = [i for i, c in enumerate(codes)
                 if c not in (None, 0) and i not in killed]
        # A worker that died, or every one killed on request, leaves the
        # others waiting for it (in a collective, or a tuning chief for its
        # trial) until the timeout: stop them now. The ones a requested kill
        # stops count as killed on request.
        kill_done = bool(killed) and all(codes[i] is not None for i in killed)
        if first or kill_done:
            time.sleep(2.0)
            running = {i for i, p in enumerate(procs) if p.poll() is None}
            kill_all(procs)
            if first:
                return killed, running - killed, first, None
            return killed | running, set(), [], None
        if watch is not None and not killed:
            if watch.seen(files):
                for i in to_kill:
                    if procs[i].poll() is None:
                        os.killpg(procs[i].pid, kill_signal)
                killed = set(to_kill)
        reason = None if watchdog is None else watchdog()
        if reason is not None:
            running = {i for i, p in enumerate(procs) if p.poll() is None}
            kill_all(procs)
            return killed, running - killed, [], reason
        if deadline is not None and time.monotonic() > deadline:
            running = {i for i, p in enumerate(procs) if p.poll() is None}
            kill_all(procs)
            results = _collect(procs, files, None, killed, running - killed)
            raise WorkerError(
                _describe(results, f"timed out after {timeout:.0f}s", labels),
                results,
            )
        time.sleep(0.1)


# Runs in the worker: imports only the target's module (not keras_mgpu, so a
# worker starts fast), calls it, and commits its JSON result atomically.
_BOOTSTRAP = """
import importlib, json, os, sys
sys.path += [p for p in json.loads(sys.argv[3]) if p not in sys.path]
module_name, _, qualname = sys.argv[1].partition(":")
fn = importlib.import_module(module_name)
for part in qualname.split("."):
    fn = getattr(fn, part)
result = fn(**json.loads(sys.argv[2]))
path = os.environ.get("%s")
if path:
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
""" % RESULT_ENV
