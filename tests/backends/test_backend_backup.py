"""BackupAndRestore on the active Keras backend, 2 replicas: a run killed
mid-epoch (SIGKILL, or SIGTERM answered by a save) and run again ends with
the weights and optimizer steps of the run that was never killed. Real
processes (`keras_mgpu.launcher`), each killed at a printed step."""

import signal

import pytest

from keras_mgpu.callbacks.backup import RESTART_EXIT_CODE
from keras_mgpu.callbacks.backup import generation as generation_lib
from tests.backends import backup_workers
from tests.workers import max_diff


def run(run_workers, backup_dir, kill_at=None, kill_signal=signal.SIGKILL,
        num_workers=1, **kwargs):
    """Runs `backup_workers.train`; sends `kill_signal` at `STEP <kill_at>;`."""
    options = {}
    if kill_at is not None:
        options = {"kill_when_printed": f"STEP {kill_at};",
                   "kill_signal": kill_signal,
                   "check": kill_signal == signal.SIGKILL}
    return run_workers(backup_workers.train, num_workers,
                       kwargs={"backup_dir": str(backup_dir),
                               "kill_at": kill_at, **kwargs}, **options)


# (accumulation, kills, optimizer steps of 3 epochs of 8 batches). Saves
# every 4 batches: with windows of 3 a kill at 5 or 13 lands mid-window,
# after a save made mid-window.
CASES = {
    "plain": ({}, (13,), 24),
    "window": ({"accum_steps": 3}, (5, 13), 9),
    "in_step": ({"accum_steps": 3, "mode": "in_step"}, (13,), 24),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sigkill_mid_epoch_resumes_exactly(run_workers, tmp_path, case):
    kwargs, kills, steps = CASES[case]
    full = run(run_workers, tmp_path / "uninterrupted", **kwargs)[0].result
    backup_dir = tmp_path / "backup"
    for kill_at in kills:
        killed = run(run_workers, backup_dir, kill_at=kill_at, **kwargs)[0]
        assert killed.killed and killed.returncode == -signal.SIGKILL
        assert generation_lib.generations(str(backup_dir))
    resumed = run(run_workers, backup_dir, **kwargs)[0]
    assert "resumed from backup generation" in resumed.stdout
    assert resumed.result["iterations"] == full["iterations"] == steps
    assert resumed.result["global_step"] == full["global_step"] == 24
    assert max_diff(resumed.result["weights"], full["weights"]) <= 1e-6
    assert not backup_dir.exists(), "a finished run deletes its backups"


def test_sigterm_saves_exits_to_be_rerun_and_resumes_exactly(run_workers,
                                                              tmp_path):
    kwargs = {"accum_steps": 3, "save_freq": 10**6}  # only the SIGTERM save
    full = run(run_workers, tmp_path / "uninterrupted", **kwargs)[0].result
    backup_dir = tmp_path / "backup"
    stopped = run(run_workers, backup_dir, kill_at=10,
                  kill_signal=signal.SIGTERM, **kwargs)[0]
    assert stopped.returncode == RESTART_EXIT_CODE, stopped.stderr[-3000:]
    # Saved at the batch after the signal's: 12 batches trained.
    assert "SIGTERM received; saved generation 1 at epoch 1, batch 4" in (
        stopped.stderr)
    resumed = run(run_workers, backup_dir, **kwargs)[0]
    assert resumed.result["iterations"] == full["iterations"] == 9
    assert max_diff(resumed.result["weights"], full["weights"]) <= 1e-6
