"""`keras-mgpu launch` and `keras_mgpu.launcher.launch`: a local cluster
started again when a worker dies, with real processes on 127.0.0.1; SLURM
steps and Kubernetes (TFJob) clusters as `auto_strategy()` reads them."""

import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from keras_mgpu import launcher, slurm
from keras_mgpu.goodput import read_job
from tests import backup_workers
from tests.workers import max_diff

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERAS_MGPU = os.path.join(os.path.dirname(sys.executable), "keras-mgpu")
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "-1"}
# 3 epochs of 8 batches, windows of 3, a save every 4 batches.
TRAIN = {"accum_steps": 3, "save_freq": 4}


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """The uninterrupted 2-worker run (the launcher's TF_CONFIG cluster)."""
    backup_dir = tmp_path_factory.mktemp("uninterrupted") / "backup"
    results = launcher.run_local_workers(
        backup_workers.train, 2, timeout=240, env=QUIET,
        kwargs={"backup_dir": str(backup_dir), **TRAIN})
    return [r.result for r in results]


def assert_trains_as(two_workers, env, tmp_path):
    """Two workers with the environment `env(index)` end with the weights
    and steps of the launcher's 2-worker run."""
    results = launcher.run_local_workers(
        backup_workers.train, 2, timeout=240, env=env,
        kwargs={"backup_dir": str(tmp_path / "backup"), **TRAIN})
    for result, full in zip(results, two_workers):
        assert result.result["iterations"] == full["iterations"] == 9
        assert max_diff(result.result["weights"], full["weights"]) <= 1e-6


def keras_mgpu_launch(*args, timeout=400):
    """`keras-mgpu launch ARGS` as a user runs it: (exit code, stdout,
    stderr)."""
    run = subprocess.run([KERAS_MGPU, "launch", *args], cwd=ROOT,
                         env=dict(os.environ, **QUIET), capture_output=True,
                         text=True, timeout=timeout)
    return run.returncode, run.stdout, run.stderr


def test_a_killed_worker_is_restarted_and_the_run_ends_as_uninterrupted(
        two_workers, tmp_path):
    # Worker 1 SIGKILLs itself after step 13 of its first attempt; the
    # launcher stops worker 0, starts both again, and the backup resumes.
    out = tmp_path / "out"
    out.mkdir()
    logs = str(tmp_path / "logs")
    kwargs = {"backup_dir": str(tmp_path / "backup"), "die_at": 13,
              "log_dir": logs, **TRAIN}
    code, stdout, stderr = keras_mgpu_launch(
        "--workers", "2", "--max-restarts", "2", "--backoff", "0", "--",
        sys.executable, "tests/launch_worker.py", json.dumps(kwargs),
        str(out))
    assert code == 0, stderr[-4000:]
    assert ("keras-mgpu launch: attempt 1 ended: worker 1 killed by SIGKILL "
            "(exit -9). Restarting all 2 workers in 0 s (restart 1 of 2)."
            ) in stderr
    assert "keras-mgpu launch: all 2 workers finished after 1 restart." in (
        stderr)
    assert "[worker 0] BackupAndRestore: resumed from backup generation" in (
        stdout)
    assert "[worker 1] STEP 13;" in stdout
    for index, full in enumerate(two_workers):
        resumed = json.loads((out / f"worker{index}.json").read_text())
        assert resumed["iterations"] == full["iterations"] == 9
        assert max_diff(resumed["weights"], full["weights"]) <= 1e-6
    # The job's time as the chief's ledger and the launcher saw it: the
    # first attempt trained past its backup (step 12) until it ended,
    # which the second redid; the launcher's restart between them.
    job = read_job(logs)
    first, second = job.attempts
    assert (first.launch_attempt, second.launch_attempt) == (1, 2)
    assert first.steps >= 12 and second.steps == 24
    assert first.seconds["redone"] > 0
    gap, = [g for g in job.gaps if g.after == 1]
    assert gap.seconds["redone"] > 0  # the first's last record to its end
    assert gap.seconds["between_attempts"] > 0
    assert (gap.started, gap.ended) == (first.ended, second.started)
    assert job.started < first.started < first.ended < second.started
    assert sum(job.seconds.values()) == pytest.approx(job.wall_seconds)


