"""The README as a newcomer uses it: every Python snippet runs as pasted,
and every command it gives names something that exists."""

import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def blocks(language):
    with open(README) as f:
        text = f.read()
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.M | re.S)


# What each snippet prints, keyed by a line that identifies it: a snippet
# that runs but computes something else fails too.
PRINTS = {
    "GradientAccumulationModel(": "optimizer steps: 8",
    "FP32OutputHead(2": "output dtype: float32",
    "DistributedLogger(": " examples/s, input wait ",
    'from_preset("preemptible"': "optimizer steps: 192",
    "StrategyAwareHyperModel(": "global batch: ",
    "write_tfrecords(": "(64, 16)",
}


def snippet_id(code):
    return next((key for key in PRINTS if key in code), "unknown")


def test_every_python_snippet_is_checked():
    assert sorted(snippet_id(code) for code in blocks("python")) == sorted(
        PRINTS)


@pytest.mark.parametrize("code", blocks("python"), ids=snippet_id)
def test_python_snippet_runs_as_pasted(code, tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="-1")
    env.pop("TF_CONFIG", None)
    env.pop("WANDB_MODE", None)  # the snippet itself must say "offline"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                          env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert PRINTS[snippet_id(code)] in proc.stdout, proc.stdout


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
            # Built by `make wheel`: the name carries pyproject's version.
            with open(os.path.join(ROOT, "pyproject.toml")) as f:
                version = re.search(r'^version = "(.+)"', f.read(), re.M)[1]
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
