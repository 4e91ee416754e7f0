"""The `keras-mgpu` console script: parses its arguments without TensorFlow.

    keras-mgpu doctor [--json] [--need tuner,profile,wandb]
    keras-mgpu bench [--model resnet|mlp] [--replicas 1,2,4]
                     [--precision float32,mixed] [--accum 1,4]
                     [--steps 20] [--batch-size 64] [--json PATH]
                     [--plot out.png]
    keras-mgpu launch --workers N [--max-restarts R] -- COMMAND [ARGS ...]

The arguments are parsed by `keras_mgpu_args` (standard library only,
names re-exported here), and `main` imports `keras_mgpu.cli`, which runs
the command, only once they parse; `doctor` and `bench` import TensorFlow
then, `launch` never does.

`quiet_tensorflow()` (from `keras_mgpu_quiet`, also importable from here)
imports TensorFlow without the log lines it prints while it loads.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from keras_mgpu_args import FEATURES  # noqa: F401
from keras_mgpu_args import MAX_REPLICAS  # noqa: F401
from keras_mgpu_args import MODELS  # noqa: F401
from keras_mgpu_args import PRECISIONS  # noqa: F401
from keras_mgpu_args import build_parser  # noqa: F401
from keras_mgpu_args import parse_args
from keras_mgpu_args import parse_choice_list  # noqa: F401
from keras_mgpu_args import parse_int_list  # noqa: F401
from keras_mgpu_quiet import quiet_tensorflow  # noqa: F401


# --- The command -----------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs `keras-mgpu` with `argv`; returns the exit code.

    The arguments are checked before TensorFlow is imported, so `--help` and
    a bad value answer at once; then `keras_mgpu.cli` runs the command
    (`doctor` and `bench` import TensorFlow with `quiet_tensorflow()`).

    Args:
        argv: Defaults to `None`, the command line (`sys.argv[1:]`).

    Returns:
        0 when the command succeeded, 1 when `doctor` found an error or
        `bench` failed. Argument errors exit with 2 (`SystemExit`), as
        argparse does.

    Example:

    >>> main(["bench", "--replicas", "0"])  # doctest: +SKIP
    usage: keras-mgpu bench ...
    keras-mgpu bench: error: argument --replicas: --replicas: 0 is out of \
range; each value must be from 1 to 64.
    """
    args = parse_args(argv)
    from keras_mgpu import cli

    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
