"""BackupAndRestore on JAX, 2 devices: a run SIGKILLed mid-epoch and run
again ends with the weights and optimizer steps of the run that was never
killed. Real processes (`keras_mgpu.launcher`), each killed at a printed
step (`backup_workers.py`). TensorFlow's kill tests of the same cases
(plain, window accumulation mid-window, in-step) are in
tests/test_backup_and_restore.py and tests/test_runtime.py; SIGTERM across
JAX processes is in test_jax_processes.py."""

import signal

import pytest

from keras_mgpu.callbacks.backup import generation as generation_lib
from tests.jax import backup_workers
from tests.workers import max_diff


def run(run_workers, backup_dir, kill_at=None, **kwargs):
    """Runs `backup_workers.train`; SIGKILLs it at `STEP <kill_at>;`."""
    options = ({} if kill_at is None
               else {"kill_when_printed": f"STEP {kill_at};"})
    return run_workers(backup_workers.train, 1,
                       kwargs={"backup_dir": str(backup_dir),
                               "kill_at": kill_at, **kwargs}, **options)


# (accumulation, kills, optimizer steps of 3 epochs of 8 batches). Saves
# every 4 batches: with windows of 3 a kill at 5 or 13 lands mid-window,
# after a save made mid-window; two kills in a row resume a resumed run.
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

