"""`launch` with `min_workers`: a run that loses a worker for good goes on
with fewer, and one whose worker comes back grows again on SIGUSR1; each
is the same run as the uninterrupted ones (real processes on 127.0.0.1)."""

import io
import os

import pytest

from keras_mgpu import launcher
from keras_mgpu.goodput import read_job
from tests import elastic_workers
from tests.workers import max_diff

QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "-1"}
ITERATIONS = elastic_workers.EPOCHS * elastic_workers.STEPS


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted 3- and 2-worker runs' results, by worker count."""
    runs = {}
    for workers in (3, 2):
        results = launcher.run_local_workers(
            elastic_workers.train, workers, timeout=300, env=QUIET,
            kwargs={"backup_dir": str(tmp_path_factory.mktemp("backup"))})
        runs[workers] = [r.result for r in results]
    assert [(r["replicas"], r["accum_steps"]) for r in runs[3]] == [(3, 2)] * 3
    assert [(r["replicas"], r["accum_steps"]) for r in runs[2]] == [(2, 3)] * 2
    for run in runs.values():
        assert [r["iterations"] for r in run] == [ITERATIONS] * len(run)
    return runs


def elastic_launch(tmp_path, **kwargs):
    """3 workers under `launch(min_workers=2)`, worker 2 failing: the
    result, and the report followed by what the workers printed."""
    report, echo = io.StringIO(), io.StringIO()
    result = launcher.launch(
        elastic_workers.train, 3, min_workers=2, max_restarts=3, backoff=0,
        timeout=600, report=report, echo=echo,
        env=lambda i: {**QUIET, "SLOT": str(i),
                       "LAUNCHER_PID": str(os.getpid())},
        kwargs={"backup_dir": str(tmp_path / "backup"),
                "failing_slot": "2", "log_dir": str(tmp_path / "logs"),
                **kwargs})
    return result, report.getvalue() + echo.getvalue()


def assert_the_same_run(result, uninterrupted, workers):
    finished = [r.result for r in result.results]
    assert [(r["replicas"], r["iterations"]) for r in finished] == [
        (workers, ITERATIONS)] * workers
    for worker in finished:
        for run in uninterrupted.values():
            assert max_diff(worker["weights"], run[0]["weights"]) <= 1e-6


def test_a_run_that_loses_a_worker_for_good_goes_on_as_the_same_run(
        tmp_path, uninterrupted):
    """3 workers; worker 2 dies after batch 5 and then as it starts, every
    time: the run goes on with 2 and ends as the uninterrupted 3-worker
    run (and a 2-worker one) with the same global batch, of 3 micro-batches
    per step on 2 workers where it took 2 on 3."""
    result, report = elastic_launch(tmp_path)
    assert [len(a.returncodes) for a in result.attempts] == [3, 3, 2], report
    assert [a.failed for a in result.attempts[:2]] == [(2,), (2,)]
    assert ("worker 2 failed in 2 attempts in a row: restarting without "
            "it, on 2 workers (min_workers=2; ") in report
    # The logger's records carry the replica count; the goodput report
    # marks where it changed (attempt 2 of the launch never trained).
    job = read_job(str(tmp_path / "logs"))
    assert [a.launch_attempt for a in job.attempts] == [1, 3]
    assert [a.replicas for a in job.attempts] == [3, 2]
    assert "from attempt 2: 2 replicas (3 before)" in job.table()
    # From its backup, not from the start.
    assert ("BackupAndRestore: resumed from backup generation"
            in result.results[0].stdout), result.results[0].stdout
    assert [r.result["accum_steps"] for r in result.results] == [3, 3]
    assert_the_same_run(result, uninterrupted, 2)


def test_a_worker_that_comes_back_grows_the_run_again(tmp_path,
                                                      uninterrupted):
    """Worker 2 fails in attempts 1 and 2 only; on 2 workers, worker 0 asks
    the launcher to grow (SIGUSR1) after 8 batches, mid-window: the
    launcher's SIGTERM save waits for the window's end, and attempt 4 ends
    on 3 workers as the uninterrupted runs."""
    result, report = elastic_launch(tmp_path, fails_until=2, grow_after=8)
    assert [len(a.returncodes) for a in result.attempts] == [3, 3, 2, 3], (
        report)
    assert ("Restarting all 3 workers, worker 2 back (not counted against "
            "max_restarts).") in report
    assert ("[worker 0] BackupAndRestore: SIGTERM received; saved "
            "generation") in report
    job = read_job(str(tmp_path / "logs"))
    assert [a.replicas for a in job.attempts] == [3, 2, 3]
    assert [r.result["accum_steps"] for r in result.results] == [2, 2, 2]
    assert_the_same_run(result, uninterrupted, 3)
