"""A part's own process: its results file and what every part shares.

`gpu_suite.py --_part NAME` calls `main`, which runs `NAME.run(recorder,
dry_run, budget_s)` from this package. The parent reads the results file
even when it had to kill this process at the budget, so a part saves after
every figure.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import time

from . import STARTED


class Recorder:
    """A child's results, written to its file after every change."""

    def __init__(self, path: str):
        self.path = path
        # The suite's own temporary folder: removed by the suite even when
        # it kills this process.
        self.workdir = os.path.dirname(os.path.abspath(path))
        self.results = {}
        self.note = None

    def save(self) -> None:
        with open(self.path + ".tmp", "w") as f:
            json.dump({"results": self.results, "note": self.note}, f,
                      allow_nan=False)
        os.replace(self.path + ".tmp", self.path)


def finite(value):
    """`value` as a float, or None when it is not a finite number."""
    value = float(value)
    return value if math.isfinite(value) else None


def physical_gpus(tf, dry_run: bool) -> list:
    """The GPUs TensorFlow sees; none is an error outside the dry run."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus and not dry_run:
        raise RuntimeError("No GPU visible to TensorFlow: this part is sized "
                           "for a GPU. Run the suite with --dry-run on a "
                           "CPU.")
    return gpus


def error_text(e: BaseException) -> str:
    """An exception in one line, for a configuration's `error`."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def time_left(budget_s: float) -> float:
    """Seconds of the part's budget left, counted from this process's start."""
    return budget_s - (time.monotonic() - STARTED)


def main(part: str, result_path: str, dry_run: bool, budget_s: float) -> int:
    """Runs one part in this process; its results go to `result_path`."""
    import keras_mgpu

    # Before the part imports TensorFlow: its C++ start-up lines would
    # fill the stderr tail a failure's note shows.
    keras_mgpu.quiet_tensorflow()
    recorder = Recorder(result_path)
    importlib.import_module(f"{__package__}.{part}").run(
        recorder, dry_run, budget_s)
    recorder.save()
    return 0
