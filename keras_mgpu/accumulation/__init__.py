"""`GradientAccumulationModel`: one optimizer step per N micro-batches.

`model` is the Keras model wrapper (validation, config, serialization);
`window` the window's state (accumulators, counters, their saving, the
partial-window policy at epoch end). The train step that fills and
applies the window is the backend's (`keras_mgpu.backend.<name>.
AccumulationSteps`): under `tf.distribute` one all-reduce per window
through `merge_call`, under `keras.distribution` on JAX one `psum` per
in-step window under `shard_map`.
"""

from keras_mgpu.accumulation.model import MAX_ACCUM_STEPS  # noqa: F401
from keras_mgpu.accumulation.model import MODES  # noqa: F401
from keras_mgpu.accumulation.model import GradientAccumulationModel  # noqa: F401
from keras_mgpu.accumulation.window import MIN_LOSS_SCALE  # noqa: F401
from keras_mgpu.accumulation.window import PARTIAL_WINDOW_MODES  # noqa: F401

__all__ = [
    "GradientAccumulationModel", "MODES", "PARTIAL_WINDOW_MODES",
    "MAX_ACCUM_STEPS", "MIN_LOSS_SCALE",
]
