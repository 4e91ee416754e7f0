"""BackupAndRestore under SIGKILL at every stage of a commit, and at random.

Each run is a real process (forked from one that imported TensorFlow once,
`backup_workers.serve_forks`) killed with a real SIGKILL; the rerun must
resume from the last committed generation and end where an uninterrupted
run ends.
"""

import json
import os
import random
import re
import selectors
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from keras_mgpu.callbacks import backup_and_restore

_TIMEOUT = 240  # seconds for one run; they take one or two


class Forks:
    """A `serve_forks` process: `run(**kwargs)` trains in a fork of it."""

    def __init__(self, workdir):
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                   CUDA_VISIBLE_DEVICES="-1",
                   PYTHONPATH=os.pathsep.join(
                       [repo, os.environ.get("PYTHONPATH", "")]))
        self._stderr_path = os.path.join(workdir, "serve_forks.stderr")
        self._stderr = open(self._stderr_path, "w")
        self._proc = subprocess.Popen(
            [sys.executable, "-c",
             "from tests import backup_workers; backup_workers.serve_forks()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, env=env, cwd=repo)
        self._buffer = b""
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._proc.stdout, selectors.EVENT_READ)
        self._child = None

    def run(self, kill_when=None, **kwargs):
        """Runs `train_steps(**kwargs)`; SIGKILLs it as soon as
        `kill_when(line)` returns a number of seconds (not None) for a line
        it printed, that many seconds later. Returns (exit code, the lines
        it printed)."""
        self._proc.stdin.write(json.dumps(kwargs).encode() + b"\n")
        self._proc.stdin.flush()
        lines = []
        deadline = time.monotonic() + _TIMEOUT
        while True:
            line = self._readline(deadline, lines)
            lines.append(line)
            if line.startswith("START "):
                self._child = int(line.split()[1].rstrip(";"))
            elif line.startswith("EXIT "):
                self._child = None
                return int(line.split()[2].rstrip(";")), lines
            elif kill_when is not None:
                delay = kill_when(line)
                if delay is not None:
                    # Not a synchronisation: a random point of a step
                    # (and of the write its save started).
                    time.sleep(delay)
                    os.kill(self._child, signal.SIGKILL)
                    kill_when = None

    def _readline(self, deadline, lines):
        # Raw reads: a buffered reader could hold a second line that
        # select() then never reports.
        while b"\n" not in self._buffer:
            if not self._selector.select(
                    max(0.0, deadline - time.monotonic())):
                break
            data = os.read(self._proc.stdout.fileno(), 65536)
            if not data:
                break
            self._buffer += data
        else:
            line, self._buffer = self._buffer.split(b"\n", 1)
            return line.decode(errors="replace")
        self.fail(("no line from the training process in time"
                   if self._proc.poll() is None else "serve_forks exited")
                  + f" after {lines[-20:]}")

    def fail(self, why):
        self.close()
        with open(self._stderr_path) as f:
            stderr = f.read()
        raise AssertionError(f"{why}; its stderr:\n{stderr[-4000:]}")

    def stderr(self):
        with open(self._stderr_path) as f:
            return f.read()

    def close(self):
        if self._child is not None:
            try:
                os.kill(self._child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._proc.kill()
        self._proc.wait(timeout=60)
        self._stderr.close()


@pytest.fixture(scope="module")
def forks(tmp_path_factory):
    server = Forks(str(tmp_path_factory.mktemp("forks")))
    yield server
    server.close()


def finished(forks, tmp_path, name, **kwargs):
    """The final weights and step count of a run that is not killed and
    saves nothing."""
    kwargs["save_freq"] = 10**6
    result = str(tmp_path / f"{name}.npz")
    code, _ = forks.run(backup_dir=str(tmp_path / name), result=result,
                        **kwargs)
    if code != 0:
        forks.fail(f"run {name} exited with {code}")
    with np.load(result) as saved:
        iterations = int(saved["iterations"])
        weights = [saved[f"arr_{i}"] for i in range(len(saved.files) - 1)]
    return weights, iterations


def max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def resumed_from(lines):
    """The generation a run says it resumed from, or None."""
    for line in lines:
        match = re.search(r"resumed from backup generation (\d+)", line)
        if match:
            return int(match.group(1))
    return None


# (stage, generation) held and killed in each run, the committed
# generations that leaves, and the generation the next run resumes from.
# Saves every 2 of 16 steps, keep=1: generation n is the save of step 2n
# of the run that writes it.
_CHAIN = [
    # Half the first manifest written: no backup yet (before: "Every backup
    # generation ... is unusable: generation 1 (JSONDecodeError ...)").
    (("marker", 1), [], None),
    (("moved", 2), [1], 1),          # files in place, no manifest
    (("pruning", 2), [3], 3),        # 3 committed; 2's manifest removed
    (("committed", 4), [4, 3], 4),   # 4 committed, 3 not yet pruned
]


def test_a_kill_at_each_stage_of_a_commit_resumes_from_the_last_commit(
        forks, tmp_path):
    kwargs = {"save_freq": 2, "keep": 1, "epochs": 2, "steps": 8}
    full, full_steps = finished(forks, tmp_path, "full", **kwargs)
    backup_dir = str(tmp_path / "backup")
    expected_resume = None
    for hold, committed, resume in _CHAIN:
        code, lines = forks.run(
            backup_dir=backup_dir, result=str(tmp_path / "killed.npz"),
            hold=hold,
            kill_when=lambda line: 0.0 if line.startswith("HELD ") else None,
            **kwargs)
        assert code == -signal.SIGKILL, (hold, lines)
        assert f"HELD {hold[0]} {hold[1]};" in lines
        assert resumed_from(lines) == expected_resume, (hold, lines)
        assert backup_and_restore._generations(backup_dir) == committed
        expected_resume = resume
    code, lines = forks.run(backup_dir=backup_dir,
                            result=str(tmp_path / "resumed.npz"), **kwargs)
    if code != 0:
        forks.fail(f"the last rerun exited with {code}")
    assert resumed_from(lines) == expected_resume
    with np.load(tmp_path / "resumed.npz") as saved:
        assert int(saved["iterations"]) == full_steps == 16
        weights = [saved[f"arr_{i}"] for i in range(len(full))]
    assert max_diff(weights, full) <= 1e-6
    assert not os.path.exists(backup_dir), "a finished run deletes its backups"


def test_twenty_kills_at_random_points_of_per_step_saves(forks, tmp_path):
    """A save after every step of a model whose generation takes
    milliseconds to write (two 256-unit layers: about 0.8 MB with Adam's
    slots; about 80 ms with the fsyncs on a virtual disk): each rerun
    resumes from the newest committed generation and is killed at a
    random fraction of a step's time after its second step's marker (the
    write of that step's save runs then); the last rerun ends where an
    uninterrupted run ends."""
    kwargs = {"save_freq": 1, "keep": 1, "epochs": 4, "steps": 16,
              "width": 256}
    full, full_steps = finished(forks, tmp_path, "full", **kwargs)
    backup_dir = str(tmp_path / "backup")
    rng = random.Random(31)
    # Where kills landed (timing decides it), for the record.
    cut_short = {"staged": 0, "uncommitted": 0, "unpruned": 0}
    for kill in range(20):
        committed = backup_and_restore._generations(backup_dir)
        steps = []  # (step, when its marker arrived)
        fraction = rng.random()

        def kill_when(line):
            match = re.fullmatch(r"STEP (\d+);", line)
            if match is None:
                return None
            steps.append((int(match.group(1)), time.monotonic()))
            if len(steps) < 2:
                return None
            # A random point of the next step, sized by the last one.
            return fraction * (steps[-1][1] - steps[-2][1])

        code, lines = forks.run(backup_dir=backup_dir,
                                result=str(tmp_path / "killed.npz"),
                                kill_when=kill_when, **kwargs)
        assert code == -signal.SIGKILL, (kill, lines[-5:])
        assert resumed_from(lines) == (committed[0] if committed else None)
        names = os.listdir(backup_dir)
        gens = [n for n in names if n.startswith("gen-")]
        cut_short["staged"] += any(n.startswith(".tmp-") for n in names)
        cut_short["uncommitted"] += len(gens) > len(
            backup_and_restore._generations(backup_dir))
        cut_short["unpruned"] += len(
            backup_and_restore._generations(backup_dir)) > 1
    committed = backup_and_restore._generations(backup_dir)
    code, lines = forks.run(backup_dir=backup_dir,
                            result=str(tmp_path / "resumed.npz"), **kwargs)
    if code != 0:
        forks.fail(f"the last rerun exited with {code}")
    assert resumed_from(lines) == committed[0]
    with np.load(tmp_path / "resumed.npz") as saved:
        assert int(saved["iterations"]) == full_steps == 64
        weights = [saved[f"arr_{i}"] for i in range(len(full))]
    assert max_diff(weights, full) <= 1e-6
    print(f"kills that left a write cut short: {cut_short}")
