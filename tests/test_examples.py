"""Every example runs, in its reduced --smoke form, as a user would run it."""

import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.conftest import allow_in_children
from tests.test_tensorboard_http import STARTUP_TIMEOUT, TensorBoard

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(__file__)),
                        "examples")


# TensorFlow's C++ log lines, and Python warnings (Keras's `UserWarning`s
# name a file in site-packages): an example's output shows neither.
NOISE = re.compile(r"^([IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\]"
                   r"|WARNING: All log messages before absl"
                   r"|.*\b\w*Warning: )", re.M)


def example_env():
    # TF_CPP_MIN_LOG_LEVEL unset, as a user runs them; the examples train
    # on scikit-learn's digits.
    env = allow_in_children(dict(os.environ, CUDA_VISIBLE_DEVICES="-1"),
                            "sklearn")
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    env.pop("TF_CONFIG", None)
    return env


def run_example(name, tmp_path, *args, timeout=300):
    env = example_env()
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, name), "--smoke",
         "--workdir", str(tmp_path), *args],
        capture_output=True, text=True, timeout=timeout, env=env,
        cwd=EXAMPLES)
    assert proc.returncode == 0, (
        f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    noise = [m.group(0) for m in NOISE.finditer(proc.stdout + proc.stderr)]
    assert not noise, f"{name} printed {noise}:\n{proc.stderr[-5000:]}"
    return proc.stdout


# tune.py and train.py: their Ctrl-C tests below start each as a user
# does, through training and a resume; the whole smoke run of each is in
# `make test-all`.
@pytest.mark.parametrize("name, expected", [
    ("accumulation.py", "optimizer steps in all: 12"),
    ("mixed_precision.py", "output dtype: float32"),
    ("logging_example.py", ("tensorboard --logdir", "validation loss ",
                            # Console and JSONL epochs, each labelled.
                            "DistributedLogger epoch 2:",
                            'last record: epoch 2 ("epoch": 1, 0-based')),
    ("backup.py", "optimizer steps: 90"),
    ("data_pipeline.py", ("records verified: 1437", "starved ", "fed ",
                          "input wait ")),
    ("custom_training_loop.py", "fit: same weights as the loop"),
    ("multi_worker.py", '"replicas": 2'),
    pytest.param("tune.py", "effective/global_batch_size",
                 marks=pytest.mark.exhaustive),
    pytest.param("train.py", (
        "DefaultDistributionStrategy: 1 replica(s), 1 worker(s)",
        "optimizer steps: 128;"), marks=pytest.mark.exhaustive),
])
def test_example_runs(name, expected, tmp_path):
    output = run_example(name, tmp_path)
    for text in (expected,) if isinstance(expected, str) else expected:
        assert text in output


def _ctrl_c_as_in_a_terminal():
    # Tests started as a shell's background job inherit SIGINT ignored,
    # and a Python started so raises no KeyboardInterrupt: the child gets
    # Ctrl-C as a terminal's foreground job does.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Started:
    """An example started as a user starts it, its stdout read line by line
    (stderr goes to a file: nothing blocks on a full pipe). Each wait has
    a timeout; `stop()` kills the child if it still runs."""

    def __init__(self, name, *args, errdir, env=None):
        self.name = name
        self.errfile = tempfile.NamedTemporaryFile(
            "w+", dir=errdir, prefix=f"{name}.", suffix=".stderr")
        self.child = subprocess.Popen(
            [sys.executable, os.path.join(EXAMPLES, name), *args],
            stdout=subprocess.PIPE, stderr=self.errfile, text=True,
            env=example_env() if env is None else env, cwd=EXAMPLES,
            preexec_fn=_ctrl_c_as_in_a_terminal)
        self.lines = []

    def stderr(self):
        self.errfile.seek(0)
        return self.errfile.read()

    def read_until(self, marker, timeout=300, required=True):
        """Reads stdout until a line containing `marker`: that line. If
        none comes: fails, or with `required=False` returns None once the
        child has ended."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.child.stdout], [], [],
                                        max(left, 0))
            line = self.child.stdout.readline() if ready else ""
            if not line:
                self.stop()
                if ready and not required:
                    return None
                pytest.fail(
                    f"{self.name}: no line with {marker!r} "
                    f"({'timeout' if not ready else 'output ended'}, exit "
                    f"{self.child.returncode}):\n{''.join(self.lines)}\n"
                    f"stderr:\n{self.stderr()[-5000:]}")
            self.lines.append(line)
            if marker in line:
                return line

    def interrupt(self, timeout=120):
        """Ctrl-C: SIGINT, then waits; (exit code, stdout, stderr)."""
        self.child.send_signal(signal.SIGINT)
        try:
            out, _ = self.child.communicate(timeout=timeout)
        finally:
            self.stop()
        return (self.child.returncode, "".join(self.lines) + out,
                self.stderr())

    def stop(self):
        if self.child.poll() is None:
            self.child.kill()
        self.child.wait(timeout=60)


# TensorFlow's C++ log lines: what an interrupted example's stderr may hold
# besides its one line (TF_CPP_MIN_LOG_LEVEL=3 hides nearly all of them).
TF_LOG = re.compile(r"^([IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\]"
                    r"|WARNING: All log messages before absl)")


def interrupted_line(code, out, err, name):
    """Checks the end of a Ctrl-C: exit code 130, no traceback, one line on
    stderr besides TensorFlow's log lines; that line."""
    lines = [line for line in err.splitlines()
             if line.strip() and not TF_LOG.match(line)]
    assert code == 130, (name, code, out[-3000:], err[-5000:])
    assert "Traceback" not in err + out, (name, err[-5000:])
    assert len(lines) == 1, (name, lines)
    assert lines[0].startswith("Interrupted"), (name, lines)
    return lines[0]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's smoke run with --fresh, interrupted by SIGINT (Ctrl-C)
    once its first epoch's line is out (as that epoch ends, or in the
    second; its backup holds epoch 1's batches either way); then the same
    command without --fresh, which resumes. (workdir, first output, rerun
    output, the interrupted run's stderr)."""
    workdir = tmp_path_factory.mktemp("demo")
    child = Started("demo.py", "--smoke", "--fresh", "--workdir",
                    str(workdir),
                    errdir=str(tmp_path_factory.mktemp("demo-stderr")))
    child.read_until("DistributedLogger epoch 1:")
    code, first, err = child.interrupt()
    interrupted_line(code, first, err, "demo.py")
    rerun = run_example("demo.py", workdir)
    return workdir, first, rerun, err


def test_ctrl_c_after_fresh_says_how_to_resume(demo):
    _, first, _, err = demo
    assert first.startswith("Starting run 1 of ")
    line = err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"Interrupted at epoch \d, step \d+: the backup in \S+ resumes it; "
        r"run the command again without --fresh \(--fresh deletes it and "
        r"starts over\)\.", line), line


# Every example, started as a user starts it (the full run, not --smoke:
# Ctrl-C comes while training has long to go), interrupted by SIGINT once
# the marker is printed: (arguments, marker, whether a rerun resumes).
EPOCH_1 = "Epoch 1 done. Ctrl-C stops the run"
CTRL_C = {
    "accumulation.py": ((), EPOCH_1, False),
    "mixed_precision.py": ((), EPOCH_1, False),
    "logging_example.py": ((), EPOCH_1, False),
    "backup.py": ((), EPOCH_1, True),
    "data_pipeline.py": ((), EPOCH_1, False),
    "custom_training_loop.py": ((), EPOCH_1, False),
    # The parent's line: its workers print into files, not its stdout.
    "multi_worker.py": ((), "Training on 2 worker processes", False),
    "tune.py": ((), EPOCH_1, True),
    "train.py": (("--epochs", "30"), EPOCH_1, True),
}


def test_every_example_has_a_ctrl_c_test():
    names = {name for name in os.listdir(EXAMPLES)
             if name.endswith(".py") and not name.startswith("_")}
    assert names == set(CTRL_C) | {"demo.py"}  # the demo: its fixture


# A search that resumes, a training script that resumes (backup.py resumes
# through the same BackupAndRestore and `examples/_interrupt.py`) and the
# multi-worker parent, which does not; the other examples stop through the
# same `examples/_interrupt.py` (`make test-all`).
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=() if name in (
        "tune.py", "train.py", "multi_worker.py")
        else pytest.mark.exhaustive)
    for name in CTRL_C])
