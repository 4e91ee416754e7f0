"""Files at a local path or at a `tf.io.gfile` URL (`gs://`, `ram://`): the
one place that tells them apart.

A local path goes through `os` where that matters: files are flushed and
fsynced, and so is the directory a file is renamed into; a link is deleted,
never what it points to; a file that is not a regular file (a FIFO, a
device) can be refused before it is read, and a read never blocks on one. A
URL goes through `tf.io.gfile` (no links, no fsync: an object appears when
its upload completes). Errors are those of the layer used: `OSError` or
`tf.errors.OpError` (`ERRORS` names both, `NOT_FOUND` their "missing").

Paths are joined with "/" (`join`), on every platform.

Example:

>>> import os, tempfile
>>> d = tempfile.mkdtemp()
>>> write_atomically(join(d, "a.json"), b"{}")
>>> read_bytes(join(d, "a.json"))
b'{}'
>>> listdir(d), is_url(d), is_url("ram://bucket/run")
(['a.json'], False, True)
>>> remove_tree(d)
>>> os.path.exists(d)
False
"""

from __future__ import annotations

import errno
import os
import uuid
from typing import Callable, Optional

import tensorflow as tf

# What a file operation raises, local or through tf.io.gfile.
ERRORS = (OSError, tf.errors.OpError)
NOT_FOUND = (FileNotFoundError, tf.errors.NotFoundError)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def is_url(path: str) -> bool:
    """Whether `path` names a `tf.io.gfile` file system (`gs://`, `ram://`)
    rather than a local path."""
    return "://" in path


def join(*parts: str) -> str:
    """`parts` joined with "/", each part's trailing slashes dropped."""
    return "/".join(p.rstrip("/") for p in parts)


def exists(path: str) -> bool:
    """Whether anything is at `path`."""
    return tf.io.gfile.exists(path)


def isdir(path: str) -> bool:
    """Whether `path` is a directory."""
    return tf.io.gfile.isdir(path)


def makedirs(path: str) -> None:
    """Creates the directory `path` and its parents, if missing."""
    tf.io.gfile.makedirs(path)


def glob(pattern: str) -> list:
    """The paths matching `pattern`, in no particular order."""
    return tf.io.gfile.glob(pattern)


def listdir(directory: str) -> list:
    """The names in `directory` (without a trailing "/"); [] if it is
    missing."""
    if not tf.io.gfile.exists(directory):
        return []
    return [name.rstrip("/") for name in tf.io.gfile.listdir(directory)]


def is_link(path: str) -> bool:
    """Whether `path` is a symbolic link (a URL never is)."""
    return not is_url(path) and os.path.islink(path)


def size(path: str, check: Optional[Callable[[int], None]] = None) -> int:
    """The size of the file at `path` in bytes. For a local path, `check`
    is called with its `st_mode` first (to raise if it is no regular
    file)."""
    if is_url(path):
        return tf.io.gfile.stat(path).length
    info = os.stat(path)
    if check is not None:
        check(info.st_mode)
    return info.st_size


def read_bytes(path: str, limit: Optional[int] = None,
               check: Optional[Callable[[int], None]] = None) -> bytes:
    """The bytes of `path` (at most `limit` of them). A local file is opened
    without blocking (a FIFO would wait for a writer), and `check` is called
    with its `st_mode` before and after the open (it may have been replaced
    meanwhile)."""
    n = -1 if limit is None else limit
    if is_url(path):
        with tf.io.gfile.GFile(path, "rb") as f:
            return f.read(n)
    if check is not None:
        check(os.stat(path).st_mode)
    with os.fdopen(os.open(path, os.O_RDONLY | _NONBLOCK), "rb") as f:
        if check is not None:
            check(os.fstat(f.fileno()).st_mode)
        return f.read(n)


