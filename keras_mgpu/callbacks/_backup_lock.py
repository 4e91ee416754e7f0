"""The owner lock of a `backup_dir`: one live run writes there at a time."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import socket
import time
import uuid
import warnings
from typing import Optional

# Another machine's process cannot be asked whether it lives: it counts as
# alive while its heartbeat is younger than this.
STALE_SECONDS = 600
# At most one lock write per this many seconds, however often `refresh` runs.
HEARTBEAT_SECONDS = 30
LOCK_NAME = "LOCK.json"

_MISSING = object()
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CREATE = os.O_CREAT | os.O_EXCL | os.O_WRONLY | _NOFOLLOW


class BackupDirInUse(RuntimeError):
    """Another live run owns the `backup_dir`."""


class OwnerLock:
    """The owner lock of one backup_dir: which live process writes there.

    `<directory>/LOCK.json` names its owner (host, boot id, pid and process
    start time, a token unique to each `acquire`, and a heartbeat). A lock
    held by this process is taken again silently. An owner on this machine
    is dead when its pid is gone or now belongs to a process that started at
    another time; an owner elsewhere is dead when its heartbeat is
    `STALE_SECONDS` old. A dead owner's, or an unreadable, lock is taken
    over with a warning; a live owner's makes `acquire` raise
    `BackupDirInUse`. Local paths and `tf.io.gfile` URLs both work;
    TensorFlow is imported only for URLs.

    Args:
        directory: The directory to own (local path or `tf.io.gfile` URL).
        what: Defaults to `"BackupAndRestore"`. Who holds the lock, for the
            messages.

    Example:

    >>> import tempfile
    >>> lock = OwnerLock(tempfile.mkdtemp())
    >>> lock.acquire()
    >>> lock.refresh()
    >>> lock.release()
    """

    def __init__(self, directory: str, *, what: str = "BackupAndRestore"):
        self.directory = str(directory).rstrip("/")
        self.path = f"{self.directory}/{LOCK_NAME}"
        self.what = what
        # Not keras_mgpu._checks.is_url: this module imports only the
        # standard library (a lock holder need not load TensorFlow).
        self._local = "://" not in self.directory
        self._record: Optional[dict] = None
        self._last_refresh = 0.0  # time.monotonic() of the last lock write

    def acquire(self) -> None:
        """Takes the lock, or raises `BackupDirInUse` naming its live owner."""
        self._refuse_link()
        if self._local:
            os.makedirs(self.directory, exist_ok=True)
        else:
            _tf().io.gfile.makedirs(self.directory)
        now = time.time()
        record = {**_identity(), "token": uuid.uuid4().hex, "started": now,
                  "heartbeat": now}
        if not self._create(record):
            owner = self._read()
            if owner is not _MISSING:  # gone since: it was just released
                self._check_dead(owner)
            self._write(record)
        # Another run that created or took over the lock at the same moment
        # may have overwritten ours: whoever reads back another token loses.
        # Both can still win when each reads back before the other writes
        # (for URLs, and for two takeovers of one dead owner); the loser
        # then raises at its next heartbeat.
        self._check_ours(record["token"], "is in use by another run")
        self._record = record
        self._last_refresh = time.monotonic()

    def refresh(self) -> None:
        """Rewrites the heartbeat, at most every `HEARTBEAT_SECONDS`.

        Raises `BackupDirInUse` if another run has taken the lock over.
        """
        if self._record is None:
            raise RuntimeError(f"{self.what}: refresh() of {self.path} "
                               "before acquire().")
        if time.monotonic() - self._last_refresh < HEARTBEAT_SECONDS:
            return
        self._refuse_link()
        token = self._record["token"]
        self._check_ours(token, "was taken over by another run",
                         allow_lost=True)
        record = {**self._record, "heartbeat": time.time()}
        self._write(record)
        self._check_ours(token, "was taken over by another run")
        self._record = record
        self._last_refresh = time.monotonic()

    def release(self) -> None:
        """Removes the lock file if it is still ours; never raises if gone."""
        record, self._record = self._record, None
        if record is None or (self._local and os.path.islink(self.path)):
            return
        errors = (OSError,) if self._local else (OSError, _tf().errors.OpError)
        try:
            # Only a run that thinks this one dead overwrites the lock: the
            # moment between this read and the removal does not matter.
            owner = self._read()
            if isinstance(owner, dict) and owner["token"] == record["token"]:
                self._remove(self.path)
        except FileNotFoundError:
            pass
        except errors as e:
            if self._local or not isinstance(e, _tf().errors.NotFoundError):
                # Training is over: a lock left behind only delays the next
                # run until this process is seen dead.
                warnings.warn(f"{self.what}: could not remove {self.path} "
                              f"({type(e).__name__}: {e}).", stacklevel=2)

    # --- internals ----------------------------------------------------------

    def _check_dead(self, owner: Optional[dict]) -> None:
        """Returns if `owner` may be replaced (warning if it was another
        run's); raises `BackupDirInUse` if it lives."""
        if owner is None:
            warnings.warn(
                f"{self.what}: {self.path} was unreadable (e.g. a write torn "
                f"by a crash); taking over backup_dir {self.directory}.",
                stacklevel=3)
            return
        mine = _identity()
        age = time.time() - owner["heartbeat"]
        same_machine = (owner["host"] == mine["host"]
                        and owner["boot_id"] == mine["boot_id"])
        if same_machine and all(owner[k] == mine[k]
                                for k in ("pid", "process_start")):
            return  # this process: a fit that raised never released it
        if same_machine:
            dead = not _alive(owner["pid"], owner["process_start"])
            # Without a boot id a reboot goes unseen, and so would a pid
            # reused after it: trust a stale heartbeat too.
            dead = dead or (mine["boot_id"] is None and age >= STALE_SECONDS)
            why = "its process is gone"
        else:
            dead = age >= STALE_SECONDS
            why = f"no heartbeat for {age:.0f} s"
        if not dead:
            raise self._in_use(owner, "is in use by another run",
                               elsewhere=not same_machine)
        warnings.warn(
            f"{self.what}: taking over backup_dir {self.directory} from "
            f"{_describe(owner)}: that run died ({why}).", stacklevel=3)

    def _check_ours(self, token: str, lead: str, allow_lost=False) -> None:
        owner = self._read()
        if isinstance(owner, dict):
            if owner["token"] != token:
                raise self._in_use(owner, lead)
        elif allow_lost:
            # Deleted or mangled under us, and taken by nobody: ours again.
            warnings.warn(f"{self.what}: {self.path} was deleted or became "
                          "unreadable during training; rewriting it.",
                          stacklevel=3)
        else:
            raise BackupDirInUse(f"{self.what}: {self.path} changed while "
                                 "this run took it (another run starting?).")

    def _in_use(self, owner: dict, lead: str, elsewhere=False):
        age = max(0, time.time() - owner["heartbeat"])
        rule = (f" That run is on another machine (or ran before a reboot), "
                f"so it counts as alive until its heartbeat is "
                f"{STALE_SECONDS} s old." if elsewhere else "")
        return BackupDirInUse(
            f"{self.what}: backup_dir {self.directory} {lead}: "
            f"{_describe(owner)}, last seen {age:.0f} s ago.{rule} Two runs "
            "writing one backup_dir would interleave their generations. Use "
            "another backup_dir, or stop that run; if it is dead (e.g. on a "
            f"machine that is gone), delete {self.path}.")

    def _refuse_link(self) -> None:
        if self._local and os.path.islink(self.path):
            raise RuntimeError(
                f"{self.what}: {self.path} is a symbolic link. The owner lock "
                "is never written through a link (it could point anywhere): "
                "remove the link and run again.")

    def _create(self, record: dict) -> bool:
        """Writes `record` if there is no lock file; False if there is."""
        if not self._local:
            if _tf().io.gfile.exists(self.path):
                return False
            self._write(record)
            return True
        try:
            fd = os.open(self.path, _CREATE, 0o644)
        except FileExistsError:
            return False
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps(record).encode())
        except BaseException:
            os.remove(self.path)  # an empty lock would read as unreadable
            raise
        return True

    def _write(self, record: dict) -> None:
        # Written whole, then renamed over the lock: no reader sees half of
        # it. ".tmp-" leftovers of a crash are swept by BackupAndRestore.
        tmp = f"{self.directory}/.tmp-lock-{uuid.uuid4().hex}"
        data = json.dumps(record).encode()
        try:
            if self._local:
                with os.fdopen(os.open(tmp, _CREATE, 0o644), "wb") as f:
                    f.write(data)
                os.replace(tmp, self.path)  # replaces a link, not its target
            else:
                gfile = _tf().io.gfile
                with gfile.GFile(tmp, "wb") as f:
                    f.write(data)
                # Not an overwrite in place: ram:// appends to what is there.
                gfile.rename(tmp, self.path, overwrite=True)
        except BaseException:
            with contextlib.suppress(Exception):
                self._remove(tmp)
            raise

    def _remove(self, path: str) -> None:
        if self._local:
            os.remove(path)
        else:
            _tf().io.gfile.remove(path)

    def _read(self):
        """The lock's record; None if unreadable; `_MISSING` if absent."""
        try:
            if self._local:
                try:
                    fd = os.open(self.path, os.O_RDONLY | _NOFOLLOW)
                except OSError as e:
                    if e.errno == errno.ELOOP:
                        self._refuse_link()  # it became a link meanwhile
                    raise
                with os.fdopen(fd, "rb") as f:
                    data = f.read()
            else:
                tf = _tf()
                try:
                    with tf.io.gfile.GFile(self.path, "rb") as f:
                        data = f.read()
                except tf.errors.NotFoundError:
                    return _MISSING
        except FileNotFoundError:
            return _MISSING
        try:
            record = json.loads(data)
        except ValueError:
            return None
        return record if _valid(record) else None


