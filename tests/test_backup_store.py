"""The generation store under BackupAndRestore: commit, verify, prune.

Plain files and bytes, no Keras and no training: each test takes
milliseconds. Kills during a real training's commit are in
tests/test_backup_kills.py.
"""

import errno
import hashlib
import json
import os

import pytest

from keras_mgpu import _fs
from keras_mgpu.callbacks.backup.store import (CorruptGeneration,
                                                GenerationStore, WriteFailed)

FILES = {"a.bin": b"alpha" * 100, "state.json": b'{"step": 1}'}


def store_with(tmp_path, generations=2, keep=3):
    store = GenerationStore(str(tmp_path / "b"), keep=keep)
    for i in range(generations):
        store.write({**FILES, "state.json": json.dumps({"step": i}).encode()})
    return store


def manifest_path(store, number):
    return os.path.join(store.path(number), "MANIFEST.json")


def test_write_read_keep(tmp_path):
    store = GenerationStore(str(tmp_path / "b"), keep=2)
    for step in range(3):
        data = {"a.bin": memoryview(b"x" * step), "state.json": b"%d" % step}
        assert store.write(data) == step + 1
    assert store.generations() == [3, 2]
    assert sorted(os.listdir(tmp_path / "b")) == ["gen-00000002",
                                                   "gen-00000003"]
    assert store.read(3) == {"a.bin": b"xx", "state.json": b"2"}
    manifest = json.loads(open(manifest_path(store, 3)).read())
    assert manifest == {"generation": 3, "files": {
        "a.bin": {"size": 2, "sha256": hashlib.sha256(b"xx").hexdigest()},
        "state.json": {"size": 1, "sha256": hashlib.sha256(b"2").hexdigest()}}}
    # Nothing left over: no temporary directory, no temporary marker.
    assert sorted(os.listdir(store.path(3))) == ["MANIFEST.json", "a.bin",
                                                 "state.json"]


def test_a_directory_without_its_manifest_is_a_leftover(tmp_path):
    store = store_with(tmp_path)
    # What a kill leaves: files moved in but no marker (3), and a marker
    # cut short under its temporary name (4).
    for number, extra in ((3, None), (4, ".MANIFEST.json.tmp-0123")):
        os.makedirs(store.path(number))
        open(os.path.join(store.path(number), "a.bin"), "wb").write(b"a")
        if extra:
            open(os.path.join(store.path(number), extra), "w").write('{"gen')
    os.makedirs(os.path.join(store.directory, ".tmp-5-abcd"))
    assert store.generations() == [2, 1]
    found = store.latest_usable({"a.bin"})
    assert (found.number, found.unusable) == (2, [])
    # Never reused: the next write comes after every directory there.
    assert store._next_number() == 5
    store.remove_leftovers()
    assert sorted(os.listdir(store.directory)) == ["gen-00000001",
                                                   "gen-00000002"]


def test_only_a_leftover_means_no_backup_yet(tmp_path):
    store = GenerationStore(str(tmp_path / "b"))
    os.makedirs(store.path(1))
    open(os.path.join(store.path(1), "a.bin"), "wb").write(b"a")
    found = store.latest_usable({"a.bin"})
    assert (found.number, found.files, found.unusable) == (None, None, [])


@pytest.mark.parametrize("manifest, reason", [
    (b"null", "MANIFEST.json holds null, not an object"),
    (b"[]", "MANIFEST.json holds a list, not an object"),
    (b'{"generation": 2, "fi', "MANIFEST.json is not JSON"),
    (b"\xff\xfe", "MANIFEST.json is not JSON"),
    (b'{"files": {}}', "MANIFEST.json names generation None, not 2"),
    (b'{"generation": true, "files": {}}', "names generation True, not 2"),
    (b'{"generation": 2, "files": ["a.bin"]}',
     "MANIFEST.json's files are a list, not an object"),
    (b'{"generation": 2, "files": {"a.bin": "0"}}',
     "MANIFEST.json's entry for a.bin is '0', not"),
    (b'{"generation": 2, "files": {"a.bin": {"size": -1, "sha256": "%s"}}}'
     % (b"0" * 64), "entry for a.bin is {'size': -1"),
    (b'{"generation": 2, "files": {"a.bin": {"size": true, "sha256": "%s"}}}'
     % (b"0" * 64), "entry for a.bin is {'size': True"),
    (b'{"generation": 2, "files": {"a.bin": {"size": 1, "sha256": "xyz"}}}',
     "entry for a.bin is {'size': 1, 'sha256': 'xyz'}"),
    (b'{"generation": 2, "files": {"../a.bin": {"size": 1, "sha256": "%s"}}}'
     % (b"0" * 64), "lists a file named '../a.bin'"),
    (b'{"generation": 2, "files": {}}', "its manifest does not list a.bin"),
    (b" " * (2 << 20), "MANIFEST.json has 2097152 bytes, more than a "
     "manifest holds"),
])
def test_a_manifest_is_checked_against_its_schema(tmp_path, manifest, reason):
    store = store_with(tmp_path)
    with open(manifest_path(store, 2), "wb") as f:
        f.write(manifest)
    with pytest.raises(CorruptGeneration, match=reason.replace(
            "(", r"\(").replace("{", r"\{").replace("[", r"\[")):
        store.read(2, {"a.bin"})
    found = store.latest_usable({"a.bin"})
    assert found.number == 1
    assert [n for n, _ in found.unusable] == [2]
    assert reason in found.unusable[0][1]


