"""`ScaledSchedule`: a learning-rate schedule multiplied by a constant factor."""

from __future__ import annotations

from typing import Any

import keras

__all__ = ["ScaledSchedule"]


@keras.saving.register_keras_serializable(package="keras_mgpu")
class ScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule multiplied by a constant factor.

    `keras_mgpu.tuner.StrategyAwareHyperModel` wraps a trial's schedule in
    it to scale the learning rate to the trial's effective batch. It is
    registered with Keras (`"keras_mgpu>ScaledSchedule"`) by
    `import keras_mgpu`, so a model saved with it loads without
    keras-tuner installed or imported.

    Args:
        schedule: The base `keras.optimizers.schedules.LearningRateSchedule`.
        scale: The factor, a float.

    Example:

    >>> import keras
    >>> from keras_mgpu.schedules import ScaledSchedule
    >>> base = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    >>> round(float(ScaledSchedule(base, 4.0)(0)), 6)
    0.4
    >>> again = ScaledSchedule.from_config(ScaledSchedule(base, 4.0).get_config())
    >>> round(float(again(10)), 6)
    0.2
    """

    def __init__(self,
                 schedule: keras.optimizers.schedules.LearningRateSchedule,
                 scale: float):
        self.schedule = schedule
        self.scale = float(scale)

    def __call__(self, step: Any) -> Any:
        return self.schedule(step) * self.scale

    def get_config(self) -> dict:
        return {
            "schedule": keras.saving.serialize_keras_object(self.schedule),
            "scale": self.scale,
        }

    @classmethod
    def from_config(cls, config: dict) -> ScaledSchedule:
        config = dict(config)
        config["schedule"] = keras.saving.deserialize_keras_object(
            config["schedule"]
        )
        return cls(**config)
