"""The training runtime under keras-mgpu's callbacks: one wrapper, one set of
counters.

`core` is the runtime itself (`TrainingRuntime`, `training_runtime(model)`,
the hooks callbacks call); `counters` its counters (`RunCounters`,
`ResumeEvent`, the reads and the `state()`/`resume()` a backup carries);
`callback` the base of keras-mgpu's callbacks (`RuntimeCallback`), which
tells the runtime each of Keras's training hooks; `skipping` the batches a
resumed run reads without training on them. The wrapper of
`model.train_function` is the backend's (`keras_mgpu.backend`).
"""

from keras_mgpu.runtime.callback import RuntimeCallback  # noqa: F401
from keras_mgpu.runtime.core import TrainingRuntime  # noqa: F401
from keras_mgpu.runtime.core import training_runtime  # noqa: F401
from keras_mgpu.runtime.counters import ResumeEvent  # noqa: F401
from keras_mgpu.runtime.counters import RunCounters  # noqa: F401

__all__ = [
    "TrainingRuntime", "training_runtime", "RuntimeCallback", "RunCounters",
    "ResumeEvent",
]
