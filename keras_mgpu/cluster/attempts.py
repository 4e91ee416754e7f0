"""The restart policy of `launch`: why an attempt of a local cluster
ended, whether that is worth another attempt, how long to wait first, and
the watchdog that calls a run hung.

Only the standard library: the processes themselves are `workers`'.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional, Sequence

from keras_mgpu.cluster.output import WorkerError, WorkerResult, _how
from keras_mgpu.cluster.signals import GROW_REASON
from keras_mgpu.cluster.tf_config import GRPC_START_FAILED

# The longest wait between attempts, however many restarts came before.
MAX_BACKOFF_SECONDS = 60.0
# Attempts in a row a worker slot must fail in before `launch` goes on
# without it (where `min_workers` allows): one failure is as likely a
# neighbour's, or a transient one, as the slot's own.
SHRINK_AFTER = 2


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One start of every worker, and how it ended.

    Args:
        number: 1 for the first start, 2 for the first restart, ...
        why: How it ended, in words (`"finished"`, or the first failure).
        restartable: Whether that ending is worth another attempt.
        returncodes: Each worker's exit status (negative: the signal that
            ended it; workers the launcher stopped show its SIGKILL).
        failed: The indices of the workers whose failure ended it (empty
            when it finished, or when the watchdog stopped every worker).

    Example:

    >>> Attempt(1, "worker 1 exit code 143", True, (0, 143)).finished
    False
    """

    number: int
    why: str
    restartable: bool
    returncodes: tuple
    failed: tuple = ()

    @property
    def finished(self) -> bool:
        return self.why == "finished"


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """What `launch` ran: every attempt, and the workers of the last one.

    Args:
        attempts: Every `Attempt`, first to last.
        results: The last attempt's `WorkerResult`s, in rank order.

    Example:

    >>> LaunchResult((Attempt(1, "hung", True, (-9, -9)),
    ...               Attempt(2, "finished", False, (0, 0))), []).restarts
    1
    """

    attempts: tuple
    results: list

    @property
    def restarts(self) -> int:
        return len(self.attempts) - 1


class LaunchError(WorkerError):
    """`launch` gave up: a failure it does not restart for, no restarts
    left, or a stop signal. `attempts` holds every attempt that ended (a
    stopped one is the message); `results` the last one's workers;
    `exit_code` the status a shell would report for the failure."""

    def __init__(self, message: str, attempts: Sequence[Attempt],
                 results: Sequence[WorkerResult],
                 first_failed: Sequence[int], exit_code: int):
        super().__init__(message, results, first_failed)
        self.attempts = tuple(attempts)
        self.exit_code = exit_code


def ending(number: int, results: Sequence[WorkerResult], first: Sequence[int],
           stop_reason: Optional[str], restart_codes, labels) -> Attempt:
    """How attempt `number` ended, from its workers' results."""
    codes = tuple(r.returncode for r in results)
    if stop_reason is not None:
        return Attempt(number, stop_reason, True, codes)
    # The first failures the launcher saw; where every worker had ended
    # by then, each that failed.
    failed = ([results[i] for i in first] if first else
              [r for r in results if r.returncode != 0 and not r.stopped])
    if not failed:
        return Attempt(number, "finished", False, codes)
    why = "; ".join(_why(r, labels) for r in failed)
    restartable = all(_status(r) < 0 or r.returncode in restart_codes
                      or _port_taken(r) for r in failed)
    return Attempt(number, why, restartable, codes,
                   tuple(r.index for r in failed))


def _status(result: WorkerResult) -> int:
    """The exit status of a worker that has ended (as every failed one
    has)."""
    assert result.returncode is not None
    return result.returncode


def _port_taken(result: WorkerResult) -> bool:
    """Whether the worker failed because its port was taken after the
    launcher picked it: transient, and fresh ports mend it."""
    return result.returncode != 0 and GRPC_START_FAILED in result.stderr


def _why(result: WorkerResult, labels) -> str:
    if _port_taken(result):
        return (f"{labels[result.index]} could not listen on "
                f"{result.address} (taken since it was picked)")
    return f"{labels[result.index]} {_how(result.returncode)}"


