"""One writer per `log_dir`: a `DistributedLogger`'s `fit` claims its
`log_dir`, in this process and (for a local one) across processes."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import threading
import weakref
from typing import Optional

from keras_mgpu import _fs


class LogDirInUse(RuntimeError):
    """Another `DistributedLogger`'s `fit` is writing the `log_dir`."""



# The logger whose `fit` writes each log_dir in this process.
_CLAIMS = {}
_CLAIMS_LOCK = threading.Lock()


@dataclasses.dataclass
class _Claim:
    logger: weakref.ref
    thread: int  # the thread running its `fit`
    lock: Optional[object]  # a local metrics.jsonl, open and flock'ed

    def release(self) -> None:
        if self.lock is not None:
            self.lock.close()  # unlocks
            self.lock = None


def _claim_log_dir(logger) -> None:
    """Makes `logger` the one writer of its log_dir while its `fit` runs,
    or raises `LogDirInUse`.

    Two loggers writing one log_dir at once would interleave their records
    in one `metrics.jsonl` and write TensorBoard events at the same steps:
    refused, not separated, since the layout (`metrics.jsonl`, `train/`,
    `validation/`) is what readers and a resumed run rely on. One after the
    other is allowed: a resumed run continues the file. In this process a
    claim ends with its `fit`; a `fit` that raised (no `on_train_end`) ends
    it when its thread starts another `fit` or ends, or when its logger is
    dropped. Across processes, a local log_dir's `metrics.jsonl` is locked
    (`flock`, released by the system when the process dies, SIGKILL too);
    for a URL only this process is checked.
    """
    log_dir = logger.log_dir
    local = not _fs.is_url(log_dir)
    key = os.path.realpath(log_dir) if local else log_dir
    here = threading.get_ident()
    with _CLAIMS_LOCK:
        claim = _CLAIMS.get(key)
        if claim is not None:
            holder = claim.logger()
            if holder is logger:
                claim.thread = here
                return
            if (holder is not None and claim.thread != here
                    and any(t.ident == claim.thread
                            for t in threading.enumerate())):
                raise LogDirInUse(
                    f"DistributedLogger: log_dir {log_dir!r} is being "
                    f"written by another DistributedLogger's fit in this "
                    f"process (thread {claim.thread}). {_IN_USE_HINT}")
            claim.release()
            del _CLAIMS[key]
        lock = None
        if local:
            os.makedirs(log_dir, exist_ok=True)
            path = os.path.join(log_dir, "metrics.jsonl")
            lock = open(path, "a")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                raise LogDirInUse(
                    f"DistributedLogger: log_dir {log_dir!r} is being "
                    f"written by another process ({path} is locked; "
                    f"`fuser -v {path}` names it). {_IN_USE_HINT}") from None
        _CLAIMS[key] = _Claim(
            weakref.ref(logger, lambda _, key=key: _drop_claim(key)),
            here, lock)


_IN_USE_HINT = (
    "Two loggers writing one log_dir would interleave their records. Give "
    "this logger another log_dir, or start it once that fit has ended "
    "(continuing a run, e.g. after a resume, in the same log_dir is fine).")


def _drop_claim(key: str) -> None:
    """A claiming logger was dropped (its `fit` raised): unlock."""
    with _CLAIMS_LOCK:
        claim = _CLAIMS.get(key)
        if claim is not None and claim.logger() is None:
            claim.release()
            del _CLAIMS[key]


def _release_log_dir(logger) -> None:
    with _CLAIMS_LOCK:
        for key, claim in list(_CLAIMS.items()):
            if claim.logger() is logger:
                claim.release()
                del _CLAIMS[key]


