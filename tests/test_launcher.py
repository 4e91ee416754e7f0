import os
import signal
import tempfile
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


def test_workers_inherit_the_environment_as_it_is(run_workers, tmp_path,
                                                  monkeypatch):
    """Nothing is added to PYTHONPATH: a worker run by another interpreter,
    and every process a worker starts, sees the launcher's environment
    (the launcher's `sys.path` there broke `/usr/bin/python3` workers). A
    function target still imports from where the launcher does."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    script = tmp_path / "env.py"
    script.write_text(textwrap.dedent("""
        import json, os, subprocess, sys
        child = subprocess.run(
            [sys.executable, "-c", "import os; print(os.environ.get("
             "'PYTHONPATH', 'unset'))"], capture_output=True, text=True)
        with open(os.environ["KERAS_MGPU_RESULT"], "w") as f:
            json.dump({"mine": os.environ.get("PYTHONPATH", "unset"),
                       "child": child.stdout.strip()}, f)
    """))
    results = run_workers(str(script), 2)
    assert [r.result for r in results] == [
        {"mine": "unset", "child": "unset"}] * 2
    # Run elsewhere, `tests.workers` is importable from the launcher's
    # `sys.path` (the repository root) only.
    assert run_workers(workers.echo, 1, kwargs={"value": 1},
                       cwd=str(tmp_path))[0].result["value"] == 1


@pytest.mark.parametrize("exit_code", [0, 3])
def test_output_that_is_not_utf8_is_kept_with_replacements(run_workers,
                                                           tmp_path,
                                                           exit_code):
    """A worker writing bytes that are not UTF-8 crashed the launcher
    (`UnicodeDecodeError`), even when it succeeded."""
    script = tmp_path / "bytes.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.stdout.buffer.write(b"ok \\xff\\xfe end\\n")
        sys.stderr.buffer.write(b"\\x80 failed\\n")
        sys.exit({exit_code})
    """))
    if exit_code:
        with pytest.raises(launcher.WorkerError) as info:
            run_workers(str(script), 2)
        assert "\ufffd failed" in str(info.value)
        results = info.value.results
    else:
        results = run_workers(str(script), 2)
    assert [r.stdout for r in results] == ["ok \ufffd\ufffd end\n"] * 2
    assert [r.returncode for r in results][0] == exit_code


@pytest.mark.parametrize("exit_code", [0, 3])
def test_what_a_worker_started_ends_with_the_run(run_workers, tmp_path,
                                                 exit_code):
    """A worker's own child (its process group) is gone when the run
    returns or raises, the worker having exited or not; it lived on."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess, sys
        child = subprocess.Popen(["sleep", "600"])
        print(child.pid, flush=True)
        sys.exit({exit_code})
    """))
    if exit_code:
        with pytest.raises(launcher.WorkerError) as info:
            run_workers(str(script), 2)
        results = info.value.results
    else:
        results = run_workers(str(script), 2)
    from tests.test_launch_signals import gone

    pids = [int(result.stdout.split()[0]) for result in results]
    assert all(gone(pid) for pid in pids), pids


def test_the_open_file_limit_is_raised_or_named_before_any_worker_starts(
        tmp_path):
    """Above about 500 workers, a limit of 1024 open files failed the
    launch midway (`Too many open files`). In a child process, whose
    limits the test may lower."""
    import resource
    import subprocess
    import sys

    script = tmp_path / "job.py"
    started = tmp_path / "started"
    script.write_text(f"open({str(started)!r}, 'w').close()\n")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    hard = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    fits = (hard - 64) // 3  # workers whose files the hard limit holds
    code = textwrap.dedent(f"""
        import resource
        from keras_mgpu import launcher
        from keras_mgpu.cluster import processes
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, {hard}))
        processes.check_open_files({fits})  # raises the soft limit
        print("LIMIT", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 1024))
        try:
            launcher.run_local_workers({str(script)!r}, 1000)
        except ValueError as e:
            print("REFUSED", e)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120)
    assert f"LIMIT {fits * 3 + 64}" in done.stdout, done.stderr[-3000:]
    assert ("REFUSED 1000 workers need about 3064 open files in the "
            "launcher, above this process's limit of 1024 (ulimit -Hn)"
            in done.stdout), done.stdout + done.stderr[-3000:]
    assert not started.exists()


def test_memory_stays_bounded_whatever_a_worker_prints(tmp_path):
    """A 100 MB output line, echoed and collected: the launcher keeps the
    tail (it read every attempt's output whole: 200 MB took it from 0.83
    to 1.85 GB). Measured in a child, whose peak memory is its own."""
    import subprocess
    import sys

    script = tmp_path / "loud.py"
    script.write_text(textwrap.dedent("""
        import sys
        sys.stdout.buffer.write(b"start\\n" + b"x" * 100_000_000
                                + b"\\nREADY end\\n")
    """))
    code = textwrap.dedent(f"""
        import os, resource
        from keras_mgpu import launcher
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with open(os.devnull, "w") as sink:
            result = launcher.run_local_workers(
                {str(script)!r}, 1, echo=sink, kill_when_printed="NEVER")[0]
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print("GROWN_MB", grown // 1024)
        print("KEPT", len(result.stdout), result.stdout[:60])
        print("TAIL", result.stdout.endswith("x\\nREADY end\\n"))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=300)
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines()
                 if line.split(" ", 1)[0] in ("GROWN_MB", "KEPT", "TAIL"))
    assert set(lines) == {"GROWN_MB", "KEPT", "TAIL"}, done.stderr[-3000:]
    assert int(lines["GROWN_MB"]) < 40, lines
    kept, head = lines["KEPT"].split(" ", 1)
    from keras_mgpu.cluster.output import KEPT_BYTES

    assert int(kept) < 2 * KEPT_BYTES
    assert head.startswith("[... 98951") and "earlier bytes" in head
    assert lines["TAIL"] == "True"


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


