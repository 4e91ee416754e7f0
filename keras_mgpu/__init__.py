"""keras-mgpu: drop-in Keras 3 components for multi-GPU, multi-worker training.

`import keras_mgpu` is cheap: it imports neither Keras nor TensorFlow. The
components load on first use (`keras_mgpu.BackupAndRestore`, or `import
keras_mgpu.callbacks`), and once Keras is imported, before or after this
package, the core comes with it (`callbacks`, `compat`, `data`, `layers`,
`mixed_precision`, `schedules`, `strategy`, `accumulation`), which
registers every serializable class with Keras. `keras_mgpu.tuner` imports
keras-tuner only then, and raises `ImportError` with the install command
when it is missing.

So a script can start with

    import keras_mgpu
    keras_mgpu.quiet_tensorflow()  # TensorFlow without its C++ log lines

and `python -m keras_mgpu` runs the `keras-mgpu` command.
"""

import importlib
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from keras_mgpu import _with_keras  # noqa: E402
from keras_mgpu._version import __version__  # noqa: E402,F401

# Public names of the package root, and the module each comes from.
_NAMES = {
    "BackupAndRestore": "callbacks",
    "DistributedLogger": "callbacks",
    "FP32OutputHead": "layers",
    "GradientAccumulationModel": "accumulation",
    "LossScaleMonitor": "callbacks",
    "auto_strategy": "strategy",
    "global_batch_size": "strategy",
    "is_chief": "strategy",
    "num_replicas": "strategy",
    "num_workers": "strategy",
    "worker_index": "strategy",
}
# Root names that need neither Keras nor TensorFlow.
_LIGHT_NAMES = {"quiet_tensorflow": "quiet"}
# Submodules imported on first attribute access (PEP 562).
_SUBMODULES = _with_keras.CORE + (
    "backend", "cli", "cluster", "goodput", "launcher", "quiet", "runtime",
    "slurm", "tuner")
__all__ = sorted(_NAMES) + sorted(_LIGHT_NAMES) + ["__version__"]


def __getattr__(name: str):
    if name in _NAMES or name in _LIGHT_NAMES:
        if name in _NAMES:
            _with_keras.load()
        module = _NAMES.get(name) or _LIGHT_NAMES[name]
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        if name in _with_keras.CORE:
            _with_keras.load()
        # Importing a submodule also sets it as this package's attribute.
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))


_with_keras.install()