def exit_code(attempt: Attempt) -> int:
    """The status a shell reports for the attempt's first failure (not a
    worker the launcher stopped after it): its exit code, or 128 + the
    signal that ended it."""
    codes = [attempt.returncodes[i] for i in attempt.failed] or [
        c for c in attempt.returncodes if c]
    for code in codes:
        if code is not None and code != 0:
            return 128 - code if code < 0 else code
    return 1


def backoff_seconds(backoff: float, restart: int) -> float:
    """The wait before restart `restart` (1-based): `backoff`, doubling."""
    return min(backoff * 2 ** (restart - 1), MAX_BACKOFF_SECONDS)


def restarts_made(attempts: Sequence[Attempt]) -> int:
    """The restarts that count against `max_restarts`: every start after
    the first, except those a SIGUSR1 asked for."""
    return sum(1 for a in attempts[:-1] if a.why != GROW_REASON)


def gave_up(attempts: Sequence[Attempt], restart_codes,
            max_restarts: int) -> str:
    """The line `launch` ends with when it stops restarting: how many
    attempts, why no more, and how each ended."""
    last = attempts[-1]
    if not last.restartable:
        why = ("not restarted: a restart is for a worker a signal ended or "
               "one that exits with "
               f"{', '.join(map(str, sorted(restart_codes)))}")
    else:
        why = (f"no restarts left: {restarts_made(attempts)} of "
               f"max_restarts={max_restarts} made")
    each = "; ".join(f"attempt {a.number}: {a.why}" for a in attempts)
    plural = "s" if len(attempts) > 1 else ""
    return (f"keras-mgpu launch: gave up after {len(attempts)} attempt"
            f"{plural} ({why}): {each}.")


class Membership:
    """Which of `launch`'s worker slots (its `num_workers` workers, each
    with its own environment and label) the next attempt starts.

    A slot that failed in `SHRINK_AFTER` attempts in a row is left out of
    the next one, while at least `min_workers` slots are left; the others
    keep their environment and label, and take the ranks 0, 1, ... in
    their order.

    Args:
        num_workers: The slots, all of which the first attempt starts.
        min_workers: The fewest slots an attempt may start.

    `grow()` starts every slot again (`launch` does on SIGUSR1).

    Example:

    >>> membership = Membership(3, min_workers=2)
    >>> ended = Attempt(1, "worker 2 exit code 137", True, (-9, -9, 137), (2,))
    >>> membership.after(ended), membership.after(ended), membership.slots
    ([], [2], [0, 1])
    >>> membership.grow(), membership.slots
    ([2], [0, 1, 2])
    """

    def __init__(self, num_workers: int, min_workers: int):
        self.slots = list(range(num_workers))
        self.min_workers = min_workers
        self._in_a_row = [0] * num_workers

    def after(self, attempt: Attempt) -> list:
        """Counts the slots that failed in `attempt` (a restartable ending
        of an attempt of `self.slots`); returns those the next attempt
        leaves out, now gone from `self.slots`."""
        failed = {self.slots[rank] for rank in attempt.failed}
        for slot in self.slots:
            self._in_a_row[slot] = (self._in_a_row[slot] + 1
                                    if slot in failed else 0)
        spare = len(self.slots) - self.min_workers
        due = [slot for slot in self.slots
               if self._in_a_row[slot] >= SHRINK_AFTER]
        left_out = sorted(due[-spare:] if spare > 0 else [])
        self.slots = [slot for slot in self.slots if slot not in left_out]
        return left_out

    def grow(self) -> list:
        """Starts every slot again, their failures forgotten; returns the
        slots that come back."""
        every = range(len(self._in_a_row))
        back = [slot for slot in every if slot not in self.slots]
        self.slots = list(every)
        self._in_a_row = [0] * len(self._in_a_row)
        return back


class ProgressWatchdog:
    """Calls an attempt hung when `path` (a file the workers rewrite as they
    train: the backup's `LOCK.json`, the logger's JSONL) has not changed for
    `seconds`, counted from the attempt's start at the earliest."""

    def __init__(self, path: str, seconds: float):
        self._path = path
        self._seconds = seconds
        self._started = time.time()

    def __call__(self) -> Optional[str]:
        try:
            changed = os.stat(self._path).st_mtime
        except OSError:
            changed = 0.0
        last = max(changed, self._started)
        if time.time() - last > self._seconds:
            return (f"hung: {self._path} unchanged for more than "
                    f"{self._seconds:g} s; stopped every worker")
        return None