def test_a_requested_kill_ends_the_workers_left_waiting(run_workers):
    # Worker 0 would wait for the killed worker 1 until the timeout (as a
    # tuning chief waits for its trial): it is stopped as after a failure.
    results = run_workers(workers.print_on_one_then_sleep, 2,
                          kwargs={"marker": "READY", "printer": 1,
                                  "seconds": 600},
                          kill_when_printed="READY", kill_workers=[1],
                          timeout=300)
    assert [r.killed for r in results] == [True, True]
    assert [r.returncode for r in results] == [-signal.SIGKILL] * 2
    assert results[0].stdout == "" and "READY" in results[1].stdout


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


@pytest.mark.parametrize("options, error, match", [
    ({"timeout": "10"}, ValueError,
     "timeout must be a positive, finite number of seconds, got '10'"),
    ({"timeout": None}, ValueError, "got None. Pass a number"),
    ({"timeout": 0}, ValueError, "got 0. Pass a number"),
    ({"timeout": float("nan")}, ValueError, "got nan. Pass a number"),
    ({"timeout": True}, ValueError, "got True. Pass a number"),
    ({"num_workers": 2.0}, ValueError,
     "num_workers must be a positive integer, got 2.0"),
    ({"num_workers": True}, ValueError,
     "num_workers must be a positive integer, got True"),
    ({"kill_when_printed": ""}, ValueError,
     "kill_when_printed must be non-empty text"),
    ({"kill_when_printed": b"up"}, TypeError,
     "kill_when_printed must be a str .*got b'up'"),
    ({"kill_when_printed": "up", "kill_workers": [2]}, ValueError,
     r"indices from 0 to 1 \(num_workers=2\), got \[2\]"),
    ({"kill_when_printed": "up", "kill_workers": 1}, TypeError,
     "kill_workers must be a list of worker indices, got 1"),
    ({"kill_workers": [1]}, ValueError,
     r"kill_workers=\[1\] needs kill_when_printed"),
    ({"kill_signal": 0}, ValueError,
     "kill_signal must be a signal this platform knows.*got 0"),
    ({"check": "no"}, TypeError, "check must be True or False, got 'no'"),
    ({"cwd": "no-such-dir"}, FileNotFoundError,
     "cwd 'no-such-dir' is not a directory"),
    ({"args": "--flag"}, TypeError,
     r"args must be a list .*got '--flag'. Split it"),
    ({"args": ["--epochs", 2]}, TypeError, r"args must all be strings, got \[2\]"),
    ({"kwargs": {"epochs": 2}}, ValueError,
     r"kwargs are for a function target.*Pass command-line arguments"),
    ({"env": {"CUDA_VISIBLE_DEVICES": 0}}, TypeError,
     r"env must map strings to strings, got \{'CUDA_VISIBLE_DEVICES': 0\}"),
    ({"env": lambda i: {"RANK": i}}, TypeError,
     r"env\(0\) must map strings to strings, got \{'RANK': 0\}"),
])
def test_bad_arguments_are_refused_before_any_worker_starts(
        tmp_path, options, error, match):
    started = tmp_path / "started"
    script = tmp_path / "job.py"
    script.write_text(f"open({str(started)!r}, 'w').close()\n")
    env_calls = []

    def env(index):
        env_calls.append(index)
        return {}

    options = {"num_workers": 2, "env": env, **options}
    num_workers = options.pop("num_workers")
    with pytest.raises(error, match=match):
        launcher.run_local_workers(str(script), num_workers, **options)
    # env(i) runs before worker i starts: no call, no worker (nor its file).
    assert env_calls == [] and not started.exists()


