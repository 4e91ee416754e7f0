"""Every example runs, in its reduced --smoke form, as a user would run it."""

import os
import re
import select
import signal
import subprocess
import sys

import pytest

from tests.test_tensorboard_http import STARTUP_TIMEOUT, TensorBoard

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(__file__)),
                        "examples")


# TensorFlow's C++ log lines, and Python warnings (Keras's `UserWarning`s
# name a file in site-packages): an example's output shows neither.
NOISE = re.compile(r"^([IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\]"
                   r"|WARNING: All log messages before absl"
                   r"|.*\b\w*Warning: )", re.M)


def example_env():
    # TF_CPP_MIN_LOG_LEVEL unset, as a user runs them.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="-1")
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
    ("tune.py", "effective/global_batch_size"),
])
def test_example_runs(name, expected, tmp_path):
    output = run_example(name, tmp_path)
    for text in (expected,) if isinstance(expected, str) else expected:
        assert text in output


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's smoke run with --fresh, interrupted by SIGINT (Ctrl-C) in
    its second epoch, once its first epoch's line is out; then the same
    command without --fresh, which resumes. (workdir, first output, rerun
    output)."""
    workdir = tmp_path_factory.mktemp("demo")
    child = subprocess.Popen(
        [sys.executable, os.path.join(EXAMPLES, "demo.py"), "--smoke",
         "--fresh", "--workdir", str(workdir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=example_env(), cwd=EXAMPLES)
    lines = []
    try:
        while not lines or not lines[-1].startswith(
                "DistributedLogger epoch 1:"):
            ready, _, _ = select.select([child.stdout], [], [], 300)
            line = child.stdout.readline() if ready else ""
            assert line, ("no epoch line", "".join(lines), child.poll())
            lines.append(line)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=60)
    first = "".join(lines) + out
    assert child.returncode == 130, (first, err[-3000:])
    rerun = run_example("demo.py", workdir)
    return workdir, first, rerun


def test_ctrl_c_after_fresh_says_how_to_resume(demo):
    _, first, _ = demo
    assert first.startswith("Starting run 1 of ")
    assert "run the command again without --fresh to resume" in first, first


def test_the_rerun_resumes_its_run_and_labels_the_partial_epoch(demo):
    _, _, rerun = demo
    assert rerun.startswith("Continuing run 1 of "), rerun
    # The epoch the interrupted run had begun: its last backup was mid-epoch.
    assert re.search(r"^DistributedLogger epoch [12] \(resumed after batch "
                     r"\d+: \d+ batch(es)? trained here\): loss ", rerun,
                     re.M), rerun


def test_the_demos_tensorboard_overlays_train_and_validation(
        demo, tmp_path):
    """What the printed TensorBoard command serves, asked over its HTTP
    API: the run's `train` and `validation`, and `epoch_loss` in both, at
    the same epochs: one chart."""
    workdir, _, _ = demo
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
    workdir, first, output = demo
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
