"""The process's time ledger: every second of an attempt in one category.

An attempt is one process of a job (a `keras-mgpu launch` attempt's
worker, or a rerun by hand or by a job runner). Its clock starts when the
attempt started: when `launch` started it (`KERAS_MGPU_ATTEMPT_STARTED`),
else when this process started. From then on each second is charged to
exactly one category, the one in effect: `startup` until training's first
step, `productive` inside a training loop (step to step: the steps, and
what the loop does between them), `other` outside one after that (user
code between fits), with spans of the others entered and left by whoever
does that work (the runtime: `compile`, `evaluation`; the backup:
`restore`, `checkpoint`; the logger moves the input wait it measured
inside steps out of `productive`). The categories therefore add up to the
wall time since the attempt started.

Standard library only (and `cluster/`'s names of the launcher's
variables): `keras-mgpu goodput` reads what this writes without
TensorFlow.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Iterator, Optional

# What `keras-mgpu launch` tells each attempt it starts.
from keras_mgpu.cluster.supervisor import (ATTEMPT_ENV, ATTEMPT_STARTED_ENV,
                                           JOB_STARTED_ENV,
                                           PREVIOUS_ENDED_ENV)

# What one attempt spends its time on, as recorded.
CATEGORIES = (
    "startup",  # attempt start to the first training step: imports, strategy
    #             set-up, the model's build, data set-up
    "compile",  # a train function's first call: tracing and compilation
    "productive",  # the training loop, step to step, less the other
    #                categories' spans and the input wait measured in steps
    "input_wait",  # train steps blocked on their input (where timed)
    "checkpoint",  # backup saves on the training thread
    "restore",  # restoring a backup
    "evaluation",  # validation inside fit, evaluate
    "other",  # outside training loops after the first: between fits
)


def _process_started() -> float:
    """Unix time this process started: Linux's /proc (to 10 ms), else when
    this module was first imported."""
    try:
        with open("/proc/self/stat") as f:
            # The command name (field 2) may hold spaces: count after it.
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - max(age, 0.0)
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_IMPORTED = time.time()


def _from_env(name: str, kind: type = float):
    """The launcher's figure `name` as `kind`; None where unset or not one
    (a user's own variable of that name is not the ledger's to refuse)."""
    value = os.environ.get(name)
    try:
        return kind(value) if value else None
    except ValueError:
        return None


class TimeLedger:
    """The seconds one attempt (this process) spent in each category.

    `ledger()` is this process's; the runtime, the backup and the logger
    keep it.

    Args:
        started: Unix time the attempt's clock starts at.
        attempt: What identifies the attempt in the records (`started`,
            `pid` and the launcher's figures).

    Example:

    >>> import time
    >>> book = TimeLedger(time.time(), {"started": None})
    >>> with book.spending("checkpoint"):
    ...     time.sleep(0.01)
    >>> seconds = book.snapshot()["seconds"]
    >>> seconds["checkpoint"] >= 0.01, seconds["productive"]
    (True, 0.0)
    """

    def __init__(self, started: float, attempt: dict):
        self.attempt = attempt
        self.pid = os.getpid()
        self._seconds = dict.fromkeys(CATEGORIES, 0.0)
        # perf_counter is monotonic; the offset turns it into unix time
        # once, so that the categories add up to a snapshot's `time`
        # minus `started` exactly.
        self._offset = time.time() - time.perf_counter()
        self._since = started - self._offset
        self._base = "startup"
        self._spans: list = []
        self._claimed = False
        self._lock = threading.Lock()

    @property
    def current(self) -> str:
        return self._spans[-1] if self._spans else self._base

    def enter(self, category: str) -> None:
        """Charges the seconds so far to the category in effect; `category`
        is in effect until the matching `leave()`."""
        if category not in self._seconds:
            raise ValueError(f"unknown goodput category {category!r}; "
                             f"one of {CATEGORIES}")
        with self._lock:
            self._charge()
            self._spans.append(category)

    def leave(self) -> None:
        """Ends the innermost span: its seconds are charged to it."""
        with self._lock:
            self._charge()
            if self._spans:
                self._spans.pop()

    @contextlib.contextmanager
    def spending(self, category: str) -> Iterator[None]:
        """`enter(category)` for the `with` block, then `leave()`."""
        self.enter(category)
        try:
            yield
        finally:
            self.leave()

    def set_training(self, training: bool) -> None:
        """Inside a training loop (from its first batch to its end), time
        outside spans is `productive`; outside one, after the first, it is
        `other` (before it, `startup`)."""
        with self._lock:
            self._charge()
            if training:
                self._base = "productive"
            elif self._base == "productive":
                self._base = "other"

    def move(self, source: str, target: str, seconds: float) -> None:
        """Re-labels `seconds` (at most what `source` holds) as `target`:
        what a span could not tell apart (input wait inside steps)."""
        with self._lock:
            seconds = min(max(seconds, 0.0), self._seconds[source])
            self._seconds[source] -= seconds
            self._seconds[target] += seconds

    def snapshot(self, since: Optional[dict] = None) -> dict:
        """The ledger now: `{"time", "attempt", "seconds"}`, the seconds
        adding up to `time - attempt["started"]`; with `since` (an earlier
        snapshot), from then on (`started` is its time)."""
        with self._lock:
            now = self._charge()
            seconds = dict(self._seconds)
        attempt = dict(self.attempt)
        if since is not None:
            attempt["started"] = since["time"]
            seconds = {key: value - since["seconds"][key]
                       for key, value in seconds.items()}
        return {"time": now + self._offset, "attempt": attempt,
                "seconds": seconds}

    def baseline(self) -> Optional[dict]:
        """Where a new log's accounting starts: the attempt's start for the
        process's first (None), else now (a later `fit` of the process,
        such as a tuner's next trial, has its own log)."""
        with self._lock:
            first = not self._claimed
            self._claimed = True
        return None if first else self.snapshot()

    def _charge(self) -> float:
        now = time.perf_counter()
        self._seconds[self.current] += now - self._since
        self._since = now
        return now


_ledger: Optional[TimeLedger] = None
_ledger_lock = threading.Lock()


def ledger() -> TimeLedger:
    """This process's `TimeLedger` (a forked child gets its own)."""
    global _ledger
    with _ledger_lock:
        if _ledger is None or _ledger.pid != os.getpid():
            process_started = _process_started()
            started = _from_env(ATTEMPT_STARTED_ENV)
            # The launcher's figure, unless it came well after this process
            # started (left in the environment of a later run): /proc's
            # start is only good to its 10 ms ticks.
            if started is None or started > process_started + 1.0:
                started = process_started
            _ledger = TimeLedger(started, {
                "started": started,
                "pid": os.getpid(),
                "launch_attempt": _from_env(ATTEMPT_ENV, int),
                "job_started": _from_env(JOB_STARTED_ENV),
                "previous_ended": _from_env(PREVIOUS_ENDED_ENV),
            })
        return _ledger