def write_file(path: str, data, sync: bool = True) -> None:
    """Writes `data` (bytes, or a memoryview of them) to `path`; a local
    file is flushed to the disk unless `sync=False` (not atomic: see
    `write_atomically`)."""
    if is_url(path):
        with tf.io.gfile.GFile(path, "wb") as f:
            f.write(bytes(data))  # GFile takes bytes only
        return
    # A memoryview goes to disk as it is: no copy of a large weights file.
    with open(path, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())


def write_atomically(path: str, data: bytes,
                     tmp: Optional[str] = None) -> None:
    """Writes `path` so that it is complete or absent: to `tmp` (default: a
    new hidden name beside it), then renamed over it; `tmp` is removed if
    that fails."""
    directory, name = path.rsplit("/", 1)
    if tmp is None:
        tmp = join(directory, f".{name}.tmp-{uuid.uuid4().hex}")
    try:
        write_file(tmp, data)
        # Not a write in place: "wb" need not truncate (ram:// appends).
        rename(tmp, path)
    except BaseException:
        remove_file_quietly(tmp)
        raise
    sync_dir(directory)


def rename(source: str, target: str) -> None:
    """Renames the file `source` to `target`, replacing what is there (a
    link there is replaced, not its target)."""
    if is_url(source):
        tf.io.gfile.rename(source, target, overwrite=True)
    else:
        os.replace(source, target)


def sync_dir(directory: str) -> None:
    """Makes the entries of a local `directory` (renames into it) durable."""
    if is_url(directory) or not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:
        # Some filesystems cannot sync a directory: nothing more to do.
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def remove_file(path: str) -> None:
    """Deletes the file (or link) `path`."""
    tf.io.gfile.remove(path)


def remove_file_quietly(path: str) -> None:
    """Deletes the file `path` if it is there, ignoring errors (cleaning up
    after a failure, which may fail the same way)."""
    try:
        if tf.io.gfile.exists(path):
            tf.io.gfile.remove(path)
    except ERRORS:
        pass


def remove_tree(path: str) -> None:
    """Deletes `path` and everything under it; a link itself, never what it
    points to (a recursive delete through a link empties its target)."""
    if is_link(path):
        os.remove(path)
    else:
        tf.io.gfile.rmtree(path)


def remove_tree_quietly(path: str) -> None:
    """`remove_tree(path)` if it is there, ignoring errors."""
    try:
        if tf.io.gfile.exists(path):
            remove_tree(path)
    except ERRORS:
        pass


def open_append(path: str):
    """`path` opened to append text lines, after a newline if a killed
    writer left a torn last line (so only that line is unreadable)."""
    if not is_url(path):
        f = open(path, "a+b")
        if f.tell():
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.close()
        return open(path, "a")
    if not tf.io.gfile.exists(path):
        # Some file systems append only to a file that exists.
        f = tf.io.gfile.GFile(path, "w")
        f.write("")
        return f
    torn = _ends_torn(path)
    f = tf.io.gfile.GFile(path, "a")
    try:
        # GFile opens on its first write: this one raises where the file
        # system cannot append.
        f.write("\n" if torn else "")
    except tf.errors.UnimplementedError:
        return _rewrite_to_append(path, torn)
    f.flush()
    return f


def _ends_torn(path: str) -> bool:
    """Whether the file at a URL ends in a torn line."""
    length = tf.io.gfile.stat(path).length
    if not length:
        return False
    with tf.io.gfile.GFile(path, "rb") as f:
        f.seek(length - 1)
        return f.read(1) != b"\n"


def _rewrite_to_append(path: str, torn: bool):
    """The file at a URL whose file system cannot append: its lines
    rewritten, a torn last one closed off, and open to write more."""
    with tf.io.gfile.GFile(path, "rb") as f:
        content = f.read()
    return replace_to_append(path, content + (b"\n" if torn else b""))


def replace_to_append(path: str, content: bytes):
    """The file at a URL replaced by `content`, and open to write more."""
    # Removed first: "w" need not truncate (ram:// does not, in TF 2.21).
    # A crash before the flush below loses the old lines.
    tf.io.gfile.remove(path)
    f = tf.io.gfile.GFile(path, "w")
    f.write(content)
    f.flush()
    return f
