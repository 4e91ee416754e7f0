"""Every example runs, in its reduced --smoke form, as a user would run it."""

import os
import re
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(__file__)),
                        "examples")


# TensorFlow's C++ log lines, and Python warnings (Keras's `UserWarning`s
# name a file in site-packages): an example's output shows neither.
NOISE = re.compile(r"^([IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\]"
                   r"|WARNING: All log messages before absl"
                   r"|.*\b\w*Warning: )", re.M)


def run_example(name, tmp_path, *args, timeout=300):
    # TF_CPP_MIN_LOG_LEVEL unset, as a user runs them.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="-1")
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    env.pop("TF_CONFIG", None)
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
    ("logging_example.py", "tensorboard --logdir"),
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


def test_the_demo_reports_and_prints_commands_that_run_as_printed(tmp_path):
    output = run_example("demo.py", tmp_path)
    for text in ("Tuning the hidden width", "DistributedLogger epoch 2:",
                 "test accuracy:", "input wait:"):
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
