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
