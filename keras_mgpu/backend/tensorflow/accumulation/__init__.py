"""`GradientAccumulationModel`'s train step under `tf.distribute`.

`AccumulationSteps` is the backend half `keras_mgpu.accumulation`'s model
derives from: `window` (one micro-batch per step into replica-local
accumulators), `in_step` (the window in a loop inside one step) and `step`
(the math both share: a micro-batch's weighted gradients, one all-reduce
and one update per window).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_mgpu import compat
from keras_mgpu.backend.tensorflow.accumulation.in_step import _InStepMixin
from keras_mgpu.backend.tensorflow.accumulation.step import _StepMixin
from keras_mgpu.backend.tensorflow.accumulation.window import _WindowStepMixin


class AccumulationSteps(_WindowStepMixin, _InStepMixin, _StepMixin):
    """The TensorFlow train step of `GradientAccumulationModel`."""

    _COUNTER_DTYPE = "int64"
    _loop_jit_compile = False

    @staticmethod
    def _check_backend_support():
        compat.check_accumulation_support()

    def _prepare_backend(self):
        compat.enable_multi_step_fit()
        if isinstance(tf.distribute.get_strategy(),
                      tf.distribute.MultiWorkerMirroredStrategy):
            compat.enable_multi_worker_fit()

    def _compiled(self):
        self._loop_jit_compile = False
        if self.mode == "in_step" and self.jit_compile:
            # Keras would compile the whole step, cross-device work included,
            # which XLA cannot do under a strategy: only the replica-local
            # micro-batch loop is compiled.
            self._loop_jit_compile = True
            self.jit_compile = False

    def _accumulation_train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self._check_variables()
        if not self.optimizer.built:
            # Without a strategy scope Keras builds the optimizer lazily in
            # `apply`; the window update needs its variables first.
            self.optimizer.build(self.trainable_variables)
        if self.mode == "in_step":
            return self._in_step_train_step(x, y, sample_weight)
        return self._window_train_step(x, y, sample_weight)

    def _logs(self, x, y, y_pred, sample_weight):
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if self.log_window:
            logs["grad_norm"] = tf.identity(self._grad_norm.value)
            logs["accum_step"] = tf.identity(self._micro_step.value)
        return logs
