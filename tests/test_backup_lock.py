"""The owner lock of a backup_dir: one live run writes there at a time."""

import json
import os
import queue
import re
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
import warnings

import pytest

from keras_mgpu.callbacks.backup import lock as _backup_lock
from keras_mgpu.callbacks.backup.lock import (HEARTBEAT_SECONDS, LOCK_NAME,
                                               BackupDirInUse, OwnerLock)

TIMEOUT = 60


def first_line(stream, timeout: float) -> str:
    """The next line a child prints to `stream`, or "(nothing)" when none
    comes within `timeout` seconds (a blocked child never hangs a test)."""
    lines = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()),
                     daemon=True).start()
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        return "(nothing)"
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
        line = first_line(proc.stdout, TIMEOUT)
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

    def raced(self, path, data):
        write(self, path, data)
        write(self, path, json.dumps(
            foreign(token="y", started=now, heartbeat=now)).encode())

    monkeypatch.setattr(_backup_lock.OwnerLock, "_write", raced)
    with pytest.raises(BackupDirInUse, match="pid 4242"):
        OwnerLock(directory).acquire()


# Races children through rounds: before round i each blocks on reading pipe
# i, which the parent closes once round i's directory is ready, so all are
# released at once (EOF reaches every reader together). Each prints who won;
# a winner keeps its lock by staying alive until stdin closes.
RACER = """
import importlib.util, os, sys, warnings
spec = importlib.util.spec_from_file_location("lock", sys.argv[1])
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)
warnings.simplefilter("ignore")
print("READY tf=%s" % ("tensorflow" in sys.modules), flush=True)
for i, fd in enumerate(map(int, sys.argv[3].split(","))):
    os.read(fd, 1)
    try:
        lock.OwnerLock(os.path.join(sys.argv[2], str(i))).acquire()
        print(i, "WON", flush=True)
    except lock.BackupDirInUse:
        print(i, "IN_USE", flush=True)
    except Exception as e:
        print(i, "ERROR", repr(e), flush=True)
sys.stdin.read()
"""

DEAD_LOCKS = ["reused_pid", "stale_heartbeat", "torn"]


def dead_lock(directory, kind):
    """Leaves in `directory` the lock of a run that died."""
    if kind == "reused_pid":  # our pid, but another process's start time
        start = _backup_lock._identity()["process_start"]
        write_lock(directory, process_start=start - 1)
    elif kind == "stale_heartbeat":
        write_lock(directory, **foreign(heartbeat=time.time() - 700))
    else:
        (directory / LOCK_NAME).write_bytes(b'{"host": "h", "pi')


@pytest.mark.skipif(not LINUX, reason="process start times need /proc")
def test_simultaneous_takeovers_of_a_dead_lock_have_one_winner(tmp_path):
    racers, rounds = 4, 24
    pipes = [os.pipe() for _ in range(rounds)]
    reads = [r for r, _ in pipes]
    lines = queue.Queue()
    procs = []
    try:
        for n in range(racers):
            stderr = open(tmp_path / f"racer-{n}.err", "w+")
            proc = subprocess.Popen(
                [sys.executable, "-c", RACER, _backup_lock.__file__,
                 str(tmp_path), ",".join(map(str, reads))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                pass_fds=reads, text=True)
            procs.append((proc, stderr))
            threading.Thread(target=lambda p=proc: [
                lines.put((p.pid, line.split())) for line in p.stdout],
                daemon=True).start()
        for r in reads:
            os.close(r)  # the children hold them now

        def answers(n):
            got = []
            for _ in range(n):
                try:
                    got.append(lines.get(timeout=TIMEOUT))
                except queue.Empty:
                    pytest.fail(f"racers answered only {got} of {n}")
            return got

        assert all(a == ["READY", "tf=False"] for _, a in answers(racers))
        for i, (_, write_end) in enumerate(pipes):
            directory = tmp_path / str(i)
            directory.mkdir()
            dead_lock(directory, DEAD_LOCKS[i % len(DEAD_LOCKS)])
            os.close(write_end)  # the barrier: releases every racer at once
            results = {pid: a for pid, a in answers(racers)}
            assert all(a[0] == str(i) for a in results.values()), results
            won = [pid for pid, a in results.items() if a[1] == "WON"]
            assert len(won) == 1 and sorted(
                a[1] for a in results.values()) == ["IN_USE"] * (
                    racers - 1) + ["WON"], f"race {i}: {results}"
            assert read_lock(directory)["pid"] == won[0]
            # No claim or temporary file is left behind.
            assert os.listdir(directory) == [LOCK_NAME]
    finally:
        for proc, stderr in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=TIMEOUT)
            stderr.seek(0)
            print(f"racer {proc.pid} stderr:\n{stderr.read()}",
                  file=sys.stderr)
            stderr.close()
            proc.stdin.close()


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_lock_path_that_is_not_a_file_is_refused_without_blocking(
        tmp_path, kind):
    path = tmp_path / LOCK_NAME
    if kind == "directory":
        path.mkdir()
        (path / "inside").write_text("kept")
        match = "is a directory, not a regular file"
    else:
        os.mkfifo(path)  # opening it to read would wait for a writer
        match = r"is a named pipe \(FIFO\), not a regular file"
    outcome = queue.Queue()

    def acquire():
        try:
            OwnerLock(str(tmp_path)).acquire()
            outcome.put(None)
        except BaseException as e:
            outcome.put(e)

    thread = threading.Thread(target=acquire, daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    if thread.is_alive():
        # Blocked in open(): a writer releases it, so the thread ends.
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"acquire() blocked on the {kind} {path}")
    error = outcome.get_nowait()
    assert isinstance(error, RuntimeError), repr(error)
    message = str(error)
    assert re.search(match, message), message
    assert f"BackupAndRestore: {path} is a" in message
    assert "remove what is there (or use another backup_dir)" in message
    # Left as it was.
    assert (path.is_dir() and (path / "inside").read_text() == "kept"
            if kind == "directory" else stat.S_ISFIFO(os.lstat(path).st_mode))
    assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]


