"""Runs a program as a local multi-worker cluster: one process per worker.

Each process gets a `TF_CONFIG` naming every worker on a free localhost port,
so `keras_mgpu.auto_strategy()` returns a `MultiWorkerMirroredStrategy` in it.
Every wait has a timeout, every child is killed when anything fails, and a
failing worker's stderr is part of the error.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import (
    Any,
    Callable,
    Mapping,
    Optional,
    Sequence,
    TextIO,
    Union,
)

from keras_mgpu._checks import is_integer
from keras_mgpu.cluster import options
from keras_mgpu.cluster.echo import Echo
from keras_mgpu.cluster.echo import say
from keras_mgpu.cluster.options import RESULT_ENV
from keras_mgpu.cluster.options import Target
from keras_mgpu.cluster.output import WorkerError
from keras_mgpu.cluster.output import _collect
from keras_mgpu.cluster.output import _describe
from keras_mgpu.cluster.output import _Marker
from keras_mgpu.cluster.processes import kill_all
from keras_mgpu.cluster.processes import stop_gracefully
from keras_mgpu.cluster.processes import tied_to_launcher
from keras_mgpu.cluster.signals import GROW_REASON
from keras_mgpu.cluster.tf_config import make_tf_config
from keras_mgpu._args import DEFAULT_GRACE_PERIOD


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
    num_workers = options.worker_count(num_workers)
    to_kill = options.check_options(timeout, kill_when_printed, kill_workers,
                                    num_workers, kill_signal, check)
    command, labels, extras = options.worker_setup(
        target, num_workers, kwargs, args, env, cwd, labels)
    results, first, _, held = _run_cluster(
        command, num_workers, extras, timeout=timeout, cwd=cwd,
        marker=kill_when_printed, to_kill=to_kill, kill_signal=kill_signal,
        echo=echo, labels=labels)
    say(echo, *held)
    if check:
        failed = [r for r in results if r.returncode != 0 and not r.killed]
        if failed:
            raise WorkerError(_describe(failed, "failed", labels, first),
                              results, first)
    return results


def _run_cluster(command: list, num_workers: int, extras: list, *,
                 timeout: Optional[float], cwd=None, marker=None,
                 to_kill=(), kill_signal=signal.SIGKILL, echo=None,
                 labels=(), watchdog: Optional[Callable[[], Optional[str]]]
                 = None, stop=None, grow: bool = False,
                 grace_period: float = DEFAULT_GRACE_PERIOD,
                 held_as: str = "run") -> tuple:
    """Starts `num_workers` processes of `command` on fresh ports and waits
    for them; (their `WorkerResult`s, the indices of the first to fail, why
    the watchdog stopped them or None, a line per worker whose output
    `echo` held back after the failure, for the caller to show after its
    own line about it). `timeout` None: no deadline. `watchdog()`, asked
    while they run, returns why to stop them all (a hang), or None. Raises
    `WorkerError` on the timeout, with every worker killed, and
    `signals.Stopped` when `stop` (a `signals.StopSignals`) is asked to,
    the workers given SIGTERM and `grace_period` seconds first. With
    `grow`, a `stop.grow_requested` stops them the same way, and the
    reason returned is `GROW_REASON`."""
    addresses = [f"localhost:{p}" for p in free_ports(num_workers)]
    procs: list[subprocess.Popen] = []
    files: list[tuple[TextIO, TextIO]] = []
    echoer = Echo(echo, files, labels, held_as)
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
            procs.append(_start_worker(command, child_env, cwd, out, err))
        killed, stopped, first, stop_reason = _wait(
            procs, files, timeout, marker, to_kill, kill_signal,
            echoer, labels, watchdog, stop, grace_period, grow)
        results = _collect(procs, files, workdir, killed, stopped,
                           addresses)
    except BaseException:
        _end(procs, files, workdir, echoer)
        # What was held back comes after the error's own report.
        say(echo, *echoer.held_back())
        raise
    _end(procs, files, workdir, echoer)
    return results, first, stop_reason, echoer.held_back()


def _start_worker(command: list, env: dict, cwd: Optional[str],
                  stdout: TextIO, stderr: TextIO) -> subprocess.Popen:
    """Starts one worker process as the leader of a new process group
    (`start_new_session`: the launcher kills the whole group), ended with
    the launcher; the one place a worker is started, so that a caller that
    must start workers another way (forked from a process that imported
    TensorFlow) replaces it alone."""
    return subprocess.Popen(tied_to_launcher(command), env=env, cwd=cwd,
                            stdout=stdout, stderr=stderr,
                            start_new_session=True)


def _end(procs, files, workdir, echoer) -> None:
    # Whatever happened (a timeout, Ctrl-C, a failed start), no worker
    # outlives the call, and the files go only once no worker writes.
    kill_all(procs)
    echoer.copy(final=True)
    for out, err in files:
        out.close()
        err.close()
    shutil.rmtree(workdir, ignore_errors=True)





def _wait(procs, files, timeout, marker, to_kill, kill_signal, echo: Echo,
          labels, watchdog=None, stop=None,
          grace_period=DEFAULT_GRACE_PERIOD, grow=False):
    """Waits for the workers; returns the indices killed on request, those
    stopped after a failure (or by the watchdog), those whose failure was
    seen first, and why the watchdog stopped them (or None)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    killed: set[int] = set()
    watch = None if marker is None else _Marker(marker)
    while True:
        if stop is not None and stop.signum is not None:
            stop_gracefully(procs, grace_period, stop, echo.copy)
            stop.check()
        if grow and stop.grow_requested:
            running = {i for i, p in enumerate(procs) if p.poll() is None}
            stop_gracefully(procs, grace_period, stop, echo.copy)
            stop.check()
            return killed, running - killed, [], GROW_REASON
        codes = [p.poll() for p in procs]
        first = [i for i, c in enumerate(codes)
                 if c not in (None, 0) and i not in killed]
        # What was written until now is shown (a collective's abort held
        # back all the same); from the failure on, the others' is held.
        echo.copy()
        if first:
            echo.failed(first)
        if all(c is not None for c in codes):
            return killed, set(), [], None
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


