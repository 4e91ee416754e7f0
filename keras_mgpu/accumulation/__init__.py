"""`GradientAccumulationModel`: one optimizer step per N micro-batches.

`model` is the Keras model wrapper (config, serialization, the train step);
`window` the window's state (accumulators, counters, the partial-window
policy at epoch end); `in_step` the window inside one step; `step` the
micro-batch math both modes share (one all-reduce per window).
"""

from keras_mgpu.accumulation.in_step import MAX_ACCUM_STEPS  # noqa: F401
from keras_mgpu.accumulation.model import MODES  # noqa: F401
from keras_mgpu.accumulation.model import GradientAccumulationModel  # noqa: F401
from keras_mgpu.accumulation.step import MIN_LOSS_SCALE  # noqa: F401
from keras_mgpu.accumulation.window import PARTIAL_WINDOW_MODES  # noqa: F401
