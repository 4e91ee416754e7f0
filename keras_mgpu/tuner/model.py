"""What the hypermodel does to the model `build_fn` returns: the build-time
checks, the gradient-accumulation wrapping and the learning-rate scaling
(the rate set on the optimizer, or its schedule scaled)."""

from __future__ import annotations

import inspect
import math
from typing import Optional

import keras
import keras_tuner

from keras_mgpu import compat
from keras_mgpu.accumulation import GradientAccumulationModel
from keras_mgpu.schedules import ScaledSchedule


def _accum_steps_of(model) -> int:
    if isinstance(model, GradientAccumulationModel):
        return model.accum_steps
    return 1


def _check_compiled(model):
    if not isinstance(model, keras.Model):
        raise keras_tuner.errors.FatalTypeError(
            f"build_fn must return a compiled keras.Model, got "
            f"{type(model).__name__}."
        )
    if getattr(model, "optimizer", None) is None:
        raise keras_tuner.errors.FatalValueError(
            f"build_fn must return a compiled keras.Model, but it returned an "
            f"uncompiled {type(model).__name__}. Call model.compile(optimizer, "
            "loss, ...) in build_fn before returning the model: each trial "
            "trains it with fit, and the hypermodel scales its optimizer's "
            "learning rate."
        )
    if not isinstance(model.optimizer, keras.optimizers.Optimizer):
        # Checked before any optimizer attribute is read: anything else
        # would fail later as a missing Keras internal.
        raise keras_tuner.errors.FatalTypeError(
            f"build_fn returned a model whose optimizer is "
            f"{model.optimizer!r} (a {type(model.optimizer).__name__}), but "
            "StrategyAwareHyperModel needs a keras.optimizers.Optimizer (any "
            "lr_scaling). Compile the model with one, e.g. "
            "model.compile(keras.optimizers.Adam(hp.Float('learning_rate', "
            "1e-4, 1e-2, sampling='log')), loss)."
        )
    return model


def _set_learning_rate(model, base, scale: Optional[float]) -> None:
    optimizer = model.optimizer
    # A LossScaleOptimizer forwards to its inner optimizer.
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    rate = compat.learning_rate_callable(inner)
    if rate is not None:
        raise keras_tuner.errors.FatalValueError(
            f"The optimizer's learning rate is a {type(rate).__name__} "
            f"({rate!r}), which keras-mgpu cannot scale to the trial's batch. "
            "Give the optimizer the base rate as a float "
            "(hp.Float('learning_rate', ...)) or a "
            "keras.optimizers.schedules.LearningRateSchedule built from it, "
            "or pass lr_scaling=None to keep the rate build_fn set."
        )
    if scale is None:
        return
    current = compat.learning_rate_schedule(inner)
    if isinstance(current, ScaledSchedule):
        current.scale = float(scale)
    elif current is not None:
        inner.learning_rate = ScaledSchedule(current, scale)
    else:
        inner.learning_rate = float(base) * float(scale)


def _overwritten_rate(model, base) -> Optional[float]:
    """The fixed rate `build_fn` gave the optimizer, when scaling replaces it
    with a different one; None for the hyperparameter's value, the
    optimizer's default rate, or a schedule (which is scaled, not
    replaced)."""
    inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    if (compat.learning_rate_schedule(inner) is not None
            or compat.learning_rate_callable(inner) is not None):
        return None
    fixed = float(keras.ops.convert_to_numpy(inner.learning_rate))
    parameter = inspect.signature(type(inner).__init__).parameters.get(
        "learning_rate")
    default = None if parameter is None else parameter.default
    for expected in (base, default):
        if isinstance(expected, (int, float)) and math.isclose(
                fixed, float(expected), rel_tol=1e-6):
            return None
    return fixed


def _current_learning_rate(model) -> Optional[float]:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return None
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    schedule = compat.learning_rate_schedule(inner)
    if schedule is not None:
        return float(schedule(0))  # The rate at step 0.
    return float(keras.ops.convert_to_numpy(inner.learning_rate))


def _maybe_accumulate(model, accum_steps: Optional[int]):
    if isinstance(model, GradientAccumulationModel):
        if accum_steps is not None and accum_steps != model.accum_steps:
            raise keras_tuner.errors.FatalValueError(
                f"build_fn returned a GradientAccumulationModel with "
                f"accum_steps={model.accum_steps}, but the hypermodel has "
                f"accum_steps={accum_steps}. Either return the plain model "
                "and let the hypermodel wrap it, or pass accum_steps=None."
            )
        return model
    if accum_steps is None or accum_steps == 1:
        return model
    compile_args = keras.saving.deserialize_keras_object(
        model.get_compile_config()
    )
    try:
        # From its config, not clone_model: a clone comes back compiled, and
        # the wrapper refuses a compiled inner model.
        inner = type(model).from_config(model.get_config())
    except Exception as e:
        raise keras_tuner.errors.FatalValueError(
            f"Cannot tune accum_steps={accum_steps}: the model returned by "
            f"build_fn cannot be rebuilt uncompiled from its config ({e}). "
            "Return a keras_mgpu.GradientAccumulationModel from build_fn "
            "yourself (reading hp.Choice('accum_steps', ...)) and pass "
            "accum_steps=None."
        ) from e
    if model.built and inner.built:
        inner.set_weights(model.get_weights())
    wrapper = GradientAccumulationModel(inner, accum_steps=accum_steps)
    wrapper.compile(**compile_args)
    return wrapper
