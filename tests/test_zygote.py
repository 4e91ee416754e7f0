"""The suite's forked workers (tests/zygote.py) run, end and report as the
fresh interpreters the launcher starts do, so that no test passes only
because of how its workers were started."""

import atexit
import json
import os
import select
import signal
import sys
import tempfile

import pytest

from keras_mgpu import launcher
from tests import zygote

QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "-1"}


def describe(marker):
    """What a worker is: printed, returned, and printed at its exit."""
    atexit.register(print, f"atexit {marker}", flush=True)
    print(f"stdout {marker}", flush=True)
    print(f"stderr {marker}", file=sys.stderr, flush=True)
    return {"session": os.getsid(0) == os.getpid(), "cwd": os.getcwd(),
            "task": json.loads(os.environ["TF_CONFIG"])["task"],
            "result_file": os.path.basename(
                os.environ[launcher.RESULT_ENV]),
            "argv": sys.argv[1:2],
            "tempdir": tempfile.gettempdir(),
            "tensorflow_imported": "tensorflow" in sys.modules}


def end(how):
    """Ends the worker as `how` says."""
    if how == "raise":
        raise ValueError("raised on purpose")
    if how == "exit":
        sys.exit(3)
    if how == "interrupt":
        raise KeyboardInterrupt
    os.kill(os.getpid(), signal.SIGTERM)


def run(tmp_path, forked, target, env=QUIET, **kwargs):
    """`run_local_workers` on 2 workers, started fresh or by fork."""
    from keras_mgpu.cluster import workers

    current = workers._start_worker
    workers._start_worker = getattr(current, "fresh", current)
    undo = zygote.install(workers) if forked else None
    cwd = tmp_path / ("forked" if forked else "fresh")
    cwd.mkdir()
    try:
        return launcher.run_local_workers(target, 2, timeout=120,
                                          cwd=str(cwd), check=False,
                                          env=env, **kwargs)
    finally:
        if undo is not None:
            undo()
        workers._start_worker = current


def test_a_forked_worker_is_what_a_fresh_one_is(tmp_path):
    # A TMPDIR of each worker's own: read as the worker runs, not as its
    # zygote imported TensorFlow.
    for i in range(2):
        (tmp_path / f"tmp{i}").mkdir()
    runs = {forked: run(tmp_path, forked, "tests.test_zygote:describe",
                        env=lambda i: {**QUIET,
                                       "TMPDIR": str(tmp_path / f"tmp{i}")},
                        kwargs={"marker": "m"})
            for forked in (False, True)}
    for forked, results in runs.items():
        for r in results:
            assert r.returncode == 0, r.stderr
            assert r.stdout.splitlines() == ["stdout m", "atexit m"]
            assert r.stderr.splitlines() == ["stderr m"]
            assert r.result == {
                "session": True,
                "cwd": str(tmp_path / ("forked" if forked else "fresh")),
                "task": {"type": "worker", "index": r.index},
                "result_file": f"result{r.index}.json",
                "argv": ["tests.test_zygote:describe"],
                "tempdir": str(tmp_path / f"tmp{r.index}"),
                # The fork's parent imported TensorFlow; this module does
                # not.
                "tensorflow_imported": forked}


@pytest.mark.parametrize("how, code", [("raise", 1), ("exit", 3),
                                        ("interrupt", -signal.SIGINT),
                                        ("signal", -signal.SIGTERM)])
def test_a_forked_worker_ends_as_a_fresh_one_does(tmp_path, how, code):
    for forked in (False, True):
        results = run(tmp_path, forked, "tests.test_zygote:end",
                      kwargs={"how": how})
        assert [r.returncode for r in results] == [code, code]
        if how == "raise":
            assert all(r.stderr.rstrip().endswith(
                "ValueError: raised on purpose") for r in results)


def test_the_forks_end_with_their_zygote(tmp_path):
    z = zygote.Zygote(dict(os.environ, **QUIET))
    try:
        worker = z.start("import time\nprint('up', flush=True)\n"
                         "time.sleep(600)\n", ["-c"], dict(os.environ),
                         str(tmp_path), os.devnull, os.devnull)
        gone = os.pidfd_open(worker.pid)
        os.kill(z._proc.pid, signal.SIGKILL)
        assert worker.wait(timeout=60) == -signal.SIGKILL
        assert select.select([gone], [], [], 60)[0] == [gone]
        os.close(gone)
    finally:
        z.close()
