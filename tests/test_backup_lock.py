"""The owner lock of a backup_dir: one live run writes there at a time."""

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings

import pytest

from keras_mgpu.callbacks import _backup_lock
from keras_mgpu.callbacks._backup_lock import (HEARTBEAT_SECONDS, LOCK_NAME,
                                               BackupDirInUse, OwnerLock)

TIMEOUT = 60
LINUX = sys.platform.startswith("linux")

# Loads the module from its file, not through the keras_mgpu package, so the
# child imports no TensorFlow; it holds the lock until stdin closes.
HOLDER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("lock", sys.argv[1])
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)
lock.OwnerLock(sys.argv[2]).acquire()
print("LOCKED tf=%s" % ("tensorflow" in sys.modules), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path):
    """Starts a child process holding the lock of a directory; returns it
    once it says so. Killed at teardown; its stderr is printed (pytest
    shows it on failure)."""
    started = []

    def start(directory):
        stderr = open(tmp_path / f"holder-{len(started)}.err", "w+")
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, _backup_lock.__file__,
             str(directory)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
            text=True)
        started.append((proc, stderr))
        lines = queue.Queue()
        threading.Thread(target=lambda: lines.put(proc.stdout.readline()),
                         daemon=True).start()
        try:
            line = lines.get(timeout=TIMEOUT)
        except queue.Empty:
            line = "(nothing)"
        if not line.startswith("LOCKED"):
            proc.kill()
            proc.wait(timeout=TIMEOUT)
            stderr.seek(0)
            pytest.fail(f"holder printed {line!r}; stderr:\n{stderr.read()}")
        return proc, line.strip()

    yield start
    for proc, stderr in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=TIMEOUT)
        proc.stdin.close()
        proc.stdout.close()
        stderr.seek(0)
        print(f"holder {proc.pid} stderr:\n{stderr.read()}", file=sys.stderr)
        stderr.close()


def read_lock(directory):
    with open(os.path.join(directory, LOCK_NAME)) as f:
        return json.load(f)


def write_lock(directory, **fields):
    """Writes a LOCK.json: this process's identity, `fields` on top."""
    now = time.time()
    record = {**_backup_lock._identity(), "token": uuid.uuid4().hex,
              "started": now - 100, "heartbeat": now, **fields}
    with open(os.path.join(directory, LOCK_NAME), "w") as f:
        json.dump(record, f)
    return record


def foreign(**fields):
    """Fields of a lock held on another machine."""
    return {"host": "some-other-host", "boot_id": "another-boot",
            "pid": 4242, "process_start": 99, **fields}


def acquire_warns(lock, match):
    with pytest.warns(UserWarning, match=match) as record:
        lock.acquire()
    return record


