"""`keras-mgpu launch` stopped by a signal: SIGTERM, SIGHUP and Ctrl-C are
passed on to the workers, what still runs after the grace period is
killed, and nothing is left running (real processes, real signals)."""

import os
import selectors
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.test_cli import console_script

# Each worker prints its pid, then waits; a SIGTERM makes it say so and
# exit with the preemption code, unless told to ignore it.
WORKER = textwrap.dedent("""
    import os, signal, sys
    index = os.environ["TF_CONFIG"].rsplit("index", 1)[1].strip(' ":}')
    def on_term(signum, frame):
        print(f"TERM {index}", flush=True)
        sys.exit(143)
    ignore = index in os.environ.get("IGNORE_TERM", "").split(",")
    signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore else on_term)
    print(f"READY {index} {os.getpid()}", flush=True)
    while True:
        signal.pause()
""")


def _ready_pids(proc, count, timeout=120):
    """The pids the workers print, read from the launcher's stdout (raw
    reads: a buffered `readline` would hide lines from `select`)."""
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    pids, data = {}, b""
    while len(pids) < count and time.monotonic() < deadline:
        if not selector.select(deadline - time.monotonic()):
            break
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            break  # the launcher exited
        data += chunk
        for line in data.decode(errors="replace").splitlines():
            if "READY" in line:
                index, pid = line.split("READY", 1)[1].split()[:2]
                pids[int(index)] = int(pid)
    if len(pids) < count:
        proc.kill()
        raise AssertionError(f"workers not ready: {data!r}, "
                             f"{proc.communicate()[1][-3000:]}")
    return pids, data.decode(errors="replace")


def gone(pid: int) -> bool:
    """Whether `pid` no longer runs (a zombie nobody reaped counts as
    gone: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("signum, code, ignore", [
    (signal.SIGTERM, 143, "1"),  # worker 1 ignores it: killed after 3 s
    (signal.SIGINT, 130, ""),
])
def test_a_stop_signal_reaches_every_worker(tmp_path, signum, code, ignore):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, IGNORE_TERM=ignore, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen(
        [console_script(), "launch", "--workers", "2", "--grace-period",
         "3", "--", sys.executable, str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        pids, seen = _ready_pids(proc, 2)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    out, err = seen + out.decode(errors="replace"), err.decode(
        errors="replace")
    assert proc.returncode == code, err[-3000:]
    name = signal.Signals(signum).name
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"keras-mgpu launch: stopped by {name}: passed "
                           "on to every worker as SIGTERM"), err[-3000:]
    assert "Run the same command again to resume." in last
    assert "Traceback" not in err
    told = {i for i in range(2) if f"TERM {i}" in out}
    assert told == ({0} if ignore else {0, 1})
    assert all(gone(pid) for pid in pids.values()), pids


def test_a_launcher_killed_by_sigkill_takes_its_workers_along(tmp_path):
    # No handler sees a SIGKILL: the workers, in their own sessions, used
    # to train on, holding the backup's lock.
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = subprocess.Popen(
        [console_script(), "launch", "--workers", "2", "--", sys.executable,
         str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        pids, _ = _ready_pids(proc, 2)
        proc.kill()
        proc.wait(timeout=60)
        deadline = time.monotonic() + 60
        while not all(gone(p) for p in pids.values()):
            assert time.monotonic() < deadline, f"orphans: {pids}"
            time.sleep(0.05)
    finally:
        proc.kill()
        for pid in pids.values() if "pids" in locals() else ():
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_stopped_launch_names_the_attempts_that_ended_before(tmp_path):
    # Attempt 1 ends restartable (143); in attempt 2 the worker asks its
    # launcher, this process, to stop.
    from keras_mgpu import launcher

    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys
        if os.environ["KERAS_MGPU_ATTEMPT"] == "1":
            sys.exit(143)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        os.kill(os.getppid(), signal.SIGTERM)
        signal.pause()
    """))
    with pytest.raises(launcher.LaunchError) as stopped:
        launcher.launch([sys.executable, str(script)], 1, max_restarts=3,
                        backoff=0, grace_period=30, timeout=120)
    assert stopped.value.exit_code == 143
    assert [a.why for a in stopped.value.attempts] == [
        "worker 0 exit code 143"], stopped.value.attempts
