"""Local paths and `tf.io.gfile` URLs behind one set of file functions."""

import errno
import os
import stat
import uuid

import pytest
import tensorflow as tf

from keras_mgpu import _fs

LINUX_FIFO = hasattr(os, "mkfifo")


@pytest.fixture(params=["local", "url"])
def where(request, tmp_path):
    """A fresh, existing directory: in tmp_path, or on ram://."""
    if request.param == "local":
        yield str(tmp_path / "d")
        return
    directory = f"ram://keras_mgpu_fs/{uuid.uuid4().hex}/d"
    tf.io.gfile.makedirs(directory)
    yield directory
    if tf.io.gfile.exists(directory):
        tf.io.gfile.rmtree(directory)


@pytest.fixture
def directory(where):
    _fs.makedirs(where)
    return where


def test_is_url():
    assert _fs.is_url("gs://bucket/run")
    assert _fs.is_url("ram://x")
    assert not _fs.is_url("/tmp/run")
    assert not _fs.is_url("relative/run:1")


def test_join_drops_trailing_slashes():
    assert _fs.join("gs://b/run/", "gen-1/", "a.bin") == (
        "gs://b/run/gen-1/a.bin")
    assert _fs.join("/tmp/x", "y") == "/tmp/x/y"


def test_write_and_read(directory):
    path = _fs.join(directory, "a.bin")
    _fs.write_file(path, memoryview(b"0123456789"))
    assert _fs.exists(path)
    assert _fs.size(path) == 10
    assert _fs.read_bytes(path) == b"0123456789"
    assert _fs.read_bytes(path, limit=4) == b"0123"


def test_write_file_without_sync(directory):
    path = _fs.join(directory, "a.json")
    _fs.write_file(path, b"{}", sync=False)
    assert _fs.read_bytes(path) == b"{}"


def test_write_atomically_replaces_the_whole_file(directory):
    path = _fs.join(directory, "MANIFEST.json")
    _fs.write_atomically(path, b"a much longer first version")
    _fs.write_atomically(path, b"short")
    # Not written in place: nothing of the longer version is left.
    assert _fs.read_bytes(path) == b"short"
    assert _fs.listdir(directory) == ["MANIFEST.json"]


