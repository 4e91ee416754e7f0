"""keras-mgpu: drop-in Keras 3 components for multi-GPU, multi-worker training.

`import keras_mgpu` is cheap: it imports neither Keras nor TensorFlow. The
components load on first use (`keras_mgpu.BackupAndRestore`, or `import
keras_mgpu.callbacks`), and once Keras is imported, before or after this
package, the core comes with it (`callbacks`, `compat`, `data`, `layers`,
`mixed_precision`, `schedules`, `strategy`, `accumulation`), which
registers every serializable class with Keras. `keras_mgpu.tuner` imports
keras-tuner only then, and raises `ImportError` with the install command
when it is missing.

To start TensorFlow without its C++ log lines, call
`keras_mgpu_quiet.quiet_tensorflow()` before TensorFlow is imported.
"""

import importlib
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from keras_mgpu import _with_keras  # noqa: E402
from keras_mgpu._version import __version__  # noqa: E402,F401

# Public names of the package root, and the module each comes from.
_NAMES = {
    "GradientAccumulationModel": "accumulation",
    "auto_strategy": "strategy",
    "global_batch_size": "strategy",
    "is_chief": "strategy",
    "num_replicas": "strategy",
    "num_workers": "strategy",
    "worker_index": "strategy",
}
# Submodules imported on first attribute access (PEP 562).
_SUBMODULES = _with_keras.CORE + (
    "backend", "cli", "cluster", "launcher", "runtime", "slurm", "tuner")


def __getattr__(name):
    if name in _NAMES:
        _with_keras.load()
        value = getattr(importlib.import_module(
            f"{__name__}.{_NAMES[name]}"), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        if name in _with_keras.CORE:
            _with_keras.load()
        # Importing a submodule also sets it as this package's attribute.
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_NAMES) | set(_SUBMODULES))


_with_keras.install()
