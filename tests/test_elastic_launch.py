"""`launch` with `min_workers`: a run that loses a worker for good goes on
with fewer, and is the same run (real processes on 127.0.0.1)."""

import io

from keras_mgpu import launcher
from keras_mgpu.goodput import read_job
from tests import elastic_workers
from tests.workers import max_diff

QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "-1"}
ITERATIONS = elastic_workers.EPOCHS * elastic_workers.STEPS


def uninterrupted(workers, tmp_path):
    results = launcher.run_local_workers(
        elastic_workers.train, workers, timeout=300, env=QUIET,
        kwargs={"backup_dir": str(tmp_path / f"on{workers}")})
    return [r.result for r in results]


def test_a_run_that_loses_a_worker_for_good_goes_on_as_the_same_run(
        tmp_path):
    """3 workers; worker 2 dies after step 5 and then as it starts, every
    time: the run goes on with 2 and ends as the uninterrupted 3-worker
    run (and a 2-worker one) with the same global batch."""
    report = io.StringIO()
    result = launcher.launch(
        elastic_workers.train, 3, min_workers=2, max_restarts=3, backoff=0,
        timeout=600, report=report,
        env=lambda i: {**QUIET, "SLOT": str(i)},
        kwargs={"backup_dir": str(tmp_path / "backup"),
                "failing_slot": "2", "log_dir": str(tmp_path / "logs")})
    assert [len(a.returncodes) for a in result.attempts] == [3, 3, 2], (
        report.getvalue())
    assert [a.failed for a in result.attempts[:2]] == [(2,), (2,)]
    assert ("worker 2 failed in 2 attempts in a row: restarting without "
            "it, on 2 workers (min_workers=2)") in report.getvalue()
    # The logger's records carry the replica count; the goodput report
    # marks where it changed (attempt 2 of the launch never trained).
    job = read_job(str(tmp_path / "logs"))
    assert [a.launch_attempt for a in job.attempts] == [1, 3]
    assert [a.replicas for a in job.attempts] == [3, 2]
    assert "from attempt 2: 2 replicas (3 before)" in job.table()
    # From its backup, not from the start.
    assert ("BackupAndRestore: resumed from backup generation"
            in result.results[0].stdout), result.results[0].stdout
    shrunk = [r.result for r in result.results]
    on3, on2 = uninterrupted(3, tmp_path), uninterrupted(2, tmp_path)
    for run in (shrunk, on2):
        assert [r["replicas"] for r in run] == [2, 2]
    assert [r["replicas"] for r in on3] == [3, 3, 3]
    for run in (shrunk, on3, on2):
        assert [r["iterations"] for r in run] == [ITERATIONS] * len(run)
    for worker in shrunk:
        assert max_diff(worker["weights"], on3[0]["weights"]) <= 1e-6
        assert max_diff(worker["weights"], on2[0]["weights"]) <= 1e-6
