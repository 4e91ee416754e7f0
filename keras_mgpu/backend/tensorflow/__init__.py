"""keras-mgpu on Keras's TensorFlow backend (`tf.distribute` strategies).

`distribution`: the distribution facts (replicas of the strategy in
scope, workers of the `TF_CONFIG` cluster); `accumulation`:
`GradientAccumulationModel`'s train step (`AccumulationSteps`);
`collectives`: host values from every worker, one compiled all-gather per
strategy and row size; `train_function`: the runtime's wrapper of Keras's
compiled train function (counting, timing, and handing a resumed run's
first calls to the runtime's skipping).
"""

from keras_mgpu.backend.tensorflow.accumulation import AccumulationSteps  # noqa: F401
from keras_mgpu.backend.tensorflow.collectives import gather_rows  # noqa: F401
from keras_mgpu.backend.tensorflow.collectives import sum_over_workers  # noqa: F401
from keras_mgpu.backend.tensorflow.train_function import TrainFunctionWrapper  # noqa: F401

NAME = "tensorflow"