def _valid(record) -> bool:
    def of(key, *types):
        return isinstance(record.get(key, ...), types)

    # A pid of 0 or below would make os.kill probe process groups.
    return (isinstance(record, dict) and of("host", str) and of("token", str)
            and of("pid", int) and record["pid"] > 0
            and of("boot_id", str, type(None))
            and of("process_start", int, type(None))
            and all(of(k, int, float) and math.isfinite(record[k])
                    for k in ("started", "heartbeat")))


def _describe(owner: dict) -> str:
    try:
        started = time.strftime("%Y-%m-%d %H:%M:%S",
                                time.localtime(owner["started"]))
    except (OverflowError, OSError, ValueError):  # a nonsense time
        started = repr(owner["started"])
    return f"pid {owner['pid']} on host {owner['host']}, started {started}"


def _identity() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": pid,
            "process_start": _process_start(pid)}


def _boot_id() -> Optional[str]:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # not Linux
        return None


def _process_start(pid: int) -> Optional[int]:
    """Field 22 of /proc/<pid>/stat: start time, clock ticks since boot."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # not Linux, or no such process
        return None
    # Field 2, the command name, may hold spaces and parentheses.
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def _alive(pid: int, process_start: Optional[int]) -> bool:
    if os.name == "nt":
        return True  # os.kill would terminate it; the heartbeat decides
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    # The pid may now belong to another process (e.g. a restarted container
    # gives its new process the same pid): compare start times.
    current = _process_start(pid)
    return process_start is None or current is None or current == process_start


def _tf():
    import tensorflow as tf  # only for URLs: the module imports cheaply

    return tf
