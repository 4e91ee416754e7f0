"""BackupAndRestore under SIGKILL at every stage of a commit, and at random.

Each run is a real process (forked from one that imported TensorFlow once,
`backup_workers.serve_forks`) killed with a real SIGKILL; the rerun must
resume from the last committed generation and end where an uninterrupted
run ends.
"""

import os
import random
import re
import signal
import time

import numpy as np
import pytest

from keras_mgpu.callbacks.backup import generation as generation_lib
from tests import backup_workers


@pytest.fixture(scope="module")
def forks(tmp_path_factory):
    server = backup_workers.Forks(str(tmp_path_factory.mktemp("forks")))
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
    """The generation a run restored, or None."""
    for line in lines:
        match = re.fullmatch(r"RESTORED (\d+);", line)
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
        assert generation_lib.generations(backup_dir) == committed
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
        committed = generation_lib.generations(backup_dir)
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
            generation_lib.generations(backup_dir))
        cut_short["unpruned"] += len(
            generation_lib.generations(backup_dir)) > 1
    committed = generation_lib.generations(backup_dir)
    code, lines = forks.run(backup_dir=backup_dir,
                            result=str(tmp_path / "resumed.npz"), **kwargs)
    if code != 0:
        forks.fail(f"the last rerun exited with {code}")
    assert resumed_from(lines) == committed[0]
    assert any(f"resumed from backup generation {committed[0]} " in line
               for line in lines), lines
    with np.load(tmp_path / "resumed.npz") as saved:
        assert int(saved["iterations"]) == full_steps == 64
        weights = [saved[f"arr_{i}"] for i in range(len(full))]
    assert max_diff(weights, full) <= 1e-6
    print(f"kills that left a write cut short: {cut_short}")


def _truncate_newest_local_weights(local_dir):
    newest = generation_lib.generation_dir(
        local_dir, generation_lib.generations(local_dir)[0])
    with open(os.path.join(newest, "weights.weights.h5"), "r+b") as f:
        f.truncate(100)


@pytest.mark.parametrize("damage, resumed_line, warning", [
    # Local saves every 3 steps and with each durable one (step 8): a kill
    # at step 13 leaves local generations 4 (step 9) and 5 (step 12), and
    # durable generation 1 (step 8).
    (None, "resumed from local generation 5 at epoch 2, step 4", None),
    (_truncate_newest_local_weights,
     "resumed from local generation 4 at epoch 2, step 1",
     r"local generation 5 in \S+ is unusable \(weights.weights.h5 has 100 "
     r"bytes, the manifest says \d+\); removed"),
    (lambda local_dir: __import__("shutil").rmtree(local_dir),
     "resumed from backup generation 1 at the start of epoch 2", None),
], ids=["local", "damaged-local", "lost-local"])
def test_the_local_tier_resumes_exactly_from_local_and_durable_copies(
        forks, tmp_path, damage, resumed_line, warning):
    kwargs = {"save_freq": 8, "keep": 1, "epochs": 2, "steps": 8}
    full, full_steps = finished(forks, tmp_path, "full", **kwargs)
    backup_dir = str(tmp_path / "backup")
    local_root = tmp_path / "local"
    local = {"local_dir": str(local_root), "local_save_freq": 3}
    code, lines = forks.run(
        backup_dir=backup_dir, result=str(tmp_path / "killed.npz"),
        settle_at=13, kill_when=lambda line: 0.0 if line == "STEP 13;"
        else None, **local, **kwargs)
    assert code == -signal.SIGKILL, lines
    local_dir = str(local_root / "worker-0")
    assert generation_lib.generations(local_dir) == [5, 4]
    assert generation_lib.generations(backup_dir) == [1]
    if damage is not None:
        damage(local_dir)
    warnings_before = forks.stderr()
    code, lines = forks.run(backup_dir=backup_dir,
                            result=str(tmp_path / "resumed.npz"),
                            **local, **kwargs)
    if code != 0:
        forks.fail(f"the rerun exited with {code}")
    assert any(resumed_line in line for line in lines), lines
    new_stderr = forks.stderr()[len(warnings_before):]
    if warning is None:
        assert "unusable" not in new_stderr, new_stderr[-3000:]
    else:
        assert re.search(warning, new_stderr), new_stderr[-3000:]
    with np.load(tmp_path / "resumed.npz") as saved:
        assert int(saved["iterations"]) == full_steps == 16
        weights = [saved[f"arr_{i}"] for i in range(len(full))]
    assert max_diff(weights, full) <= 1e-6
    # A finished run deletes both tiers.
    assert not os.path.exists(backup_dir)
    assert not os.path.exists(local_dir)