@pytest.mark.parametrize("directory, error, match", [
    (None, TypeError, "must be a path .*got None"),
    (3, TypeError, "must be a path .*got 3"),
    (b"bdir", TypeError, "must be a path .*got b'bdir'"),
    ("", ValueError, "must be a non-empty path, got ''"),
])
def test_a_directory_that_is_not_a_path_is_refused(tmp_path, monkeypatch,
                                                   directory, error, match):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=f"^BackupAndRestore: the directory to "
                       f"lock {match}"):
        OwnerLock(directory).acquire()
    assert os.listdir(tmp_path) == []  # no ./None/LOCK.json


# Takes over a dead lock in `argv[2]`, and is SIGKILLed in the middle: before
# (`argv[3]` "before") or after ("after") replacing LOCK.json.
DIES_TAKING_OVER = """
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("lock", sys.argv[1])
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)
write = lock.OwnerLock._write

def dying_write(self, path, data):
    if path.endswith(lock.LOCK_NAME):
        if sys.argv[3] == "after":
            write(self, path, data)
        os.kill(os.getpid(), signal.SIGKILL)
    write(self, path, data)

lock.OwnerLock._write = dying_write
lock.OwnerLock(sys.argv[2]).acquire()
"""


@pytest.mark.skipif(not LINUX, reason="process start times need /proc")
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_run_killed_while_taking_over_leaves_a_lock_others_take(tmp_path,
                                                                  when):
    dead_lock(tmp_path, "reused_pid")
    child = subprocess.run(
        [sys.executable, "-c", DIES_TAKING_OVER, _backup_lock.__file__,
         str(tmp_path), when], capture_output=True, text=True,
        timeout=TIMEOUT, check=False)
    assert child.returncode == -9, child.stderr
    # It died holding its claim on the dead lock.
    claims = [n for n in os.listdir(tmp_path) if n.startswith(".tmp-lock-")]
    assert len(claims) == 1, os.listdir(tmp_path)
    owner = read_lock(tmp_path)["pid"]  # "after": the killed run's
    assert (owner == os.getpid()) == (when == "before")
    lock = OwnerLock(str(tmp_path))
    with pytest.warns(UserWarning, match=rf"from pid {owner} on host .*died"):
        lock.acquire()
    assert read_lock(tmp_path)["pid"] == os.getpid()
    # "before": its claim was taken over and removed; "after": it claimed a
    # record no longer there, a leftover BackupAndRestore sweeps.
    left = [n for n in os.listdir(tmp_path) if n.startswith(".tmp-lock-")]
    assert left == ([] if when == "before" else claims)
    lock.release()
