"""Shared by the examples: real data that ships with scikit-learn, and flags."""

import argparse

import numpy as np


def parse_args(description: str, **extra):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true",
                        help="a few seconds' run, as the test suite does")
    parser.add_argument("--workdir", default=None,
                        help="where logs and backups go (default: a temp dir)")
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


def workdir(path, name):
    import tempfile

    return path or tempfile.mkdtemp(prefix=f"keras_mgpu_{name}_")
