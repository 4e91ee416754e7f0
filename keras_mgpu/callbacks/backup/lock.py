"""The owner lock of a `backup_dir`: one live run writes there at a time."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import socket
import stat
import time
import uuid
import warnings
from typing import Callable, Optional

# Another machine's process cannot be asked whether it lives: it counts as
# alive while its heartbeat is younger than this.
STALE_SECONDS = 600
# At most one lock write per this many seconds, however often `refresh` runs.
HEARTBEAT_SECONDS = 30
LOCK_NAME = "LOCK.json"

_MISSING = object()
# The tokens of the locks this process's live `OwnerLock`s hold, each with
# whether its holder still runs (a fit on another thread): a lock of this
# process is taken again only where its holder is done (a fit that raised).
_HELD: dict = {}
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CREATE = os.O_CREAT | os.O_EXCL | os.O_WRONLY | _NOFOLLOW
# os.link's errors on a file system without hard links.
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS,
                  errno.EMLINK}
# Tries before giving up on a lock that other runs keep changing.
_ATTEMPTS = 10


class BackupDirInUse(RuntimeError):
    """Another live run owns the `backup_dir`."""


class _NotARegularFile(RuntimeError):
    """The lock's name is taken by a link, a directory, a FIFO, ..."""


class OwnerLock:
    """The owner lock of one backup_dir: which live process writes there.

    `<directory>/LOCK.json` names its owner (host, boot id, pid and process
    start time, a token unique to each `acquire`, and a heartbeat). A lock
    held by this process is taken again silently, unless its holder runs
    on (`running`, e.g. a `fit` on another thread). An owner on this machine
    is dead when its pid is gone or now belongs to a process that started at
    another time; an owner elsewhere is dead when its heartbeat is
    `STALE_SECONDS` old. A dead owner's, or an unreadable, lock is taken
    over with a warning; a live owner's makes `acquire` raise
    `BackupDirInUse`. On a local (or mounted) file system the lock is
    created, and a dead owner's taken over, atomically: of several runs
    starting at once, exactly one gets it and the others raise
    `BackupDirInUse`. `tf.io.gfile` URLs work too, without that guarantee
    (they have no exclusive create): a run that loses such a race learns it
    at its next heartbeat. TensorFlow is imported only for URLs. A lock path
    that is a symbolic link, a directory, a FIFO or anything else but a
    regular file is refused, naming it, and never opened in a way that
    could block.

    Args:
        directory: The directory to own (a local path or a `tf.io.gfile`
            URL, as a `str` or `os.PathLike`).
        what: Defaults to `"BackupAndRestore"`. Who holds the lock, for the
            messages.
        running: Defaults to `None`. Whether the holder still runs, asked
            when another `acquire` of this process finds the lock: `None`
            (or a False answer) lets that one take it over.

    Example:

    >>> import tempfile
    >>> lock = OwnerLock(tempfile.mkdtemp())
    >>> lock.acquire()
    >>> lock.refresh()
    >>> lock.release()
    """

    def __init__(self, directory: str, *, what: str = "BackupAndRestore",
                 running: Optional[Callable[[], bool]] = None):
        if not isinstance(directory, (str, os.PathLike)) or not isinstance(
                os.fspath(directory), str):
            raise TypeError(
                f"{what}: the directory to lock must be a path (a str or "
                f"os.PathLike), got {directory!r}. Pass the backup_dir.")
        if not os.fspath(directory):
            raise ValueError(
                f"{what}: the directory to lock must be a non-empty path, got "
                "''. Use '.' for the current directory.")
        self.directory = os.fspath(directory).rstrip("/")
        self.path = f"{self.directory}/{LOCK_NAME}"
        self.what = what
        # Not keras_mgpu._fs.is_url: this module imports only the standard
        # library (a lock holder need not load TensorFlow); `_fs` does URLs.
        self._local = "://" not in self.directory
        self._record: Optional[dict] = None
        self._running = running
        self._last_refresh = 0.0  # time.monotonic() of the last lock write

    def acquire(self) -> None:
        """Takes the lock, or raises `BackupDirInUse` naming its live owner.

        Raises:
            BackupDirInUse: A live run owns the lock, or is taking it over
                from a dead one at this moment.
            RuntimeError: The lock path is not a regular file (a symbolic
                link, a directory, a FIFO, ...).
        """
        self._refuse_odd(self.path)
        if self._local:
            os.makedirs(self.directory, exist_ok=True)
        else:
            _fs().makedirs(self.directory)
        now = time.time()
        record = {**_identity(), "token": uuid.uuid4().hex, "started": now,
                  "heartbeat": now}
        data = _encode(record)
        # Before the lock exists: another thread that finds it knows it
        # held.
        _HELD[record["token"]] = self._running or (lambda: False)
        try:
            self._take(record, data)
        except BaseException:
            _HELD.pop(record["token"], None)
            raise

    def _take(self, record: dict, data: bytes) -> None:
        for _ in range(_ATTEMPTS):
            if self._create(self.path, data):
                break
            seen = self._read_raw(self.path)
            if seen is _MISSING:
                continue  # released since we looked: create it again
            # Raises if its owner lives.
            note = self._judge(_parse(seen), self.path)
            if self._take_over(self.path, seen, data):
                if note:
                    warnings.warn(note, stacklevel=3)
                break
            # It changed since we read it (another run took it): look again.
        else:
            raise self._kept_changing(self.path)
        # The local protocol has one winner; this read-back finds most races
        # on URLs (and on file systems without hard links).
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
        self._refuse_odd(self.path)
        token = self._record["token"]
        found = self._check_ours(token, "was taken over by another run",
                                 allow_lost=True)
        record = {**self._record, "heartbeat": time.time()}
        if found is _MISSING:
            # Deleted under us: created only where still nothing is, so a
            # run that has taken the free lock meanwhile keeps it.
            self._create(self.path, _encode(record))
        else:
            self._write(self.path, _encode(record))
        self._check_ours(token, "was taken over by another run")
        self._record = record
        self._last_refresh = time.monotonic()

    def release(self) -> None:
        """Removes the lock file if it is still ours; never raises if gone."""
        record, self._record = self._record, None
        if record is None:
            return
        _HELD.pop(record["token"], None)
        errors = (OSError,) if self._local else _fs().ERRORS
        try:
            # Only a run that thinks this one dead replaces the lock: the
            # moment between this read and the removal does not matter.
            owner = _parse(self._read_raw(self.path))
            if isinstance(owner, dict) and owner["token"] == record["token"]:
                self._remove(self.path)
        except (FileNotFoundError, _NotARegularFile):
            pass  # gone, or something else took its name: not ours
        except errors as e:
            if self._local or not isinstance(e, _fs().NOT_FOUND):
                # Training is over: a lock left behind only delays the next
                # run until this process is seen dead.
                warnings.warn(f"{self.what}: could not remove {self.path} "
                              f"({type(e).__name__}: {e}).", stacklevel=2)

    # --- internals ----------------------------------------------------------

    def _take_over(self, path: str, seen: bytes, data: bytes,
                   depth: int = 0) -> bool:
        """Replaces `path`, read as `seen` (a dead owner's record or an
        unreadable one), by `data`; False if `path` changed meanwhile.

        Locally this is atomic through a claim: the file
        `.tmp-lock-claim-<hash of path's name and seen>`, created whole and
        only where nothing is (`_create`). Only the run holding the claim
        may replace `path`, and only after reading it as `seen` again. Why
        no two runs can both replace one dead record `seen`:

        - Of several runs that read `seen`, one creates the claim; the
          others find it, with a live owner, and raise `BackupDirInUse`. A
          run that finds no claim because the winner has already finished
          creates it, but then reads the winner's record in `path`, not
          `seen`: it returns False, and `acquire` reads the live winner.
        - Between the claim holder's second read of `seen` and its rename,
          nothing else changes `path`: a new lock is only created where none
          is (`path` is there); records are unique (token and heartbeat), so
          `seen` is only ever in `path` once and no other claim holder read
          it there after us; `seen`'s owner is dead, so it neither refreshes
          nor releases; and our claim is only replaced if we are dead.
        - Nothing is ever moved out of the way and put back, so no moment
          exists in which `path` is missing and a run starting afresh could
          create it under a live owner.
        - A run that dies holding the claim leaves it behind; the claim is
          then itself a dead record, replaced by the same procedure one level
          down (a claim on the claim). If the dead run had already replaced
          `path`, the second read finds its record, not `seen`, and that
          record is judged again. Claims are removed by their holder, and
          `BackupAndRestore` sweeps `.tmp-*` leftovers while it owns the
          lock (a claim on a record that is gone then can only lose).

        URLs have no exclusive create: there, compare and overwrite, and
        `acquire`'s read-back finds most races.
        """
        if not self._local:
            if self._read_raw(path) != seen:
                return False
            self._write(path, data)
            return True
        claim = (f"{self.directory}/.tmp-lock-claim-" + hashlib.sha256(
            os.path.basename(path).encode() + b"\0" + seen).hexdigest()[:32])
        for _ in range(_ATTEMPTS):
            if self._create(claim, data):
                break
            held = self._read_raw(claim)
            if held is _MISSING:
                continue  # its holder is done: `path` has changed
            # Raises if that run lives: it is taking the lock over now.
            self._judge(_parse(held), claim,
                        "is being taken over by another run")
            if depth >= _ATTEMPTS:
                raise self._kept_changing(claim)
            # It died holding the claim: take the claim over the same way.
            if self._take_over(claim, held, data, depth + 1):
                break
        else:
            raise self._kept_changing(claim)
        try:
            if self._read_raw(path) != seen:
                return False
            self._write(path, data)
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(claim)

    def _judge(self, owner: Optional[dict], path: str,
               lead: str = "is in use by another run") -> Optional[str]:
        """The warning for replacing `owner`, read from `path` (None if it
        is this process's own); raises `BackupDirInUse` if it lives."""
        if owner is None:
            return (f"{self.what}: {path} was unreadable (e.g. a write torn "
                    f"by a crash); taking over backup_dir {self.directory}.")
        mine = _identity()
        age = time.time() - owner["heartbeat"]
        same_machine = (owner["host"] == mine["host"]
                        and owner["boot_id"] == mine["boot_id"])
        if same_machine and all(owner[k] == mine[k]
                                for k in ("pid", "process_start")):
            if _HELD.get(owner["token"], lambda: False)():
                raise self._in_use(owner, f"{lead} of this process", path)
            return None  # this process: a fit that raised never released it
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
            raise self._in_use(owner, lead, path, elsewhere=not same_machine)
        return (f"{self.what}: taking over backup_dir {self.directory} from "
                f"{_describe(owner)}: that run died ({why}).")

    def _check_ours(self, token: str, lead: str, allow_lost=False):
        """The lock's record, if it is ours; raises `BackupDirInUse` if
        another run's (or, unless `allow_lost`, if missing or unreadable)."""
        owner = _parse(self._read_raw(self.path))
        if isinstance(owner, dict):
            if owner["token"] != token:
                raise self._in_use(owner, lead, self.path)
        elif allow_lost:
            # Deleted or mangled under us, and taken by nobody: ours again.
            warnings.warn(f"{self.what}: {self.path} was deleted or became "
                          "unreadable during training; rewriting it.",
                          stacklevel=3)
        else:
            raise BackupDirInUse(f"{self.what}: {self.path} changed while "
                                 "this run took it (another run starting?).")
        return owner

    def _in_use(self, owner: dict, lead: str, path: str, elsewhere=False):
        age = max(0, time.time() - owner["heartbeat"])
        rule = (f" That run is on another machine (or ran before a reboot), "
                f"so it counts as alive until its heartbeat is "
                f"{STALE_SECONDS} s old." if elsewhere else "")
        return BackupDirInUse(
            f"{self.what}: backup_dir {self.directory} {lead}: "
            f"{_describe(owner)}, last seen {age:.0f} s ago.{rule} Two runs "
            "writing one backup_dir would interleave their generations. Use "
            "another backup_dir, or stop that run; if it is dead (e.g. on a "
            f"machine that is gone), delete {path}.")

    def _kept_changing(self, path: str) -> BackupDirInUse:
        return BackupDirInUse(
            f"{self.what}: {path} kept changing while this run tried to take "
            f"the owner lock of backup_dir {self.directory} ({_ATTEMPTS} "
            "tries): other runs are starting there. Use another backup_dir, "
            "or run again.")

    def _refuse_odd(self, path: str, mode: Optional[int] = None) -> None:
        """Raises unless `path` is missing or a regular file (`mode`: its
        `st_mode`, if known). Only looks at it (`lstat`): opening a FIFO
        blocks, and opening a device may act on it."""
        if not self._local:
            return
        if mode is None:
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                return
        if stat.S_ISREG(mode):
            return
        if stat.S_ISLNK(mode):
            raise _NotARegularFile(
                f"{self.what}: {path} is a symbolic link. The owner lock "
                "is never written through a link (it could point anywhere): "
                "remove the link and run again.")
        raise _NotARegularFile(
            f"{self.what}: {path} is {_kind(mode)}, not a regular file. It "
            f"is the name of the owner lock of backup_dir {self.directory}, "
            "a small JSON file this library writes: remove what is there "
            "(or use another backup_dir) and run again.")

    def _create(self, path: str, data: bytes) -> bool:
        """Writes `data` to `path` if nothing (not even a link or a
        directory) is there; False if something is."""
        if not self._local:
            if _fs().exists(path):
                return False
            self._write(path, data)
            return True
        tmp = self._tmp_file(data)
        try:
            # A hard link appears whole, and only where nothing is: an
            # exclusive create without the moment in which the new file is
            # empty, which another run would take for a torn, dead lock.
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except FileNotFoundError:
            if os.path.isdir(self.directory):
                # Our temporary file was swept by a live owner's cleanup:
                # the caller looks again, and finds that owner.
                return False
            raise
        except OSError as e:
            if e.errno not in _NO_HARD_LINKS:
                raise
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        # A file system without hard links (e.g. FAT, some FUSE mounts):
        # create, then write; a reader may see it empty for a moment.
        try:
            fd = os.open(path, _CREATE, 0o644)
        except FileExistsError:
            return False
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except BaseException:
            os.remove(path)  # an empty lock would read as unreadable
            raise
        return True

    def _tmp_file(self, data: bytes) -> str:
        tmp = self._tmp_name()
        try:
            with os.fdopen(os.open(tmp, _CREATE, 0o644), "wb") as f:
                f.write(data)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        return tmp

    def _tmp_name(self) -> str:
        # ".tmp-" leftovers of a crash are swept by BackupAndRestore.
        return f"{self.directory}/.tmp-lock-{uuid.uuid4().hex}"

    def _write(self, path: str, data: bytes) -> None:
        """Replaces `path` by `data`: written whole, then renamed over it,
        so no reader sees half of it."""
        if not self._local:
            _fs().write_atomically(path, data, tmp=self._tmp_name())
            return
        tmp = self._tmp_file(data)
        try:
            os.replace(tmp, path)  # replaces a link, not its target
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise

    def _remove(self, path: str) -> None:
        if self._local:
            os.remove(path)
        else:
            _fs().remove_file(path)

    def _read_raw(self, path: str):
        """The bytes of `path`, or `_MISSING`; refuses anything but a
        regular file without blocking on it."""
        if not self._local:
            try:
                return _fs().read_bytes(path)
            except _fs().NOT_FOUND:
                return _MISSING
        try:
            self._refuse_odd(path)
            try:
                # O_NONBLOCK: what `lstat` saw may have been replaced by a
                # FIFO since, whose plain open would wait for a writer.
                fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    self._refuse_odd(path)  # it became a link meanwhile
                raise
            with os.fdopen(fd, "rb") as f:
                self._refuse_odd(path, os.fstat(fd).st_mode)
                return f.read()
        except FileNotFoundError:
            return _MISSING

    def _read(self):
        """The lock's record; None if unreadable; `_MISSING` if absent."""
        return _parse(self._read_raw(self.path))


def _encode(record: dict) -> bytes:
    return json.dumps(record).encode()


def _parse(raw):
    """The record in `raw`; None if unreadable; `_MISSING` stays."""
    if raw is _MISSING:
        return _MISSING
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if _valid(record) else None


def _kind(mode: int) -> str:
    # Not keras_mgpu._checks.file_kind: this module imports only the
    # standard library.
    for test, kind in ((stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return f"a special file (mode {mode:o})"


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


def _fs():
    # Only for URLs: the module imports without TensorFlow.
    from keras_mgpu import _fs

    return _fs
