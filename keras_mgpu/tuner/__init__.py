"""KerasTuner on many devices: strategy-aware hypermodels and a trial launcher.

`StrategyAwareHyperModel` wraps a model-building function (or a
`keras_tuner.HyperModel`) so that every trial
of any KerasTuner tuner (`RandomSearch`, `BayesianOptimization`, `Hyperband`,
`GridSearch`) trains with a per-replica batch, a learning rate scaled to the
trial's effective batch, optional gradient accumulation and precision policy
as hyperparameters, and a per-trial `BackupAndRestore`, and records the
effective values (replicas, global batch, scaled learning rate) with the
trial's metrics so results from different cluster sizes can be compared.

`launch` starts KerasTuner's parallel tuning on one host: a chief process
holding the oracle and one worker process per device group.

keras-tuner is an optional dependency: `pip install "keras-mgpu[tuner]"`.
`import keras_mgpu` does not import this package (nor keras-tuner): the
first use of `keras_mgpu.tuner`, or `from keras_mgpu import tuner`, does.

One module per job: `hypermodel` (`StrategyAwareHyperModel`), `model` (the
build-time checks of a trial's model, accumulation wrapping, learning-rate
scaling), `options` (hyperparameter names, recorded metrics, argument
checks), `trial` (the history saved with a trial's backup) and `parallel`
(`plan_workers`, `local_gpus`, `launch`: the parallel search's processes).
"""

from __future__ import annotations

try:
    import keras_tuner  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in a test by hiding it
    raise ImportError(
        "keras_mgpu.tuner needs keras-tuner, which is not installed "
        f"({e}). Install it with: pip install \"keras-mgpu[tuner]\" "
        "(or pip install keras-tuner)."
    ) from e

from keras_mgpu.tuner.hypermodel import StrategyAwareHyperModel  # noqa: F401
from keras_mgpu.tuner.options import ACCUM_STEPS_HP  # noqa: F401
from keras_mgpu.tuner.options import EFFECTIVE_KEYS  # noqa: F401
from keras_mgpu.tuner.options import LEARNING_RATE_HP  # noqa: F401
from keras_mgpu.tuner.options import LR_SCALING_RULES  # noqa: F401
from keras_mgpu.tuner.options import PER_REPLICA_BATCH_HP  # noqa: F401
from keras_mgpu.tuner.options import PRECISION_HP  # noqa: F401
from keras_mgpu.tuner.parallel import launch  # noqa: F401
from keras_mgpu.tuner.parallel import local_gpus  # noqa: F401
from keras_mgpu.tuner.parallel import plan_workers  # noqa: F401
# Registered for loading on `import keras_mgpu`, which needs no keras-tuner;
# re-exported here, where it has always been importable from.
from keras_mgpu.schedules import ScaledSchedule  # noqa: F401
# Private, re-exported for tests/test_tuner.py, which reads it here.
from keras_mgpu.tuner.model import _set_learning_rate  # noqa: F401

__all__ = [
    "StrategyAwareHyperModel", "launch", "plan_workers", "local_gpus",
    "ScaledSchedule", "LEARNING_RATE_HP", "PER_REPLICA_BATCH_HP",
    "ACCUM_STEPS_HP", "PRECISION_HP", "LR_SCALING_RULES", "EFFECTIVE_KEYS",
]
