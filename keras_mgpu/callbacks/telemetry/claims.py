"""One writer per `log_dir`: a `DistributedLogger`'s run (its `fit`, or a
hand-written loop from `on_train_begin` to `on_train_end`) claims its
`log_dir`, in this process and (for a local one) across processes."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import threading
import weakref
from typing import Optional, TextIO

from keras_mgpu import _fs


class LogDirInUse(RuntimeError):
    """Another `DistributedLogger`'s run is writing the `log_dir`."""


# The claim of each log_dir written in this process, by `_key`. Weakref
# callbacks (a logger or a fit dropped) may run on any thread, inside a
# claim too (the garbage collector): reentrant, and every change checks
# that the entry is still the claim it means.
_CLAIMS: dict[str, _Claim] = {}
_CLAIMS_LOCK = threading.RLock()


@dataclasses.dataclass
class _Claim:
    logger: weakref.ref
    # The `compat.RunningFit` of its `fit` (weakly: the claim ends when that
    # fit has returned or raised); None for a hand-written loop.
    fit: Optional[weakref.ref]
    thread: threading.Thread  # the thread that began its run
    model: str  # the trained model's name, to name the run
    lock: Optional[TextIO] = None  # a local metrics.jsonl, open and flock'ed

    def live(self) -> bool:
        """Whether its run may still write: its logger exists and its `fit`
        runs, or its hand-written loop has not ended (a loop that raised
        holds it until its logger is dropped or its thread ends)."""
        if self.logger() is None:
            return False
        if self.fit is not None:
            fit = self.fit()
            return fit is not None and fit.running
        return self.thread.is_alive()

    def describe(self) -> str:
        """Its run, e.g. "a fit of model 'mlp' on thread 'Thread-3' (ident
        1234)"."""
        run = "fit" if self.fit is not None else "hand-written loop"
        if self.thread is threading.current_thread():
            where = "on this thread"
        else:
            where = (f"on thread {self.thread.name!r} "
                     f"(ident {self.thread.ident})")
        return f"a {run} of model {self.model!r} {where}"

    def release(self) -> None:
        if self.lock is not None:
            self.lock.close()  # unlocks
            self.lock = None


def _claim_log_dir(logger, running_fit) -> None:
    """Makes `logger` the one writer of its log_dir while its run lasts,
    or raises `LogDirInUse` naming the run that writes it.

    Two loggers writing one log_dir at once would interleave their records
    in one `metrics.jsonl` and write TensorBoard events at the same steps:
    refused, not separated, since the layout (`metrics.jsonl`, `train/`,
    `validation/`) is what readers and a resumed run rely on. One after the
    other is allowed: a resumed run continues the file.

    In this process, a claim made in a `fit` (`running_fit`, the
    `compat.RunningFit` the logger was given to) lasts while that fit runs,
    whatever thread asks: another logger in the same callbacks, a `fit`
    started from one of its callbacks (a tuner) and another thread are all
    refused, and a `fit` that raised ends it as it unwinds. A hand-written
    loop (`running_fit` None) holds it until its `on_train_end`, or until
    its logger is dropped or its thread ends. Across processes, a local
    log_dir's `metrics.jsonl` is locked (`flock`, released by the system
    when the process dies, SIGKILL too); for a URL only this process is
    checked. A log_dir is the same however it is spelled: relative or
    absolute, through a link, with a trailing slash, as a `file://` URL.
    """
    log_dir = logger.log_dir
    local = _local_path(log_dir)
    key = os.path.realpath(local) if local is not None else log_dir.rstrip("/")
    here = threading.current_thread()
    with _CLAIMS_LOCK:
        claim = _CLAIMS.get(key)
        if claim is not None and claim.live():
            _refuse_or_keep(claim, logger, running_fit, log_dir)
            if claim.logger() is logger:
                # The same logger again, its earlier run over (a hand loop
                # that raised): this run holds it now.
                claim.fit = _fit_ref(running_fit, key)
                claim.thread = here
                return
        if claim is not None:
            _end(key, claim)
        lock = None
        if local is not None:
            lock = _lock_metrics_file(local, log_dir)
        model = getattr(getattr(logger, "_trained_model", None), "name", None)
        _CLAIMS[key] = _Claim(
            weakref.ref(logger, lambda _: _drop_claim(key)),
            _fit_ref(running_fit, key), here, str(model), lock)