def test_live_holder_refuses_then_dead_holder_is_taken_over(tmp_path,
                                                             holder):
    proc, line = holder(tmp_path)
    assert line == "LOCKED tf=False"  # the module imports without TF
    lock = OwnerLock(str(tmp_path))
    with pytest.raises(BackupDirInUse) as e:
        lock.acquire()
    message = str(e.value)
    assert f"pid {proc.pid} on host {socket.gethostname()}" in message
    assert str(tmp_path / LOCK_NAME) in message
    assert message.startswith("BackupAndRestore: backup_dir ")
    assert read_lock(tmp_path)["pid"] == proc.pid  # untouched

    proc.kill()
    proc.wait(timeout=TIMEOUT)
    acquire_warns(lock, rf"pid {proc.pid} on host .*died")
    assert read_lock(tmp_path)["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.skipif(not LINUX, reason="process start times need /proc")
def test_reused_pid_is_a_dead_owner(tmp_path):
    start = _backup_lock._identity()["process_start"]
    write_lock(tmp_path, process_start=start - 1)
    acquire_warns(OwnerLock(str(tmp_path)), f"pid {os.getpid()}.*died")
    assert read_lock(tmp_path)["process_start"] == start


def test_same_process_takes_its_lock_again_silently(tmp_path):
    first = OwnerLock(str(tmp_path))
    second = OwnerLock(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first.acquire()
        first.acquire()  # fit again after a fit that raised
        second.acquire()
    first.release()  # no longer its token: left to `second`
    assert (tmp_path / LOCK_NAME).exists()
    second.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_other_host_alive_until_heartbeat_is_stale(tmp_path):
    write_lock(tmp_path, **foreign(heartbeat=time.time() - 5))
    with pytest.raises(BackupDirInUse, match=r"^Trainer: .*pid 4242 on host "
                       r"some-other-host.*last seen \d+ s ago.*until its "
                       r"heartbeat is 600 s old"):
        OwnerLock(str(tmp_path), what="Trainer").acquire()

    write_lock(tmp_path, **foreign(heartbeat=time.time() - 700))
    acquire_warns(OwnerLock(str(tmp_path)),
                  r"pid 4242 on host some-other-host.*died.*no heartbeat")
    assert read_lock(tmp_path)["pid"] == os.getpid()


@pytest.mark.parametrize("content", [b'{"host": "h", "pi', b"",
                                     b'{"host": "h"}', b"\xff\xfe"])
def test_unreadable_lock_is_taken_over(tmp_path, content):
    (tmp_path / LOCK_NAME).write_bytes(content)
    acquire_warns(OwnerLock(str(tmp_path)), "unreadable")
    assert read_lock(tmp_path)["pid"] == os.getpid()


def test_release_and_refresh_after_a_takeover(tmp_path):
    lock = OwnerLock(str(tmp_path))
    lock.acquire()
    other = write_lock(tmp_path, **foreign())
    lock.release()
    assert read_lock(tmp_path) == other  # not ours: left alone

    os.remove(tmp_path / LOCK_NAME)
    lock.acquire()
    token = read_lock(tmp_path)["token"]
    write_lock(tmp_path, **foreign(token=token, heartbeat=0.0))
    lock.refresh()  # not due: does not even read the file
    assert read_lock(tmp_path)["heartbeat"] == 0.0
    lock._last_refresh -= HEARTBEAT_SECONDS
    lock.refresh()  # due: rewrites our record
    assert read_lock(tmp_path)["heartbeat"] > time.time() - TIMEOUT
    assert read_lock(tmp_path)["pid"] == os.getpid()

    write_lock(tmp_path, **foreign())
    lock._last_refresh -= HEARTBEAT_SECONDS
    with pytest.raises(BackupDirInUse, match="taken over by another run: "
                       "pid 4242 on host some-other-host"):
        lock.refresh()
    assert read_lock(tmp_path)["pid"] == 4242


def test_refresh_rewrites_a_deleted_lock(tmp_path):
    lock = OwnerLock(str(tmp_path))
    lock.acquire()
    os.remove(tmp_path / LOCK_NAME)
    lock._last_refresh -= HEARTBEAT_SECONDS
    with pytest.warns(UserWarning, match="deleted"):
        lock.refresh()
    assert read_lock(tmp_path)["pid"] == os.getpid()


@pytest.mark.parametrize("target_exists", [True, False])
def test_symlinked_lock_is_refused_and_target_untouched(tmp_path,
                                                        target_exists):
    directory = tmp_path / "bdir"
    directory.mkdir()
    target = tmp_path / "precious.json"
    if target_exists:
        target.write_text("precious")
    os.symlink(target, directory / LOCK_NAME)
    with pytest.raises(RuntimeError, match="symbolic link.*remove the link"):
        OwnerLock(str(directory)).acquire()
    assert os.path.islink(directory / LOCK_NAME)
    if target_exists:
        assert target.read_text() == "precious"
    else:
        assert not target.exists()
    assert sorted(os.listdir(directory)) == [LOCK_NAME]


def test_url_directory(monkeypatch):
    import tensorflow as tf

    directory = f"ram://{uuid.uuid4().hex}/bdir"
    path = f"{directory}/{LOCK_NAME}"
    lock = OwnerLock(directory + "/")
    lock.acquire()
    record = json.loads(tf.io.gfile.GFile(path, "rb").read())
    assert record["pid"] == os.getpid()
    lock._last_refresh -= HEARTBEAT_SECONDS
    lock.refresh()
    assert json.loads(tf.io.gfile.GFile(path, "rb").read())["heartbeat"] >= (
        record["heartbeat"])
    lock.release()
    assert not tf.io.gfile.exists(path)
    lock.release()  # already gone: fine

    now = time.time()
    with tf.io.gfile.GFile(path, "wb") as f:
        f.write(json.dumps(foreign(token="x", started=now, heartbeat=now)))
    with pytest.raises(BackupDirInUse, match="some-other-host"):
        OwnerLock(directory).acquire()

    # Lost the create race: another run's write landed between ours and
    # the read-back.
    tf.io.gfile.remove(path)
    write = _backup_lock.OwnerLock._write

    def raced(self, record):
        write(self, record)
        write(self, foreign(token="y", started=now, heartbeat=now))

    monkeypatch.setattr(_backup_lock.OwnerLock, "_write", raced)
    with pytest.raises(BackupDirInUse, match="pid 4242"):
        OwnerLock(directory).acquire()