def test_ctrl_c_ends_with_one_line_and_a_rerun_resumes(name, tmp_path):
    args, marker, resumes = CTRL_C[name]
    env = dict(example_env(), TF_CPP_MIN_LOG_LEVEL="3")
    (tmp_path / "work").mkdir()
    command = (name, "--workdir", str(tmp_path / "work"), *args)
    child = Started(*command, errdir=str(tmp_path), env=env)
    child.read_until(marker)
    line = interrupted_line(*child.interrupt(), name)
    if not resumes:
        assert line.endswith(": stopped, nothing saved."), line
        return
    assert re.fullmatch(r"Interrupted at epoch \d+, step \d+: the backup "
                        r"in \S+ resumes it; run the same command again\.",
                        line), line
    # The same command again: it resumes; Ctrl-C once more ends the same.
    again = Started(*command, errdir=str(tmp_path), env=env)
    resumed = again.read_until(
        "BackupAndRestore: resumed from ", required=False)
    assert resumed, (name, "".join(again.lines), again.stderr()[-5000:])
    line = interrupted_line(*again.interrupt(), name)
    assert line.endswith("resumes it; run the same command again."), line


def test_the_rerun_resumes_its_run_and_labels_the_partial_epoch(demo):
    _, _, rerun, _ = demo
    assert rerun.startswith("Continuing run 1 of "), rerun
    # Where the last save before the Ctrl-C was (the preset's local tier
    # saves every batch): mid-epoch, and the logger labels the epoch the
    # rerun finishes; at an epoch's start, and that epoch is whole.
    resumed = re.search(r"^BackupAndRestore: resumed from local generation "
                        r"\d+ at (?:epoch (\d), step (\d+)|the start of "
                        r"epoch (\d)) ", rerun, re.M)
    assert resumed, rerun
    mid_epoch, _, start = resumed.groups()
    label = re.search(r"^DistributedLogger epoch (\d)( \(resumed after batch "
                      r"(\d+): \d+ batch(?:es)? trained here\))?: loss ",
                      rerun, re.M)
    assert label, rerun
    if mid_epoch is not None:
        assert label.group(1) == mid_epoch and label.group(2), rerun
    else:
        assert (label.group(1), label.group(2)) == (start, None), rerun


