"""The GPU suite's parts and runner; `benchmarks/gpu_suite.py` is the command.

The command's docstring documents what the suite measures and the JSON it
writes. Its pieces:

- `suite`: runs the parts in order within the budget, writes the files;
- `runner`: one command at a time in its own process group, and the
  entries and notes recorded for a part;
- `parts`: the parent's side of each part: `machine` and `gpu_tests` run
  as commands, the others as `gpu_suite.py --_part NAME`;
- `report`: the Markdown report;
- `child`: a part's own process (its results file, shared helpers);
- `resnet50`, `logical_gpus`, `overheads`: the parts that import
  TensorFlow, a module each, named as the part, each with
  `run(recorder, dry_run, budget_s)`.

Everything the parent imports is standard library only: a Python without
TensorFlow still gets both files, every part skipped with a note.
"""

import os
import time

# A part's process counts its budget from here (the command imports this
# package first): TensorFlow's import (5 to 15 s) is part of what the
# budget pays for.
STARTED = time.monotonic()

SCHEMA = "keras-mgpu-gpu-suite/1"
# 8 minutes on the GPU machine, with half a minute to spare for the
# processes' start and the files.
DEFAULT_BUDGET_S = 450.0
BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(BENCHMARKS)
# The command; a part's process is this file run again with `--_part`.
ENTRY = os.path.join(BENCHMARKS, "gpu_suite.py")
JSON_NAME, MARKDOWN_NAME = "gpu_suite.json", "gpu_suite.md"

# (name, share of the budget, what it measures). ResNet-50 gets the largest
# share: six configurations, three of them compiled by XLA (tens of seconds
# each on a GPU).
PARTS = (
    ("machine", 0.05, "keras-mgpu doctor --json and the driver version"),
    ("gpu_tests", 0.20, "pytest -m gpu"),
    ("resnet50", 0.40, "ResNet-50 examples/s and peak memory, 3 policies x "
                       "jit_compile"),
    ("logical_gpus", 0.10, "2 logical GPUs: accumulation exactness and "
                           "all-reduces per step"),
    ("overheads", 0.25, "accumulation, DistributedLogger and "
                        "BackupAndRestore against plain fit"),
)
PART_NAMES = tuple(name for name, _, _ in PARTS)
# The parts with a process of their own, each a module of this package.
CHILD_PARTS = ("resnet50", "logical_gpus", "overheads")

# The accumulation steps of `logical_gpus` and `overheads` (the report
# names it too).
ACCUM_STEPS = 4