def test_a_command_that_cannot_run_is_named_before_any_worker_starts(
        tmp_path, run_workers):
    """Where the workers' `Popen` looks: their `PATH` (the launcher's, or
    `env`'s), or a path relative to `cwd`."""
    with pytest.raises(FileNotFoundError,
                       match="'no-such-program' is not found on PATH"):
        launcher.run_local_workers(["no-such-program", "--flag"], 2)
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\necho ran\n")
    with pytest.raises(PermissionError,
                       match="'./tool' is not an executable file"):
        launcher.run_local_workers(["./tool"], 2, cwd=str(tmp_path))
    tool.chmod(0o755)
    assert run_workers(["./tool"], 1, cwd=str(tmp_path))[0].stdout == "ran\n"
    with pytest.raises(FileNotFoundError, match="'tool' is not found"):
        launcher.run_local_workers(["tool"], 1)
    assert run_workers(["tool"], 1, env={"PATH": str(tmp_path)})[
        0].stdout == "ran\n"


def test_function_target_refuses_unimportable_and_unserialisable_input():
    with pytest.raises(ValueError, match="only a module-level function"):
        launcher.run_local_workers(lambda: None, 1)
    with pytest.raises(ValueError, match=r"args are for a script target"):
        launcher.run_local_workers(workers.echo, 1, args=["x"])
    with pytest.raises(TypeError, match=(
            r"kwargs must be JSON-serialisable.*\{'value': \{1, 2\}\}")):
        launcher.run_local_workers(workers.echo, 1, kwargs={"value": {1, 2}})


@pytest.mark.parametrize("n", [-1, "2", 2.0, True])
def test_free_ports_refuses_a_non_count(n):
    with pytest.raises(ValueError, match=f"an integer >= 0\\), got {n!r}"):
        launcher.free_ports(n)


# A script worker, fast to start (no TensorFlow): it writes a line to stderr,
# then exits 3 if it is the worker named by its argument, else 0; or, with
# "hang", waits for a signal until the launcher kills it.
NOISY_SCRIPT = """
import json, os, signal, sys
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
print(f"noise from worker {index}", file=sys.stderr, flush=True)
if sys.argv[1] == "hang":
    signal.pause()
sys.exit(3 if index == int(sys.argv[1]) else 0)
"""


@pytest.fixture
def noisy_script(tmp_path):
    path = tmp_path / "noisy.py"
    path.write_text(NOISY_SCRIPT)
    return str(path)


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """An empty folder that `tempfile` uses instead of the system's."""
    root = tmp_path / "tmp"
    root.mkdir()
    # tempfile caches its folder: TMPDIR alone would be read only once.
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def test_worker_files_are_removed_however_the_run_ends(noisy_script,
                                                       temp_root):
    results = launcher.run_local_workers(noisy_script, 2, args=["-1"],
                                         timeout=60)
    assert [r.returncode for r in results] == [0, 0]
    # Read before the files went.
    assert results[1].stderr == "noise from worker 1\n"
    assert os.listdir(temp_root) == []

    with pytest.raises(launcher.WorkerError) as info:
        launcher.run_local_workers(noisy_script, 2, args=["1"], timeout=60)
    assert info.value.results[1].returncode == 3
    assert "noise from worker 1" in info.value.results[1].stderr
    assert os.listdir(temp_root) == []

    # Raised inside the wait, not after it.
    with pytest.raises(launcher.WorkerError, match="timed out"):
        launcher.run_local_workers(noisy_script, 2, args=["hang"], timeout=2)
    assert os.listdir(temp_root) == []


def test_worker_stderr_is_shown_only_when_the_worker_fails(noisy_script,
                                                           capfd):
    results = launcher.run_local_workers(noisy_script, 2, args=["-1"],
                                         timeout=60)
    assert "noise from worker 1" in results[1].stderr
    assert "noise from worker" not in "".join(capfd.readouterr())

    with pytest.raises(launcher.WorkerError) as info:
        launcher.run_local_workers(noisy_script, 2, args=["1"], timeout=60)
    assert "noise from worker" not in "".join(capfd.readouterr())
    message = str(info.value)
    assert "worker 1 (exit 3) stderr tail:\nnoise from worker 1" in message
