"""The training runtime under keras-mgpu's callbacks: one wrapper, one set of
counters.

`core` is the runtime itself (`TrainingRuntime`, `training_runtime(model)`,
the hooks callbacks call); `counters` its counters (`RunCounters`,
`ResumeEvent`, the reads and the `state()`/`resume()` a backup carries);
`train_function` the wrapper of `model.train_function`; `skipping` what a
resumed run skips of its first epoch.
"""

from keras_mgpu.runtime.core import TrainingRuntime  # noqa: F401
from keras_mgpu.runtime.core import training_runtime  # noqa: F401
from keras_mgpu.runtime.counters import ResumeEvent  # noqa: F401
from keras_mgpu.runtime.counters import RunCounters  # noqa: F401