def _refuse_or_keep(claim: _Claim, logger, running_fit, log_dir: str) -> None:
    """Raises `LogDirInUse` unless `logger` may take over `claim` (live):
    only where it is the claim's own logger and not in another running
    fit."""
    holder = claim.logger()
    fit = claim.fit() if claim.fit is not None else None
    if holder is logger:
        if fit is None or fit is running_fit:
            return
        raise LogDirInUse(
            f"DistributedLogger: this logger is already writing log_dir "
            f"{log_dir!r} in {claim.describe()}, which is still running: "
            f"one logger writes one run at a time. Give this fit its own "
            f"DistributedLogger with another log_dir, or start it once that "
            f"fit has ended.")
    if fit is not None and fit is running_fit:
        index = next((i for i, c in enumerate(fit.callbacks)
                      if c is holder), None)
        at = "" if index is None else f" (callbacks[{index}])"
        raise LogDirInUse(
            f"DistributedLogger: log_dir {log_dir!r} is also the log_dir of "
            f"another DistributedLogger in this fit's callbacks{at}: both "
            f"would write it at once and interleave their records. Give one "
            f"of them another log_dir, or keep one.")
    nested = claim.thread is threading.current_thread()
    raise LogDirInUse(
        f"DistributedLogger: log_dir {log_dir!r} is being written by another "
        f"DistributedLogger's {'fit' if fit is not None else 'run'} in this "
        f"process (logger id {id(holder):#x}, in {claim.describe()}), which "
        f"has not ended"
        + ((" (this run was started inside it"
            + (", e.g. from one of its callbacks" if fit is not None else "")
            + ")") if nested else "")
        + f". {_IN_USE_HINT}"
        + ("" if fit is not None else
           " A hand-written loop ends at its callbacks' on_train_end: call "
           "it in a `finally`, so that a loop that raises ends too."))


def _fit_ref(running_fit, key: str) -> Optional[weakref.ref]:
    if running_fit is None:
        return None
    # The fit is dropped as it returns or raises: a fit that raised (Keras
    # then never calls `on_train_end`) frees the log_dir at once.
    return weakref.ref(running_fit, lambda _: _drop_claim(key))


def _local_path(log_dir: str) -> Optional[str]:
    """The local path `log_dir` names (a `file://` URL's too), or None for
    another file system's URL."""
    if log_dir.startswith("file://"):
        return log_dir[len("file://"):] or "/"
    return None if _fs.is_url(log_dir) else log_dir


def _lock_metrics_file(local: str, log_dir: str) -> TextIO:
    """`<local>/metrics.jsonl`, open and flock'ed: `LogDirInUse` where
    another process holds it."""
    os.makedirs(local, exist_ok=True)
    path = os.path.join(local, "metrics.jsonl")
    lock = open(path, "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_holder(lock)
        lock.close()
        raise LogDirInUse(
            f"DistributedLogger: log_dir {log_dir!r} is being written by "
            f"another process: {holder} ({path} is locked while a "
            f"DistributedLogger writes it). {_IN_USE_HINT}") from None
    return lock


def _lock_holder(file) -> str:
    """The process holding the flock on `file`, as Linux's /proc/locks
    names it; where that cannot be read, how to find it."""
    info = os.fstat(file.fileno())
    inode = (f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:"
             f"{info.st_ino}")
    try:
        with open("/proc/locks") as locks:
            lines = locks.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fd:00:5678 0 EOF"; a lock others
        # wait for is listed again with "->" before its type.
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
            continue
        if fields[5] == inode and fields[4].isdigit() and fields[4] != "0":
            return f"process {fields[4]}{_command_line(fields[4])}"
    return f"`fuser -v {file.name}` names it"


def _command_line(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return ""
    text = " ".join(w.decode(errors="replace") for w in words if w)
    if len(text) > 200:
        text = text[:197] + "..."
    return f" (`{text}`)" if text else ""


_IN_USE_HINT = (
    "Two loggers writing one log_dir would interleave their records. Give "
    "this logger another log_dir, or start it once that run has ended "
    "(continuing a run, e.g. after a resume, in the same log_dir is fine).")


def _end(key: str, claim: _Claim) -> None:
    """Ends `claim` (unlocks), and drops it if it is still `key`'s."""
    with _CLAIMS_LOCK:
        if _CLAIMS.get(key) is claim:
            del _CLAIMS[key]
        claim.release()


def _drop_claim(key: str) -> None:
    """A claim's logger or fit was dropped: unlock, unless the claim is
    still live (a new fit of the same logger)."""
    with _CLAIMS_LOCK:
        claim = _CLAIMS.get(key)
        if claim is not None and not claim.live():
            _end(key, claim)


def _writing(logger) -> bool:
    """Whether `logger`'s run holds its log_dir now."""
    with _CLAIMS_LOCK:
        return any(claim.logger() is logger and claim.live()
                   for claim in _CLAIMS.values())


def _release_log_dir(logger) -> None:
    with _CLAIMS_LOCK:
        for key, claim in list(_CLAIMS.items()):
            if claim.logger() is logger:
                _end(key, claim)
