"""keras-mgpu: drop-in Keras 3 components for multi-GPU, multi-worker training.

`import keras_mgpu` imports the core submodules (`callbacks`, `compat`,
`data`, `layers`, `mixed_precision`, `schedules`, `strategy`), which
registers every serializable class with Keras. The others (`cli`,
`launcher`, `runtime`, `tuner`) are imported on first access as attributes:
`keras_mgpu.tuner` imports keras-tuner only then, and raises `ImportError`
with the install command when it is missing.

To start TensorFlow without its C++ log lines, call
`keras_mgpu_quiet.quiet_tensorflow()` before importing this package.
"""

import importlib
import os
import sys


def _started_as_cli() -> bool:
    # `python -m keras_mgpu.cli` imports this package before the module it
    # runs (sys.argv[0] is "-m" meanwhile), so the command's quiet start has
    # to happen here, as the `keras-mgpu` console script's does before it
    # imports this package.
    if sys.argv[:1] != ["-m"]:
        return False
    args = getattr(sys, "orig_argv", [])
    return any(a == "keras_mgpu.cli" and args[i - 1] == "-m"
               or a == "-mkeras_mgpu.cli" for i, a in enumerate(args))


if _started_as_cli():
    from keras_mgpu_quiet import quiet_tensorflow

    quiet_tensorflow()

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from keras_mgpu import backend  # noqa: E402

backend.active()  # refuses a Keras backend keras-mgpu has no module for

from keras_mgpu import callbacks  # noqa: E402,F401
from keras_mgpu import compat  # noqa: E402,F401
from keras_mgpu import data  # noqa: E402,F401
from keras_mgpu import layers  # noqa: E402,F401
from keras_mgpu import mixed_precision  # noqa: E402,F401
from keras_mgpu import schedules  # noqa: E402,F401
from keras_mgpu import strategy  # noqa: E402,F401
from keras_mgpu.accumulation import GradientAccumulationModel  # noqa: E402,F401
from keras_mgpu.strategy import auto_strategy  # noqa: E402,F401
from keras_mgpu.strategy import global_batch_size  # noqa: E402,F401
from keras_mgpu.strategy import is_chief  # noqa: E402,F401
from keras_mgpu.strategy import num_replicas  # noqa: E402,F401
from keras_mgpu.strategy import num_workers  # noqa: E402,F401
from keras_mgpu.strategy import worker_index  # noqa: E402,F401

from keras_mgpu._version import __version__  # noqa: E402,F401

# Submodules imported on first attribute access (PEP 562): `tuner` needs the
# optional keras-tuner, the others are not needed to train.
_LAZY_SUBMODULES = ("cli", "launcher", "runtime", "tuner")


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        # Importing a submodule also sets it as this package's attribute.
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))
