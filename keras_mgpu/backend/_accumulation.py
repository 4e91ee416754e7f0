"""What every backend's accumulation step shares with
`keras_mgpu.accumulation`: the accumulators' dtype and the loss-scale floor."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import keras

# The loss scale never drops below this under GradientAccumulationModel.
MIN_LOSS_SCALE = 1.0
"""The floor of a `LossScaleOptimizer`'s dynamic loss scale under
`GradientAccumulationModel`: overflowing windows halve it down to this."""


def accumulator_dtype(dtype: Any) -> str:
    """Half-precision gradients are summed in float32."""
    dtype = keras.backend.standardize_dtype(dtype)
    return "float32" if dtype in ("float16", "bfloat16") else dtype


if TYPE_CHECKING:

    class AccumulationHost:
        """For type checkers only: what the accumulation mixins
        (`keras_mgpu.accumulation`'s `_WindowMixin` and each backend's
        `AccumulationSteps`) read from the class that combines them,
        `GradientAccumulationModel`. At run time they derive from `object`.
        """

        # keras.Model's.
        name: str
        optimizer: Any
        trainable_variables: list[Any]
        non_trainable_variables: list[Any]
        distribute_strategy: Any
        jit_compile: bool

        def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

        def compute_metrics(self, x: Any, y: Any, y_pred: Any,
                            sample_weight: Any = None) -> dict[str, Any]: ...

        def compute_loss_and_updates(self, *args: Any,
                                     **kwargs: Any) -> Any: ...

        # GradientAccumulationModel's (keras_mgpu/accumulation/model.py).
        inner: Any
        accum_steps: int
        partial_window: str
        log_window: bool
        mode: str

        # _WindowMixin's (keras_mgpu/accumulation/window.py).
        _window_state: Any
        _accumulated_ids: tuple[int, ...]
        _overwrite_indices: tuple[int, ...]
        _regular_indices: tuple[int, ...]

        @property
        def _accumulators(self) -> list[Any]: ...

        @property
        def _sample_count(self) -> Any: ...

        @property
        def _micro_step(self) -> Any: ...

        @property
        def _grad_norm(self) -> Any: ...

        @property
        def _update_count(self) -> Any: ...

        @property
        def _updated(self) -> Any: ...

        @property
        def micro_step(self) -> int: ...

        def _check_variables(self) -> None: ...

        # The backend's AccumulationSteps'.
        _COUNTER_DTYPE: str

        @staticmethod
        def _new_window_state() -> Any: ...

        def _track_window(self, state: Any) -> None: ...

        def _finish_epoch(self) -> None: ...
