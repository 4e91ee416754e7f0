"""The backend seam: what keras-mgpu does differently on each Keras backend.

`active()` is the module of the backend Keras runs on. Everything that
depends on how a backend trains or communicates sits in that module, and
the rest of keras-mgpu reaches it only through these names:

- `NAME`: the Keras backend it serves (`keras.backend.backend()`);
- `distribution`, a submodule (`backend.distribution()` imports it): the
  distribution facts `keras_mgpu.strategy` answers through;
- `AccumulationSteps`: `GradientAccumulationModel`'s train step;
- `gather_rows(strategy, row, num_workers)` and
  `sum_over_workers(strategy, value, num_workers)`: host values from every
  worker, for the logger's cross-worker figures and the backup's agreement;
- `TrainFunctionWrapper`: the half of `keras_mgpu.runtime.TrainingRuntime`
  that replaces `model.train_function` (counting and timing what each call
  reads, and handing a resumed run's first calls to the runtime's
  skipping). It is a mixin of the runtime and keeps its state on it
  (`keras_mgpu/runtime/core.py` lists it). It also answers the runtime's
  backend hooks: `_check_support()`, `_new_input_wait()`, `_sync_state()`,
  `_next_batch(iterator)`, `_batch_samples(element)`,
  `read_device(read, cached, key, compiled)`, `host_array(value)`,
  `local_gpus()`, `gpu_memory(num_gpus, reset)`, `ready_fetch_seconds()`.

`tensorflow/` serves `tf.distribute`, `jax/` `keras.distribution`; another
backend is a package next to them providing the same names, and its entry
in `_BACKENDS`.

Example:

>>> active().NAME
'tensorflow'
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Optional

import keras

_BACKENDS = {
    "tensorflow": "keras_mgpu.backend.tensorflow",
    "jax": "keras_mgpu.backend.jax",
}


def active(name: Optional[str] = None) -> ModuleType:
    """The backend module for the Keras backend `name`.

    Args:
        name: A Keras backend's name. Defaults to None: the one Keras runs
            on (`keras.backend.backend()`).

    Raises:
        ImportError: keras-mgpu has no module for that backend.
    """
    return importlib.import_module(_package(name))


def distribution(name: Optional[str] = None) -> ModuleType:
    """The distribution facts of the Keras backend `name` (default: the
    active one): `num_replicas(strategy, call)`, `num_workers()`,
    `worker_index()`, `is_chief()`, `is_multi_worker(strategy)`,
    `of_model(model)`, `scope_of(model)`, `current()` and `restore(d)`.

    `keras_mgpu.strategy`'s public facts answer through it.

    Args:
        name: A Keras backend's name. Defaults to None: the active one.
    """
    return importlib.import_module(_package(name) + ".distribution")


def _package(name: Optional[str]) -> str:
    name = keras.backend.backend() if name is None else name
    module = _BACKENDS.get(name)
    if module is None:
        raise ImportError(
            f"keras-mgpu runs on Keras's TensorFlow and JAX backends, but "
            f"the active backend is {name!r} (KERAS_BACKEND="
            f"{os.environ.get('KERAS_BACKEND')!r}). Set KERAS_BACKEND to "
            "tensorflow or jax before importing keras or keras_mgpu.")
    return module