@pytest.mark.parametrize("damage, reason", [
    ("truncate", "a.bin has 10 bytes, the manifest says 500"),
    ("flip", "a.bin fails its checksum"),
    ("remove", "a.bin is missing"),
    ("fifo", "a.bin is not a regular file"),
    ("directory", "a.bin is not a regular file"),
])
def test_every_listed_file_is_verified(tmp_path, damage, reason):
    store = store_with(tmp_path)
    path = os.path.join(store.path(2), "a.bin")
    data = open(path, "rb").read()
    os.remove(path)
    if damage == "truncate":
        open(path, "wb").write(data[:10])
    elif damage == "flip":
        open(path, "wb").write(bytes([data[0] ^ 1]) + data[1:])
    elif damage == "fifo":
        os.mkfifo(path)  # a read would block forever
    elif damage == "directory":
        os.mkdir(path)
    found = store.latest_usable()
    assert found.number == 1
    assert found.unusable == [(2, reason)]


def test_a_file_the_manifest_does_not_list_is_never_read(tmp_path):
    store = store_with(tmp_path)
    # A FIFO: reading it would block this test forever.
    os.mkfifo(os.path.join(store.path(2), "extra.bin"))
    assert store.read(2) == {**FILES, "state.json": b'{"step": 1}'}
    # Needed but unlisted: the generation is unusable, the file unread.
    found = store.latest_usable({"a.bin", "extra.bin"})
    assert found.number is None
    assert [why for _, why in found.unusable] == [
        "its manifest does not list extra.bin"] * 2


def test_validate_decides_too(tmp_path):
    store = store_with(tmp_path)

    def validate(files):
        state = json.loads(files["state.json"])
        if state["step"] != 0:
            raise CorruptGeneration(f"step {state['step']}")
        return state

    found = store.latest_usable({"a.bin"}, validate=validate)
    assert (found.number, found.value, found.unusable) == (
        1, {"step": 0}, [(2, "step 1")])
    assert found.files == FILES | {"state.json": b'{"step": 0}'}


def test_the_marker_is_written_atomically(tmp_path, monkeypatch):
    """A marker write that fails midway leaves no marker (and no temporary
    file): the generation stays uncommitted, the older ones untouched."""
    store = store_with(tmp_path)
    original = _fs.write_file

    def half_then_fail(path, data):
        if "/.MANIFEST.json.tmp-" in path:
            original(path, bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        original(path, data)

    monkeypatch.setattr(_fs, "write_file", half_then_fail)
    with pytest.raises(WriteFailed) as error:
        store.write(FILES)
    assert (error.value.number, error.value.previous) == (3, 2)
    assert "No space left on device" in str(error.value)
    assert error.value.path.startswith(f"{store.directory}/.tmp-3-")
    assert store.generations() == [2, 1]
    assert sorted(os.listdir(store.directory)) == ["gen-00000001",
                                                   "gen-00000002"]


@pytest.mark.parametrize("stage", ["write_file", "rename"])
def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch, stage):
    store = store_with(tmp_path)
    before = {p: open(os.path.join(dirpath, p), "rb").read()
              for dirpath, _, names in os.walk(store.directory)
              for p in names}
    calls = []
    original = getattr(_fs, stage)

    def fail_second(*args):
        calls.append(args)
        if len(calls) == 2:
            raise OSError(errno.EIO, "I/O error")
        return original(*args)

    monkeypatch.setattr(_fs, stage, fail_second)
    with pytest.raises(WriteFailed, match="could not write generation 3"):
        store.write(FILES)
    after = {p: open(os.path.join(dirpath, p), "rb").read()
             for dirpath, _, names in os.walk(store.directory) for p in names}
    assert after == before


def test_pruning_removes_the_marker_first(tmp_path, monkeypatch):
    """A generation being pruned is uncommitted from its first deletion
    on: a kill midway never leaves a committed generation with files
    missing."""
    store = store_with(tmp_path, generations=1, keep=1)
    seen = []
    original = _fs.remove_tree

    def remove(path):
        if "/gen-" in path:
            seen.append((path, os.path.exists(
                os.path.join(path, "MANIFEST.json"))))
        original(path)

    monkeypatch.setattr(_fs, "remove_tree", remove)
    store.write(FILES)
    assert seen == [(store.path(1), False)]
    assert store.generations() == [2]


def test_delete_removes_links_never_their_targets(tmp_path):
    store = store_with(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "MANIFEST.json").write_text("{}")
    os.symlink(elsewhere, os.path.join(store.directory, "gen-00000009"))
    os.symlink(elsewhere, os.path.join(store.directory, ".tmp-9-x"))
    store.delete()
    assert not os.path.exists(store.directory)
    assert (elsewhere / "MANIFEST.json").read_text() == "{}"


def test_a_tensorflow_filesystem(tmp_path):
    store = GenerationStore(f"ram://keras_mgpu_store/{tmp_path.name}", keep=1)
    assert store.write(FILES) == 1
    assert store.write(FILES) == 2
    assert store.generations() == [2]
    assert store.latest_usable(set(FILES)).files == FILES
    store.delete()
    assert store.generations() == []
