"""The tuner's names and argument checks: the hyperparameters the hypermodel
reads or declares, the metrics it records, and the checks of the values
given to `StrategyAwareHyperModel` and `plan_workers`."""

from __future__ import annotations

from typing import Optional

import keras_tuner

from keras_mgpu import data as data_lib
from keras_mgpu._checks import is_positive_integer

LR_SCALING_RULES = ("linear", "sqrt", None)
"""The `lr_scaling` rules of `StrategyAwareHyperModel`: the learning rate
scaled by the effective batch's ratio to the reference batch (`"linear"`),
by its square root (`"sqrt"`), or left as `build_fn` set it (`None`)."""

# Hyperparameter names the hypermodel reads or declares.
LEARNING_RATE_HP = "learning_rate"
"""The hyperparameter name of the (unscaled) learning rate."""
PER_REPLICA_BATCH_HP = "per_replica_batch_size"
"""The hyperparameter name of the per-replica batch size."""
ACCUM_STEPS_HP = "accum_steps"
"""The hyperparameter name of the gradient accumulation steps."""
PRECISION_HP = "precision"
"""The hyperparameter name of the precision policy."""

# Metrics added to each trial (constant over its epochs): what the trial
# really trained with on this cluster.
EFFECTIVE_KEYS = (
    "effective/replicas",
    "effective/per_replica_batch_size",
    "effective/global_batch_size",
    "effective/accum_steps",
    "effective/batch_size",
    "effective/lr_scale",
    "effective/learning_rate",
)
"""The metrics added to each trial (constant over its epochs): what the
trial really trained with on this cluster."""

_PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
_DEFAULT_BATCH = 32  # Keras's own default `batch_size`, here per replica.


def _dataset_batch(dataset, replicas: int, per_replica: Optional[int]) -> int:
    """The per-replica batch of a batched dataset: `per_replica` checked
    against it (used as batched), or read from it (`None`)."""
    batch = data_lib.batch_size_of(dataset)
    if per_replica is None:
        if batch % replicas:
            raise keras_tuner.errors.FatalValueError(
                f"The tf.data input's batch of {batch} does not split evenly "
                f"over {replicas} replicas. Batch it to a multiple of "
                f"{replicas}, or pass per_replica_batch_size (with "
                "rebatch=True, the default)."
            )
        return batch // replicas
    if batch != per_replica * replicas:
        raise keras_tuner.errors.FatalValueError(
            f"per_replica_batch_size={per_replica} with {replicas} replicas "
            f"needs a global batch of {per_replica * replicas}, but the "
            f"tf.data input is batched to {batch} (rebatch=False), which "
            + (f"{per_replica} does not divide" if batch % per_replica
               else "is a different size")
            + ". Pass rebatch=True (the default) to re-batch it per trial, "
            f"or batch the dataset to {per_replica * replicas}."
        )
    return per_replica


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _positive_int(name: str, value) -> int:
    """`value` as an int (NumPy integers too), or a `ValueError` naming it."""
    if not is_positive_integer(value):
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return int(value)


def _choices(name: str, value):
    """`None`, an int, or a list of ints (to tune): checked and converted,
    as KerasTuner stores choices as plain Python values."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        return _positive_int(name, value)
    if not value:
        raise ValueError(f"{name} must not be an empty list.")
    return [_positive_int(name, v) for v in value]
