"""The training runtime's backend halves on JAX: not built yet.

`keras_mgpu.runtime.TrainingRuntime` (under `DistributedLogger`,
`BackupAndRestore` and `LossScaleMonitor`) replaces Keras's train function
to count and time what each call reads, and skips what a resumed run
already trained on; on JAX that wrapper is not written yet, so making a
runtime says so instead of training without what the callback promises.
"""

from __future__ import annotations


class TrainFunctionWrapper:
    """Refuses to make a training runtime on JAX (see the module)."""

    def __new__(cls, *args, **kwargs):
        raise NotImplementedError(
            "keras-mgpu's DistributedLogger, BackupAndRestore and "
            "LossScaleMonitor do not run on Keras's JAX backend yet (their "
            "training runtime wraps the TensorFlow train function). Train "
            "with KERAS_BACKEND=tensorflow to use them; "
            "GradientAccumulationModel, FP32OutputHead and the distribution "
            "facts (keras_mgpu.num_replicas() and others) work on JAX.")


class ResumeSkipping:
    """The resume's skipping on JAX: nothing until the runtime exists."""