def test_write_atomically_leaves_nothing_when_the_write_fails(
        directory, monkeypatch):
    path = _fs.join(directory, "MANIFEST.json")
    _fs.write_atomically(path, b"old")
    written = []
    original = _fs.write_file

    def half_then_fail(tmp, data):
        written.append(tmp)
        original(tmp, bytes(data)[:2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_fs, "write_file", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        _fs.write_atomically(path, b"new and longer")
    assert written[0].startswith(_fs.join(directory, ".MANIFEST.json.tmp-"))
    # The old file whole, and no temporary file left.
    assert _fs.read_bytes(path) == b"old"
    assert _fs.listdir(directory) == ["MANIFEST.json"]


def test_write_atomically_through_a_given_temporary_name(directory):
    path = _fs.join(directory, "LOCK.json")
    tmp = _fs.join(directory, ".tmp-lock-1")
    _fs.write_atomically(path, b"{}", tmp=tmp)
    assert _fs.read_bytes(path) == b"{}"
    assert not _fs.exists(tmp)


def test_rename_replaces_the_target(directory):
    source, target = _fs.join(directory, "s"), _fs.join(directory, "t")
    _fs.write_file(source, b"new")
    _fs.write_file(target, b"old and longer")
    _fs.rename(source, target)
    assert _fs.read_bytes(target) == b"new"
    assert _fs.listdir(directory) == ["t"]


def test_listdir(where):
    assert _fs.listdir(where + "/missing") == []
    _fs.makedirs(_fs.join(where, "sub"))
    _fs.write_file(_fs.join(where, "f"), b"")
    assert sorted(_fs.listdir(where)) == ["f", "sub"]
    assert _fs.isdir(_fs.join(where, "sub"))
    assert not _fs.isdir(_fs.join(where, "f"))
    assert _fs.glob(_fs.join(where, "f*")) == [_fs.join(where, "f")]


def test_remove_tree_and_files(directory):
    _fs.makedirs(_fs.join(directory, "gen-1", "deeper"))
    _fs.write_file(_fs.join(directory, "gen-1", "deeper", "a"), b"a")
    _fs.write_file(_fs.join(directory, "f"), b"f")
    _fs.remove_tree(_fs.join(directory, "gen-1"))
    _fs.remove_file(_fs.join(directory, "f"))
    assert _fs.listdir(directory) == []


def test_quiet_removes_ignore_what_is_missing(directory):
    _fs.remove_file_quietly(_fs.join(directory, "missing"))
    _fs.remove_tree_quietly(_fs.join(directory, "missing"))
    _fs.write_file(_fs.join(directory, "f"), b"f")
    _fs.makedirs(_fs.join(directory, "d"))
    _fs.remove_file_quietly(_fs.join(directory, "f"))
    _fs.remove_tree_quietly(_fs.join(directory, "d"))
    assert _fs.listdir(directory) == []


def test_quiet_removes_ignore_errors():
    # No file system for this scheme: every call raises.
    path = "nosuchfs://bucket/f"
    with pytest.raises(tf.errors.OpError):
        _fs.exists(path)
    _fs.remove_file_quietly(path)
    _fs.remove_tree_quietly(path)


def test_missing_files_raise_not_found(directory):
    path = _fs.join(directory, "missing")
    with pytest.raises(_fs.NOT_FOUND):
        _fs.read_bytes(path)
    with pytest.raises(_fs.NOT_FOUND):
        _fs.size(path)
    with pytest.raises(_fs.NOT_FOUND):
        _fs.remove_file(path)


@pytest.mark.parametrize("through", ["remove_tree", "remove_tree_quietly"])
def test_remove_tree_deletes_a_link_never_its_target(tmp_path, through):
    target = tmp_path / "target"
    target.mkdir()
    (target / "precious").write_text("keep")
    link = tmp_path / "gen-1"
    os.symlink(target, link)
    assert _fs.is_link(str(link))
    assert not _fs.is_link(str(target))
    getattr(_fs, through)(str(link))
    assert not os.path.lexists(link)
    assert (target / "precious").read_text() == "keep"


def test_a_url_is_never_a_link(tmp_path, monkeypatch):
    # Read as a local path, "ram://link" would be the link ram:/link here.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ram:").mkdir()
    os.symlink(tmp_path, tmp_path / "ram:" / "link")
    assert os.path.islink("ram://link")
    assert not _fs.is_link("ram://link")


def _refuse(mode):
    if not stat.S_ISREG(mode):
        raise ValueError(f"mode {mode:o}")


@pytest.mark.skipif(not LINUX_FIFO, reason="needs os.mkfifo")
def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="mode 1"):
        _fs.size(fifo, _refuse)
    with pytest.raises(ValueError, match="mode 1"):
        _fs.read_bytes(fifo, check=_refuse)
    # Unchecked, it is still opened without blocking: nothing to read.
    assert _fs.read_bytes(fifo) == b""


def test_check_sees_a_directory(tmp_path):
    with pytest.raises(ValueError, match="mode 4"):
        _fs.size(str(tmp_path), _refuse)
    with pytest.raises(ValueError, match="mode 4"):
        _fs.read_bytes(str(tmp_path), check=_refuse)


def test_check_is_not_called_for_urls():
    path = f"ram://keras_mgpu_fs/{uuid.uuid4().hex}/a"
    _fs.write_file(path, b"abc")

    def never(mode):
        raise AssertionError("called for a URL")

    assert _fs.size(path, never) == 3
    assert _fs.read_bytes(path, check=never) == b"abc"
    _fs.remove_file(path)


def test_sync_dir(tmp_path):
    _fs.sync_dir(str(tmp_path))
    _fs.sync_dir("ram://keras_mgpu_fs/no-such-dir")  # nothing to sync
    with pytest.raises(FileNotFoundError):
        _fs.sync_dir(str(tmp_path / "missing"))


@pytest.mark.parametrize("before, after", [
    ("", ""),
    ('{"a": 1}\n', '{"a": 1}\n'),
    ('{"a": 1}\n{"b": ', '{"a": 1}\n{"b": \n'),
])
def test_open_append_closes_a_torn_line(directory, before, after):
    path = _fs.join(directory, "metrics.jsonl")
    if before:
        with tf.io.gfile.GFile(path, "w") as f:
            f.write(before)
    f = _fs.open_append(path)
    f.write('{"c": 3}\n')
    f.close()
    assert _fs.read_bytes(path).decode() == after + '{"c": 3}\n'


def test_rewrite_to_append_where_a_file_system_cannot(directory):
    path = _fs.join(directory, "metrics.jsonl")
    with tf.io.gfile.GFile(path, "w") as f:
        f.write('{"a": 1}\n{"b": ')
    assert _fs._ends_torn(path)
    f = _fs._rewrite_to_append(path, torn=True)
    f.write('{"c": 3}\n')
    f.close()
    assert _fs.read_bytes(path) == b'{"a": 1}\n{"b": \n{"c": 3}\n'
