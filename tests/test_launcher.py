import signal
import textwrap

import pytest

from keras_mgpu import launcher
from tests import workers


def test_function_target_reports_json_per_worker(run_workers):
    results = run_workers(workers.echo, 3, kwargs={"value": [1, 2]})
    assert [r.result["worker_index"] for r in results] == [0, 1, 2]
    assert [r.result["is_chief"] for r in results] == [True, False, False]
    assert all(r.result["num_workers"] == 3 for r in results)
    assert all(r.result["value"] == [1, 2] for r in results)
    assert all(r.returncode == 0 and not r.killed for r in results)


def test_script_target_writes_result_file(run_workers, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        with open(os.environ["KERAS_MGPU_RESULT"], "w") as f:
            json.dump({"argv": sys.argv[1:],
                       "tf_config": json.loads(os.environ["TF_CONFIG"])}, f)
    """))
    results = run_workers(str(script), 2, args=["--flag", "x"])
    assert results[0].result["argv"] == ["--flag", "x"]
    addresses = results[0].result["tf_config"]["cluster"]["worker"]
    assert len(set(addresses)) == 2
    assert [r.result["tf_config"]["task"]["index"] for r in results] == [0, 1]


def test_failing_worker_raises_with_its_stderr(run_workers):
    with pytest.raises(launcher.WorkerError) as info:
        run_workers(workers.fail, 2, kwargs={"message": "boom-from-worker-1"})
    assert "boom-from-worker-1" in str(info.value)
    assert info.value.results[1].returncode == 3


def test_timeout_kills_every_worker(run_workers):
    with pytest.raises(launcher.WorkerError, match="timed out after 8s") as info:
        run_workers(workers.print_then_sleep, 2,
                    kwargs={"marker": "up", "seconds": 600}, timeout=8)
    # Killed by the launcher, whether or not they got as far as printing.
    assert [r.returncode for r in info.value.results] == [-signal.SIGKILL] * 2


def test_kill_when_printed_kills_requested_workers(run_workers):
    results = run_workers(workers.print_then_sleep, 2,
                          kwargs={"marker": "READY", "seconds": 600},
                          kill_when_printed="READY", kill_signal=signal.SIGTERM)
    assert [r.killed for r in results] == [True, True]
    assert [r.returncode for r in results] == [-signal.SIGTERM] * 2


def test_bad_targets_are_rejected():
    def local():
        pass

    local.__module__ = "__main__"
    with pytest.raises(ValueError, match="__main__"):
        launcher.run_local_workers(local, 1)
    with pytest.raises(FileNotFoundError, match="no_such.py"):
        launcher.run_local_workers("no_such.py", 1)
    with pytest.raises(ValueError, match="neither"):
        launcher.run_local_workers("not_a_target", 1)
    with pytest.raises(ValueError, match="num_workers"):
        launcher.run_local_workers(workers.echo, 0)


def test_free_ports_are_distinct():
    ports = launcher.free_ports(4)
    assert len(set(ports)) == 4
