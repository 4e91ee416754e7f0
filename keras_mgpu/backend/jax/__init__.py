"""keras-mgpu on Keras's JAX backend (`keras.distribution`).

`distribution`: the distribution facts (replicas along the batch axis,
JAX processes); `accumulation`: `GradientAccumulationModel`'s train step
(window and in-step modes, the in-step window reduced across devices once
per step under `shard_map`); `collectives`: host values from every
process; `runtime`: the training runtime's halves (the train-function
wrapper counting and timing each call's host fetches, and handing a
resumed run's first calls to the runtime's skipping).
"""

from keras_mgpu.backend.jax.accumulation import AccumulationSteps  # noqa: F401
from keras_mgpu.backend.jax.collectives import gather_rows  # noqa: F401
from keras_mgpu.backend.jax.collectives import sum_over_workers  # noqa: F401
from keras_mgpu.backend.jax.runtime import TrainFunctionWrapper  # noqa: F401

NAME = "jax"