def test_a_sigterm_to_launch_saves_and_the_same_command_resumes_exactly(
        two_workers, tmp_path):
    """What a scheduler does first: SIGTERM to the launcher mid-training.
    Both workers get it, the backup saves and they exit; the launcher
    exits 143 saying how to resume; the same command (less the pause)
    ends as the uninterrupted run. The launcher used to exit at once and
    leave the workers training."""
    import selectors
    import time

    out = tmp_path / "out"
    out.mkdir()
    kwargs = {"backup_dir": str(tmp_path / "backup"), **TRAIN}
    paused = {**kwargs, "pause_at": 10}  # each waits there for its SIGTERM
    proc = subprocess.Popen(
        [KERAS_MGPU, "launch", "--workers", "2", "--", sys.executable,
         "tests/launch_worker.py", json.dumps(paused), str(out)],
        cwd=ROOT, env=dict(os.environ, **QUIET), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    seen = b""
    try:
        selector = selectors.DefaultSelector()
        selector.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + 300
        while not all(f"[worker {i}] STEP 10;".encode() in seen
                      for i in (0, 1)):
            assert selector.select(deadline - time.monotonic()), seen[-3000:]
            chunk = os.read(proc.stdout.fileno(), 65536)
            assert chunk, seen[-3000:]  # the launcher exited
            seen += chunk
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    stdout, stderr = (seen + rest).decode(), err.decode()
    assert proc.returncode == 143, stderr[-4000:]
    assert stderr.strip().splitlines()[-1].startswith(
        "keras-mgpu launch: stopped by SIGTERM: passed on to every worker "
        "as SIGTERM"), stderr[-4000:]
    # The chief names its generation; the other worker does not write
    # (it said "saved generation None").
    assert ("[worker 0] BackupAndRestore: SIGTERM received; saved "
            "generation") in stdout, stdout[-4000:]
    assert ("[worker 1] BackupAndRestore: SIGTERM received; the chief saved "
            "this run at epoch") in stdout, stdout[-4000:]
    assert not list(out.iterdir())  # neither finished
    code, stdout, stderr = keras_mgpu_launch(
        "--workers", "2", "--", sys.executable, "tests/launch_worker.py",
        json.dumps(kwargs), str(out))
    assert code == 0, stderr[-4000:]
    assert "[worker 0] BackupAndRestore: resumed from backup generation" in (
        stdout)
    for index, full in enumerate(two_workers):
        resumed = json.loads((out / f"worker{index}.json").read_text())
        assert resumed["iterations"] == full["iterations"] == 9
        assert max_diff(resumed["weights"], full["weights"]) <= 1e-6


def test_a_command_that_always_fails_stops_after_max_restarts():
    # Worker 0 fails every attempt while worker 1 waits to be stopped: two
    # workers exiting at once would be listed as one or two failures by
    # which exit the launcher saw first.
    program = ("import json, os, sys, threading\n"
               "if not json.loads(os.environ['TF_CONFIG'])['task']['index']:\n"
               "    sys.exit(143)\n"
               "threading.Event().wait(600)\n")
    code, _, stderr = keras_mgpu_launch(
        "--workers", "2", "--max-restarts", "2", "--backoff", "0", "--",
        sys.executable, "-c", program, timeout=120)
    assert code == 143
    assert stderr.count("Restarting all 2 workers") == 2
    assert ("keras-mgpu launch: gave up after 3 attempts (no restarts left: "
            "2 of max_restarts=2 made): attempt 1: worker 0 exit code 143; "
            "attempt 2: worker 0 exit code 143; attempt 3: worker 0 exit "
            "code 143") in stderr, stderr


# Each worker prints its slot (its own environment, as a device's would be)
# and the cluster's size, or dies by SIGKILL as it starts where FAILING
# (JSON: [slot, cluster size, attempt or null for every attempt], ...)
# says so: one worker at most in each attempt, so that the launcher sees
# each failure first, however fast the others end.
SLOT_PROGRAM = """
import json, os, signal
slot = int(os.environ["SLOT"])
attempt = int(os.environ["KERAS_MGPU_ATTEMPT"])
size = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
for failing, at_size, in_attempt in json.loads(os.environ["FAILING"]):
    if (failing, at_size) == (slot, size) and in_attempt in (None, attempt):
        os.kill(os.getpid(), signal.SIGKILL)
print("slot", slot, "of", size)
"""


def launch_slots(failing, min_workers, max_restarts=3):
    """3 workers of SLOT_PROGRAM under `launch`: (its result, its report)."""
    report = io.StringIO()
    result = launcher.launch(
        [sys.executable, "-c", SLOT_PROGRAM], 3, min_workers=min_workers,
        max_restarts=max_restarts, backoff=0, timeout=120, report=report,
        env=lambda i: {"FAILING": json.dumps(failing), "SLOT": str(i)})
    return result, report.getvalue()


@pytest.mark.parametrize("failing", [1, 2])
def test_a_worker_that_keeps_failing_is_left_out_down_to_min_workers(
        failing):
    result, report = launch_slots([[failing, 3, None]], min_workers=2)
    died = f"worker {failing} killed by SIGKILL (exit -9)"
    assert [a.why for a in result.attempts] == [died, died, "finished"]
    assert [len(a.returncodes) for a in result.attempts] == [3, 3, 2]
    # The others keep their slot's environment, as ranks 0 and 1 of 2.
    assert [r.stdout.strip() for r in result.results] == [
        f"slot {slot} of 2" for slot in range(3) if slot != failing]
    assert (f"attempt 1 ended: {died}. Restarting all 3 workers in 0 s "
            "(restart 1 of 3).") in report
    assert (f"attempt 2 ended: {died}. worker {failing} failed in 2 "
            f"attempts in a row: restarting without it, on 2 workers "
            f"(min_workers=2; SIGUSR1 to this launcher, pid {os.getpid()}, "
            "starts every worker again), in 0 s (restart 2 of 3).") in report


def test_a_worker_that_failed_once_is_started_again():
    result, report = launch_slots([[2, 3, 1]], min_workers=1)
    assert [len(a.returncodes) for a in result.attempts] == [3, 3]
    assert [r.stdout.strip() for r in result.results] == [
        f"slot {slot} of 3" for slot in range(3)]
    assert "without" not in report


def test_no_restart_goes_on_with_fewer_than_min_workers():
    # Worker 2 fails on 3 workers and is left out after its second
    # failure; worker 1 then fails on 2, and is never left out (2 is the
    # minimum), until no restart is left.
    with pytest.raises(launcher.LaunchError) as error:
        launch_slots([[2, 3, None], [1, 2, None]], min_workers=2,
                     max_restarts=4)
    assert [len(a.returncodes) for a in error.value.attempts] == [
        3, 3, 2, 2, 2]
    assert [a.failed for a in error.value.attempts] == [
        (2,), (2,), (1,), (1,), (1,)]


# Slot 2 dies in attempts 1 and 2. On 2 workers, slot 0 asks its launcher
# (this process) to grow with SIGUSR1, and both wait for its SIGTERM; on 3,
# each says where it ran. With ASK_AT_ONCE, slot 0 asks in attempt 1 (all
# workers running) and ends it.
GROW_PROGRAM = """
import json, os, signal, sys
slot = int(os.environ["SLOT"])
attempt = int(os.environ["KERAS_MGPU_ATTEMPT"])
size = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
if os.environ.get("ASK_AT_ONCE") and attempt == 1:
    if slot == 0:
        os.kill(os.getppid(), signal.SIGUSR1)
        sys.exit(143)
    signal.pause()
if slot == 2 and attempt <= 2:
    os.kill(os.getpid(), signal.SIGKILL)
if size == 2:
    if slot == 0:
        os.kill(os.getppid(), signal.SIGUSR1)
    signal.pause()
print("slot", slot, "of", size)
"""


def launch_growing(env, max_restarts):
    report = io.StringIO()
    result = launcher.launch(
        [sys.executable, "-c", GROW_PROGRAM], 3, min_workers=2,
        max_restarts=max_restarts, backoff=0, grace_period=60, timeout=120,
        report=report, env=lambda i: {**env, "SLOT": str(i)})
    return result, report.getvalue()


def test_sigusr1_starts_every_worker_again():
    # Two restarts and the grow, which is not counted against them.
    result, report = launch_growing({}, max_restarts=2)
    assert [len(a.returncodes) for a in result.attempts] == [3, 3, 2, 3]
    assert result.attempts[2].why.startswith("stopped by SIGUSR1 to start "
                                             "every worker again")
    assert [r.stdout.strip() for r in result.results] == [
        f"slot {slot} of 3" for slot in range(3)]
    assert (f"SIGUSR1 to this launcher, pid {os.getpid()}, starts every "
            "worker again") in report
    assert ("attempt 3 ended: stopped by SIGUSR1 to start every worker "
            "again (a BackupAndRestore with save_on_sigterm saves first). "
            "Restarting all 3 workers, worker 2 back (not counted against "
            "max_restarts).") in report


def test_sigusr1_while_every_worker_runs_changes_nothing():
    # Attempt 1 ends as slot 0 asks; slot 2 then fails once, in attempt 2.
    result, report = launch_growing({"ASK_AT_ONCE": "1"}, max_restarts=3)
    assert [len(a.returncodes) for a in result.attempts] == [3, 3, 3]
    assert ("keras-mgpu launch: SIGUSR1: all 3 workers already run; "
            "nothing to start again.") in report
    assert "Restarting all 3 workers, " not in report


def test_min_workers_above_workers_is_refused_by_the_command_line():
    code, _, stderr = keras_mgpu_launch(
        "--workers", "2", "--min-workers", "3", "--", sys.executable, "-c",
        "pass", timeout=60)
    assert code == 2
    assert ("--min-workers 3 is more than --workers 2: give at most as many "
            "as --workers.") in stderr


def test_a_failure_of_the_program_itself_is_not_restarted():
    code, _, stderr = keras_mgpu_launch(
        "--workers", "2", "--max-restarts", "5", "--", sys.executable, "-c",
        "import sys; sys.exit('bad input')", timeout=120)
    assert code == 1
    assert "Restarting" not in stderr
    assert ("gave up after 1 attempt (not restarted: a restart is for a "
            "worker a signal ended or one that exits with 137, 138, 143)"
            ) in stderr
    assert "bad input" in stderr  # the workers' own stderr


def test_a_run_without_progress_is_stopped_and_restarted(tmp_path):
    # The first attempt hangs without touching the progress file; the
    # second finishes.
    program = ("import os, threading, sys\n"
               "if os.environ['KERAS_MGPU_ATTEMPT'] == '1':\n"
               "    threading.Event().wait(600)\n")
    result = launcher.launch(
        [sys.executable, "-c", program], 2, max_restarts=1, backoff=0,
        hang_timeout=2, progress_file=str(tmp_path / "LOCK.json"),
        timeout=300)
    first, second = result.attempts
    assert first.why.startswith("hung: ") and first.restartable
    assert first.returncodes == (-signal.SIGKILL, -signal.SIGKILL)
    assert second.finished and result.restarts == 1


@pytest.mark.parametrize("bad, message", [
    ({"max_restarts": -1}, "max_restarts must be an integer >= 0"),
    ({"restart_exit_codes": [0]}, "exit codes from 1 to 255"),
    ({"hang_timeout": 5}, "go together"),
    ({"backoff": float("nan")}, "backoff must be a number"),
    ({"min_workers": 3}, r"min_workers must be an integer from 1 to "
                         r"num_workers \(2\), got 3"),
    ({"min_workers": 0}, "min_workers must be an integer from 1"),
    ({"min_workers": True}, "min_workers must be an integer from 1"),
])
def test_bad_launch_options_are_refused_before_anything_starts(bad, message):
    with pytest.raises(ValueError, match=message):
        launcher.launch([sys.executable, "-c", "pass"], 2, **bad)


def test_a_missing_working_directory_is_refused_before_anything_starts(
        tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        launcher.launch([sys.executable, "-c", "pass"], 2,
                        cwd=str(tmp_path / "missing"))


def free_slurm_job() -> int:
    """A job id whose first 2 ports are free here now (tried in random
    order: tests running at once rarely pick the same)."""
    for job in random.Random().sample(range(1, 600), 599):
        port = slurm.job_port(job)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("localhost", port))
                b.bind(("localhost", port + 1))
            return job
        except OSError:
            continue
    raise RuntimeError("no free port pair for a SLURM job id")


def test_two_srun_tasks_without_tf_config_train_as_the_launchers_two_workers(
        two_workers, tmp_path):
    job = free_slurm_job()

    def env(index):
        return {**QUIET, "TF_CONFIG": "", "SLURM_JOB_ID": str(job),
                "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": str(index),
                "SLURM_LOCALID": str(index),
                "SLURM_STEP_NODELIST": "localhost",
                "SLURM_STEP_TASKS_PER_NODE": "2"}

    assert_trains_as(two_workers, env, tmp_path)


def test_a_tfjob_cluster_with_a_chief_trains_as_two_workers(two_workers,
                                                           tmp_path):
    # As Kubeflow's TFJob writes it: a chief, a worker, an evaluator (not
    # started: it trains nothing), and fields keras-mgpu does not use.
    chief, worker, evaluator = (f"localhost:{p}"
                                for p in launcher.free_ports(3))

    def env(index):
        task = {"type": "chief" if index == 0 else "worker", "index": 0}
        return {**QUIET, "TF_CONFIG": json.dumps({
            "cluster": {"chief": [chief], "worker": [worker],
                        "evaluator": [evaluator]},
            "task": task, "environment": "cloud"})}

    assert_trains_as(two_workers, env, tmp_path)


def test_a_port_taken_after_it_was_picked_restarts_on_fresh_ports(
        monkeypatch):
    """The first attempt's worker 0 finds its port held by another process
    (as when one takes it between `free_ports` and the bind): restarted on
    fresh ports, the port named (it ended the run, "not restarted")."""
    holder = socket.socket()
    holder.bind(("localhost", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    picks = []
    free = launcher.free_ports

    def ports(n):
        picks.append(free(n))
        if len(picks) == 1:
            picks[0][0] = taken
        return picks[-1]

    from keras_mgpu.cluster import workers

    monkeypatch.setattr(workers, "free_ports", ports)
    program = ("import keras_mgpu; keras_mgpu.auto_strategy("
               "startup_timeout=120); print('UP', flush=True)")
    report = io.StringIO()
    try:
        result = launcher.launch([sys.executable, "-c", program], 2,
                                 max_restarts=1, backoff=0, env=QUIET,
                                 timeout=400, report=report)
    finally:
        holder.close()
    assert [a.why for a in result.attempts] == [
        f"worker 0 could not listen on localhost:{taken} (taken since it "
        "was picked)", "finished"]
    assert all("UP" in r.stdout for r in result.results)
    assert f"localhost:{taken}" in report.getvalue()
    assert taken not in picks[1]


def test_the_exit_code_is_the_failing_workers_not_a_stopped_ones():
    # Worker 1 fails with 3 while worker 0 still runs: the launcher stops
    # worker 0 (SIGKILL, 137 to a shell), and the failure's code is 3.
    program = ("import json, os, sys, threading\n"
               "if json.loads(os.environ['TF_CONFIG'])['task']['index']:\n"
               "    sys.exit(3)\n"
               "threading.Event().wait(600)\n")
    with pytest.raises(launcher.LaunchError) as error:
        launcher.launch([sys.executable, "-c", program], 2, timeout=300)
    (attempt,) = error.value.attempts
    assert attempt.returncodes == (-signal.SIGKILL, 3)
    assert attempt.failed == (1,) and not attempt.restartable
    assert error.value.exit_code == 3


# Worker 1 dies in attempt 1; worker 0 then prints what TensorFlow prints
# when a peer of its collectives is gone, and waits (to be stopped).
ABORTING_WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    if os.environ["KERAS_MGPU_ATTEMPT"] == "2":
        print(f"DONE {index}")
        sys.exit(0)
    print(f"TRAINING {index}", flush=True)
    flag = sys.argv[1]
    if index == 0:
        open(flag + ".0", "w").close()  # after its line is out
    if index == 1:
        while not os.path.exists(flag + ".0"):
            time.sleep(0.01)
        with open(flag + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(flag + ".tmp", flag)
        os.kill(os.getpid(), signal.SIGKILL)
    def gone(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True
    while not os.path.exists(flag) or not gone(int(open(flag).read())):
        time.sleep(0.01)
    lines = ["Traceback (most recent call last):",
             '  File "train.py", line 40, in <module>',
             "    model.fit(dataset, epochs=3)",
             "tensorflow.python.framework.errors_impl.UnavailableError: "
             "Collective ops is aborted by: failed to connect to all "
             "addresses"]
    lines += [f"  [{i}] UNAVAILABLE: Collective ops is aborted by: peer "
              "gone" for i in range(110)]
    print("\\n".join(lines), file=sys.stderr, flush=True)
    signal.pause()
""")


def test_a_failure_is_named_before_the_survivors_collective_errors(
        tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(ABORTING_WORKER)
    run = subprocess.run(
        [KERAS_MGPU, "launch", "--workers", "2", "--max-restarts", "1",
         "--backoff", "0", "--", sys.executable, str(script),
         str(tmp_path / "died")],
        env=dict(os.environ, TMPDIR=str(tmp_path)), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=120)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout[-4000:]
    restart = lines.index(
        "keras-mgpu launch: attempt 1 ended: worker 1 killed by SIGKILL "
        "(exit -9). Restarting all 2 workers in 0 s (restart 1 of 1).")
    # Worker 0's output before the failure is shown as it came; after it,
    # one line after the launcher's, which names the file that has it all.
    assert lines.index("[worker 0] TRAINING 0") < restart
    survivor = [line for line in lines[restart:]
                if line.startswith("[worker 0]") and "DONE" not in line]
    assert len(survivor) == 1, run.stdout[-4000:]
    assert "Traceback" not in run.stdout and "UNAVAILABLE" not in run.stdout
    assert survivor[0].startswith(
        "[worker 0] 114 lines held back after worker 1 failed: its "
        "collective ops aborted (tensorflow.python.framework.errors_impl."
        "UnavailableError: Collective ops is aborted by: "), survivor[0]
    path = survivor[0].rsplit("the full text is in ", 1)[1]
    assert path.startswith(str(tmp_path))
    kept = open(path).read().splitlines()
    assert kept[0] == "Traceback (most recent call last):"
    assert len(kept) == 114 and kept[-1].startswith("  [109] UNAVAILABLE")
    assert lines[-1] == (
        "keras-mgpu launch: all 2 workers finished after 1 restart.")
