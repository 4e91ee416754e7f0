"""Numbered generations of files in one directory, each committed by its
manifest: the storage under `BackupAndRestore`, which decides what the
files hold. Nothing here knows about Keras.

On disk, `directory/gen-00000007/` holds a generation's files and its
`MANIFEST.json` (each file's size and SHA-256, and the generation's
number). The manifest is the commit marker: a generation directory without
it is a leftover of a write that was cut short, never read and removed by
the next `remove_leftovers()` or `prune()`. A write puts the files into a
`.tmp-*` directory, renames them into `gen-N/`, then writes the manifest
under a temporary name and renames it into place: every file appears
complete or not at all (flushed and fsynced first on a local disk; on other
`tf.io.gfile` filesystems an object appears when its upload completes).
Pruning deletes a generation's manifest first, so a generation half deleted
is a leftover too. A read trusts nothing: the manifest is checked against
its schema, a file the caller needs must be listed, and every listed file is
read once and checked against its size and checksum; what is returned are
those checked bytes, and a file the manifest does not list is never read.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import re
import shutil
import stat
import uuid
from typing import Callable, Iterable, Mapping, Optional, Union

from keras_mgpu import _fs

MANIFEST = "MANIFEST.json"
GENERATION_PREFIX = "gen-"
TMP_PREFIX = ".tmp-"
# A manifest lists a handful of files: anything near this size is not one.
_MANIFEST_LIMIT = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


class CorruptGeneration(Exception):
    """A committed generation that cannot be used; the message says why."""


class WriteFailed(Exception):
    """A generation could not be written; nothing of it was committed.

    Attributes: `number` (the generation), `path` (where it was being
    written), `previous` (the newest committed generation, or None), and
    `cause` (the `OSError` or `tf.errors.OpError`).
    """

    def __init__(self, number: int, path: str, previous: Optional[int],
                 cause: BaseException):
        super().__init__(f"could not write generation {number} to {path} "
                         f"({type(cause).__name__}: {cause})")
        self.number, self.path = number, path
        self.previous, self.cause = previous, cause


class PruneFailed(Exception):
    """Generation `number` was committed, but an older one could not be
    removed (`cause`)."""

    def __init__(self, number: int, cause: BaseException):
        super().__init__(f"generation {number} was committed, but older "
                         f"generations could not be removed "
                         f"({type(cause).__name__}: {cause})")
        self.number, self.cause = number, cause


@dataclasses.dataclass
class Found:
    """What `GenerationStore.latest_usable` found.

    `number`: the newest usable generation (None if there is none);
    `files`: its verified contents, name to bytes; `value`: what the
    caller's `validate` returned for them; `unusable`: `(number, reason)`
    of each newer generation that was not usable, newest first.
    """

    number: Optional[int]
    files: Optional[dict]
    value: object
    unusable: list


class GenerationStore:
    """The committed generations in `directory`; at most `keep` after each
    write. One process writes at a time (the caller's lock sees to that);
    any number may read."""

    def __init__(self, directory: str, keep: int = 1):
        self.directory = directory
        self.keep = keep

    # --- reading -------------------------------------------------------------

    def generations(self) -> list:
        """Committed generation numbers (their manifest is in place),
        newest first."""
        return sorted((n for n, name in self._numbered()
                       if self._committed(name)), reverse=True)

    def path(self, number: int) -> str:
        """The directory of generation `number`."""
        return _fs.join(self.directory, f"{GENERATION_PREFIX}{number:08d}")

    def read(self, number: int, required: Iterable[str] = (),
             only: Optional[Iterable[str]] = None) -> dict:
        """The files of generation `number`, name to bytes, each verified
        (`only`: just those of them).

        Raises `CorruptGeneration` if the manifest is missing, is not what a
        manifest holds, or does not list a name in `required`, or if a
        listed file read is missing or differs from its size or checksum.
        """
        path = self.path(number)
        listed = _parse_manifest(
            _read_checked(_fs.join(path, MANIFEST), MANIFEST, None), number)
        missing = sorted(set(required) - set(listed))
        if missing:
            raise CorruptGeneration(
                f"its manifest does not list {', '.join(missing)}")
        contents = {}
        for name, (size, digest) in listed.items():
            if only is not None and name not in only:
                continue
            data = _read_checked(_fs.join(path, name), name, size)
            if hashlib.sha256(data).hexdigest() != digest:
                raise CorruptGeneration(f"{name} fails its checksum")
            contents[name] = data
        return contents

    def latest_usable(
        self,
        required: Iterable[str] = (),
        validate: Optional[Callable[[dict], object]] = None,
    ) -> Found:
        """The newest generation whose files verify (`read`) and pass
        `validate(files)`, which returns what it parsed or raises
        `CorruptGeneration`; the unusable newer ones are listed with why."""
        required = set(required)
        unusable = []
        for number in self.generations():
            try:
                files = self.read(number, required)
                value = None if validate is None else validate(files)
            except CorruptGeneration as e:
                unusable.append((number, str(e)))
                continue
            return Found(number, files, value, unusable)
        return Found(None, None, None, unusable)

    # --- writing -------------------------------------------------------------

    def check_writable(self) -> None:
        """Creates `directory` if needed and writes a probe file there;
        raises `OSError` or `tf.errors.OpError` if it cannot."""
        probe = _fs.join(self.directory,
                         f"{TMP_PREFIX}probe-{uuid.uuid4().hex}")
        _fs.makedirs(self.directory)
        _fs.write_file(probe, b"")
        _fs.remove_file(probe)

    def write(self, files: Mapping[str, Union[bytes, memoryview]]) -> int:
        """Writes `files` (name to bytes, or a memoryview of them) as the
        next generation, commits it, then prunes to the newest `keep`;
        returns its number.

        Raises `WriteFailed` (nothing committed, older generations
        untouched) or `PruneFailed` (committed; an older one is left).
        """
        previous = self.generations()
        number = self._next_number()
        tmp = _fs.join(self.directory,
                       f"{TMP_PREFIX}{number}-{uuid.uuid4().hex}")
        final = self.path(number)
        manifest = {"generation": number, "files": {
            name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            for name, data in files.items()
        }}
        try:
            _fs.makedirs(self.directory)
            if not _fs.is_url(self.directory):
                # A clear error before anything is written, rather than a
                # half-written file.
                _check_room(self.directory,
                            sum(len(data) for data in files.values()))
            _fs.makedirs(tmp)
            for name, data in files.items():
                _fs.write_file(_fs.join(tmp, name), data)
            self._commit(tmp, final, manifest)
        except _fs.ERRORS as e:
            _fs.remove_tree_quietly(tmp)
            _discard_quietly(final)
            raise WriteFailed(number, tmp, previous[0] if previous else None,
                              e) from e
        try:
            self.prune()
        except _fs.ERRORS as e:
            raise PruneFailed(number, e) from e
        return number

    def _commit(self, tmp: str, final: str, manifest: dict) -> None:
        # Files, not the directory, are renamed: some TensorFlow filesystems
        # (ram://, object stores) do not rename directories.
        _fs.makedirs(final)
        _fs.sync_dir(self.directory)
        for name in manifest["files"]:
            _fs.rename(_fs.join(tmp, name), _fs.join(final, name))
        _fs.sync_dir(final)
        self._mark(final, manifest)
        _fs.remove_tree(tmp)

    def _mark(self, final: str, manifest: dict) -> None:
        """Commits the generation in `final`: its manifest, atomically."""
        _fs.write_atomically(_fs.join(final, MANIFEST),
                             json.dumps(manifest).encode())

    # --- removing ------------------------------------------------------------

    def prune(self) -> None:
        """Removes committed generations past the newest `keep`, and every
        uncommitted generation directory (a write cut short). Only the
        writing process may call it: a write in flight is uncommitted."""
        keep = set(self.generations()[: self.keep])
        for number, name in self._numbered():
            if number not in keep:
                self._retire(name)

    def remove_leftovers(self) -> None:
        """Removes what writes cut short left: `.tmp-*` entries and
        generation directories without a manifest. Only the writing process
        may call it, with no write in flight."""
        for name in _fs.listdir(self.directory):
            if name.startswith(TMP_PREFIX):
                _fs.remove_tree(_fs.join(self.directory, name))
        for _, name in self._numbered():
            if not self._committed(name):
                self._retire(name)

    def remove(self, number: int) -> None:
        """Removes generation `number` (its manifest first). Only the
        writing process may call it."""
        self._retire(f"{GENERATION_PREFIX}{number:08d}")

    def delete(self) -> None:
        """Removes every generation and leftover, oldest first, then
        `directory` itself if that left it empty (and it is no link)."""
        for _, name in sorted(self._numbered()):
            self._retire(name)
        for name in _fs.listdir(self.directory):
            if name.startswith(TMP_PREFIX):
                _fs.remove_tree(_fs.join(self.directory, name))
        if (_fs.exists(self.directory)
                and not _fs.is_link(self.directory)
                and not _fs.listdir(self.directory)):
            _fs.remove_tree(self.directory)

    def _retire(self, name: str) -> None:
        path = _fs.join(self.directory, name)
        if _fs.is_link(path):
            _fs.remove_tree(path)  # the link, never what it points to
            return
        # The manifest first: a generation half removed is uncommitted.
        marker = _fs.join(path, MANIFEST)
        if _fs.exists(marker):
            _fs.remove_file(marker)
        _fs.remove_tree(path)

    # --- names ---------------------------------------------------------------

    def _numbered(self) -> list:
        """(number, entry name) of each `gen-*` entry, committed or not."""
        found = []
        for name in _fs.listdir(self.directory):
            suffix = name[len(GENERATION_PREFIX):]
            if name.startswith(GENERATION_PREFIX) and suffix.isdigit():
                found.append((int(suffix), name))
        return found

    def _committed(self, name: str) -> bool:
        return _fs.exists(_fs.join(self.directory, name, MANIFEST))

    def _next_number(self) -> int:
        # Past uncommitted directories too: a write never reuses one.
        return max((n for n, _ in self._numbered()), default=0) + 1


def _parse_manifest(data: bytes, number: int) -> dict:
    """name -> (size, sha256) of a manifest's bytes, checked against the
    schema `{"generation": number, "files": {name: {"size": int >= 0,
    "sha256": 64 hex digits}}}`."""
    try:
        manifest = json.loads(data)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise CorruptGeneration(f"{MANIFEST} is not JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise CorruptGeneration(f"{MANIFEST} holds {_kind(manifest)}, not an "
                                "object")
    if manifest.get("generation") != number or not _is_count(
            manifest.get("generation")):
        raise CorruptGeneration(
            f"{MANIFEST} names generation {manifest.get('generation')!r}, "
            f"not {number}")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CorruptGeneration(f"{MANIFEST}'s files are {_kind(files)}, not "
                                "an object")
    listed = {}
    for name, entry in files.items():
        if (not name or name in (".", "..", MANIFEST) or "/" in name
                or "\\" in name):
            raise CorruptGeneration(f"{MANIFEST} lists a file named {name!r}")
        size = entry.get("size") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if not (_is_count(size) and isinstance(digest, str)
                and _SHA256.fullmatch(digest)):
            raise CorruptGeneration(
                f"{MANIFEST}'s entry for {name} is {entry!r}, not "
                '{"size": bytes, "sha256": 64 hex digits}')
        listed[name] = (size, digest)
    return listed


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _kind(value) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def _read_checked(path: str, name: str, size: Optional[int]) -> bytes:
    """The bytes of the file `name` at `path`, if it is a regular file of
    `size` bytes (of at most `_MANIFEST_LIMIT` for `size=None`)."""
    limit = _MANIFEST_LIMIT if size is None else size

    def check(mode):
        if not stat.S_ISREG(mode):
            # A FIFO would block the read; a directory has no bytes.
            raise CorruptGeneration(f"{name} is not a regular file")

    try:
        found = _fs.size(path, check)
        if found > limit or (size is not None and found != size):
            raise CorruptGeneration(
                f"{name} has {found} bytes, "
                + ("more than a manifest holds" if size is None
                   else f"the manifest says {size}"))
        data = _fs.read_bytes(path, limit + 1, check)
    except _fs.NOT_FOUND:
        raise CorruptGeneration(f"{name} is missing") from None
    except _fs.ERRORS as e:
        raise CorruptGeneration(
            f"{name} cannot be read ({type(e).__name__}: {e})") from None
    if len(data) != found:  # changed while it was read
        raise CorruptGeneration(f"{name} changed while it was read")
    return data


def _check_room(directory: str, needed: int) -> None:
    """Raises OSError (ENOSPC or EFBIG) if a generation of `needed` bytes
    cannot be written to `directory`."""
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise OSError(errno.ENOSPC, f"{free} bytes free, a generation needs "
                      f"about {needed}")
    try:
        import resource
    except ImportError:  # not on this platform
        return
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and limit < needed:
        raise OSError(errno.EFBIG, f"File too large: this process may not "
                      f"write files over {limit} bytes (ulimit -f), a "
                      f"generation needs about {needed}")


def _discard_quietly(final: str) -> None:
    """Removes an uncommitted generation directory a failed write made."""
    try:
        if _fs.exists(final):
            marker = _fs.join(final, MANIFEST)
            if _fs.exists(marker):
                _fs.remove_file(marker)
            _fs.remove_tree(final)
    except _fs.ERRORS:
        pass