def test_the_demos_tensorboard_overlays_train_and_validation(
        demo, tmp_path):
    """What the printed TensorBoard command serves, asked over its HTTP
    API: the run's `train` and `validation`, and `epoch_loss` in both, at
    the same epochs: one chart."""
    workdir, _, _, _ = demo
    server = TensorBoard(workdir / "logs", tmp_path)
    try:
        server.wait_for_url(STARTUP_TIMEOUT)
        assert sorted(server.get("/data/runs")) == [
            "run1/train", "run1/validation"]
        # A set: the epoch resumed inside has a point from each run.
        steps = [{step for _, step, _ in server.get(
            "/data/plugin/scalars/scalars", run=f"run1/{run}",
            tag="epoch_loss")} for run in ("train", "validation")]
    finally:
        server.close()
    assert steps == [{0, 1}, {0, 1}]


def test_the_demo_reports_and_prints_commands_that_run_as_printed(demo):
    workdir, first, output, _ = demo
    assert "Tuning the hidden width" in first, first
    # The rerun reloads the finished trials and says so, not "Tuning".
    assert "Tuning the hidden width" not in output, output
    for text in ("Tuning done before: 1 trial(s) reloaded",
                 "DistributedLogger epoch 2:",
                 "tuned model:", "test accuracy:", "input wait:"):
        assert text in output
    lines = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].split()
             for line in output.splitlines() if line.startswith("  ")
             and ":" in line}
    for label in ("view them", "on 2 workers"):
        program = os.path.join(EXAMPLES, lines[label][0])
        # The demo's own interpreter or its TensorBoard, not a bare
        # `python` or `tensorboard` that may not be on PATH.
        assert os.path.dirname(os.path.abspath(program)) == os.path.dirname(
            os.path.abspath(sys.executable)), lines[label]
        assert os.access(program, os.X_OK), lines[label]
    script = os.path.join(EXAMPLES, lines["on 2 workers"][1])
    assert os.path.isfile(script)
