"""Shared by the examples: quiet TensorFlow, bundled data, flags, paths.

Import it before TensorFlow or keras_mgpu: it hides TensorFlow's C++ start-up
log lines (a TF_CPP_MIN_LOG_LEVEL you set wins).
"""

import argparse
import os
import shutil
import sys

import keras_mgpu

keras_mgpu.quiet_tensorflow()

import numpy as np  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(description: str, **extra):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true",
                        help="a few seconds' run, as the test suite does")
    parser.add_argument("--workdir", default=None,
                        help="where logs and backups go (default: "
                             "runs/<example> in the checkout)")
    for name, kwargs in extra.items():
        parser.add_argument(f"--{name.replace('_', '-')}", **kwargs)
    return parser.parse_args()


def digits(test_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's 1,797 handwritten 8x8 digits, split, scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.data / 16.0).astype("float32")
    y = bunch.target.astype("int64")
    order = np.random.RandomState(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(len(x) * (1 - test_fraction))
    return (x[:split], y[:split]), (x[split:], y[split:])


def workdir(path, name, fresh=True):
    """`path`, or runs/<name> in the checkout (emptied first when `fresh`:
    a rerun starts over, and nothing is left in the system temp folder)."""
    if path:
        return path
    path = os.path.join(REPO, "runs", name)
    if fresh:
        shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, exist_ok=True)
    return path


def shown(path):
    """`path` relative to the working directory when it lies below it."""
    relative = os.path.relpath(path)
    return path if relative.startswith(os.pardir) else relative


def command(*args):
    """A shell command that runs with this interpreter, e.g. `.venv/bin/python
    examples/demo.py`: the bare `python` may be another one, without
    keras-mgpu."""
    return " ".join([shown(sys.executable), *args])


def tensorboard_command(log_dir):
    """The command that serves `log_dir`, with this environment's TensorBoard."""
    tensorboard = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    if os.path.exists(tensorboard):
        return f"{shown(tensorboard)} --logdir {shown(log_dir)}"
    return command("-m", "tensorboard.main", "--logdir", shown(log_dir))
