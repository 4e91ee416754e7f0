"""The README as a newcomer uses it: every Python snippet runs as pasted,
and every command it gives names something that exists."""

import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import allow_in_children, hide_in_children

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def blocks(language):
    with open(README) as f:
        text = f.read()
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.M | re.S)


# What each snippet prints, keyed by a line that identifies it: a snippet
# that runs but computes something else fails too.
PRINTS = {
    "DataParallel(": "devices: 2 optimizer steps: 8",
    "GradientAccumulationModel(": "optimizer steps: 8",
    "FP32OutputHead(2": "output dtype: float32",
    "DistributedLogger(": " examples/s, input wait ",
    'from_preset("preemptible"': "optimizer steps: 192",
    "StrategyAwareHyperModel(": "global batch: ",
    "write_tfrecords(": "(64, 16)",
}


def snippet_id(code):
    # The JAX snippet wraps a model too: its own key comes first.
    return next((key for key in PRINTS if key in code), "unknown")


def test_every_python_snippet_is_checked():
    assert sorted(snippet_id(code) for code in blocks("python")) == sorted(
        PRINTS)


# What TensorFlow's C++ code prints (absl's format, its pre-init banner, the
# second line of cpu_feature_guard's notice), and the sources the README's
# users met: none of it may reach a documented command's output.
TF_LOG_LINE = re.compile(
    r"^([IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\]"
    r"|WARNING: All log messages before absl::InitializeLog"
    r"|To enable the following instructions:)"
    r"|cudart_stub|cpu_feature_guard|oneDNN custom operations|cuInit",
    re.M)
# TF_CPP_MIN_LOG_LEVEL as users run the commands: unset, and the usual
# "silence TensorFlow" setting (which alone does not silence its start).
LEVELS = {"level-unset": None, "level-3": "3"}


def quiet_env(level):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="-1")
    env.pop("TF_CONFIG", None)
    env.pop("WANDB_MODE", None)  # the snippet itself must say "offline"
    env.pop("WANDB_SERVICE", None)  # no wandb-core of this process
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    if level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = level
    return env


def assert_no_tensorflow_log_line(output):
    lines = [m.group(0) for m in TF_LOG_LINE.finditer(output)]
    assert not lines, f"TensorFlow log lines {lines}:\n{output[-4000:]}"


# Each snippet as users run it; with the level exported as well, `make
# test-all` (quiet_tensorflow() hides the same lines whatever follows it;
# test_the_telemetry_snippet_runs_where_... runs one so).
@pytest.mark.parametrize("code, level", [
    pytest.param(code, level, id=f"{snippet_id(code)}-{name}",
                 marks=() if level is None else pytest.mark.exhaustive)
    for code in blocks("python") for name, level in LEVELS.items()])
def test_python_snippet_runs_as_pasted(code, level, tmp_path):
    env = quiet_env(level)
    if "keras.distribution" in code:
        env = allow_in_children(env, "jax")  # the JAX backend's snippet
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                          env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert PRINTS[snippet_id(code)] in proc.stdout, proc.stdout
    assert_no_tensorflow_log_line(proc.stdout + proc.stderr)


# What the quick start's `make demo` installs nothing of: the optional
# packages of the extras other than `demo` (and its `tuner`).
NOT_IN_THE_QUICK_START = ("wandb", "xprof", "tensorboard_plugin_profile",
                          "matplotlib", "jax")


def test_the_telemetry_snippet_runs_where_the_quick_start_installed(
        tmp_path):
    """After `make demo` (the `demo` extra: no wandb), the snippet runs as
    pasted: here with the other extras' packages unimportable."""
    code = next(c for c in blocks("python")
                if snippet_id(c) == "DistributedLogger(")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                          env=hide_in_children(quiet_env("3"),
                                               NOT_IN_THE_QUICK_START),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert PRINTS["DistributedLogger("] in proc.stdout, proc.stdout


def test_every_snippet_starts_quiet():
    # The README's promise: one call, first, before TensorFlow loads (after
    # the environment, which Keras reads as TensorFlow imports it).
    for code in blocks("python"):
        code = re.sub(r"\A(import os\n(os\.environ\[.*\n)+)?", "", code)
        assert code.startswith("import keras_mgpu\n"
                               "keras_mgpu.quiet_tensorflow()"), code[:200]


# Each way to start it and each level once (both with both: `make
# test-all`): the console script and `python -m` start the same `main`.
@pytest.mark.parametrize("argv, level", [
    pytest.param(argv, level, id=f"{way}-{name}",
                 marks=() if (way, name) in (
                     ("console-script", "level-unset"),
                     ("python-m", "level-3")) else pytest.mark.exhaustive)
    for way, argv in (
        ("console-script", ["keras-mgpu", "doctor"]),
        # Documented (docs/cli.md) as the same command.
        ("python-m", ["python", "-m", "keras_mgpu", "doctor"]))
    for name, level in LEVELS.items()])
def test_documented_command_prints_no_tensorflow_log_line(argv, level,
                                                          tmp_path):
    bin_dir = os.path.dirname(sys.executable)
    program = sys.executable if argv[0] == "python" else os.path.join(
        bin_dir, argv[0])
    proc = subprocess.run([program, *argv[1:]], cwd=tmp_path,
                          env=quiet_env(level), capture_output=True,
                          text=True, timeout=300)
    # doctor exits 1 on an error finding; both are answers, not crashes.
    assert proc.returncode in (0, 1), proc.stderr[-4000:]
    assert "TensorFlow" in proc.stdout, proc.stdout
    assert_no_tensorflow_log_line(proc.stdout + proc.stderr)


def commands():
    for block in blocks("bash"):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                yield from (part.strip() for part in line.split("&&"))


def make_targets():
    with open(os.path.join(ROOT, "Makefile")) as f:
        return set(re.findall(r"^([a-z][\w-]*):", f.read(), re.M))


@pytest.mark.parametrize("command", list(commands()))
def test_each_shell_command_names_what_exists(command):
    words = shlex.split(command)
    program = words[0]
    if program == "make":
        assert words[1] in make_targets(), f"no make target {words[1]!r}"
    elif program == "pip":
        assert words[1] == "install"
        target = words[-1]
        if target.startswith("dist/"):
            # Built by `make wheel`: the name carries the package's version
            # (keras_mgpu/_version.py, which pyproject.toml reads).
            with open(os.path.join(ROOT, "keras_mgpu", "_version.py")) as f:
                version = re.search(r'^__version__ = "(.+)"', f.read(),
                                    re.M)[1]
            assert target.split("[")[0] == (
                f"dist/keras_mgpu-{version}-py3-none-any.whl")
    else:
        # .venv/bin/<tool>: the tool this test runs under has.
        assert program.startswith(".venv/bin/"), command
        tool = os.path.join(os.path.dirname(sys.executable),
                            os.path.basename(program))
        assert os.access(tool, os.X_OK), f"{tool} does not exist"


def test_readme_stays_short():
    with open(README) as f:
        assert len(f.read().splitlines()) <= 300
