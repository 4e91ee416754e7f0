"""What every backend's accumulation step shares with
`keras_mgpu.accumulation`: the accumulators' dtype and the loss-scale floor."""

from __future__ import annotations

import keras

# The loss scale never drops below this under GradientAccumulationModel.
MIN_LOSS_SCALE = 1.0


def accumulator_dtype(dtype) -> str:
    """Half-precision gradients are summed in float32."""
    dtype = keras.backend.standardize_dtype(dtype)
    return "float32" if dtype in ("float16", "bfloat16") else dtype
