"""`LossScaleMonitor`: the loss scale, skipped steps and non-finite values in `fit`'s logs."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import keras
import numpy as np

from keras_mgpu import compat
from keras_mgpu.layers.fp32_output_head import FP32OutputHead
from keras_mgpu.runtime import RuntimeCallback


def loss_scale(optimizer: Any) -> float | None:
    """The current dynamic loss scale of `optimizer`, or None if not loss-scaled.

    Args:
        optimizer: Any Keras optimizer; only a
            `keras.optimizers.LossScaleOptimizer` has a loss scale.

    Returns:
        The scale as a float (the initial scale before the first step), or
        `None`.

    Example:

    >>> import keras
    >>> from keras_mgpu.mixed_precision import loss_scale
    >>> loss_scale(keras.optimizers.SGD()) is None
    True
    >>> loss_scale(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    32768.0
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        if not optimizer.built:
            return float(optimizer.initial_scale)
        return float(np.asarray(optimizer.dynamic_scale))
    return None


class LossScaleMonitor(RuntimeCallback):
    """Logs the loss scale, the steps skipped for overflow and non-finite values.

    Adds to the batch and epoch logs of `fit` (so to Keras's progress bar and
    to `History`) only what matters for the run:
    - when the optimizer is a `keras.optimizers.LossScaleOptimizer` (the
      `mixed_float16` policy): `loss_scale`, its current dynamic scale;
      `skipped_steps`, optimizer steps skipped since the epoch began; and
      `skipped_steps_total`, steps skipped since this callback was created.
      Without a loss scale (`float32`, `mixed_bfloat16`) no step is skipped
      and none of the three is logged;
    - for each `keras_mgpu.layers.FP32OutputHead` of the model (nested
      models and `GradientAccumulationModel` included):
      `<head name>_nonfinite_inputs` and `<head name>_nonfinite_outputs`,
      the non-finite values (inf, NaN) it saw in this epoch's training
      batches so far, summed over replicas. They are logged from the first
      batch of a `fit` where either is non-zero to the end of that `fit`
      (so `History` has them only for the epochs from that one on); a run
      where everything stays finite never shows them.

    The same figures stay readable whatever is logged: the attributes
    `loss_scale`, `skipped_steps`, `skipped_steps_total` and
    `nonfinite_counts` (`{head name: {"inputs": n, "outputs": n}}` for the
    epoch so far), the head's own `FP32OutputHead.nonfinite_counts`, and
    `keras_mgpu.callbacks.DistributedLogger`'s `loss_scale` and
    `skipped_steps` fields.

    Skipped steps come from the training runtime shared with keras-mgpu's
    other callbacks (`keras_mgpu.runtime`): an optimizer step attempted (a
    batch, or a `GradientAccumulationModel` window) that did not advance
    `optimizer.iterations` was skipped, so a skipped window counts once.

    Warns (`warnings.warn`, `RuntimeWarning`) when the scale falls below
    `min_scale` and when `max_consecutive_skips` steps in a row are skipped,
    once per occurrence. Reads three scalars from the device per batch, and
    two per `FP32OutputHead`. So it is not `async_safe`: its batch end adds
    them to that batch's logs and counts skips batch by batch, in order,
    which on JAX makes Keras wait for each step before the next one is
    dispatched (add it where the loss scale needs watching per batch; the
    logger's records carry the same figures per window without that wait).

    Args:
        min_scale: Defaults to 1.0. Warn when the loss scale drops below it:
            gradients that need a scale below 1 overflow float16 even
            unscaled.
        max_consecutive_skips: Defaults to 5. Warn after this many skipped
            steps in a row.
        log_prefix: Defaults to `""`. Prefix for the log keys.

    Example:

    >>> import numpy as np, keras
    >>> from keras_mgpu.callbacks import LossScaleMonitor
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
    ...     keras.optimizers.SGD()), loss="mse")
    >>> history = model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4,
    ...                     callbacks=[LossScaleMonitor()], verbose=0)
    >>> history.history["loss_scale"], history.history["skipped_steps"]
    ([32768.0], [0])
    >>> model.compile(optimizer="sgd", loss="mse")  # no loss scale
    >>> sorted(model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4,
    ...                  callbacks=[LossScaleMonitor()], verbose=0).history)
    ['loss']
    """

    def __init__(
        self,
        min_scale: float = 1.0,
        max_consecutive_skips: int = 5,
        log_prefix: str = "",
    ):
        super().__init__()
        if max_consecutive_skips < 1:
            raise ValueError(
                "max_consecutive_skips must be >= 1, got "
                f"{max_consecutive_skips}."
            )
        self.min_scale = float(min_scale)
        self.max_consecutive_skips = int(max_consecutive_skips)
        self.log_prefix = log_prefix
        self.skipped_steps = 0
        self.skipped_steps_total = 0
        self.consecutive_skips = 0
        self.loss_scale: Optional[float] = None
        self.nonfinite_counts: dict[str, dict[str, int]] = {}
        # (attempted, applied) optimizer updates after the last batch.
        self._last_counts: Optional[tuple] = None
        self._warned_low_scale = False
        self._heads: list[FP32OutputHead] = []
        self._head_totals: Optional[dict[str, dict[str, int]]] = None
        self._shown_heads: set[str] = set()

    def _optimizer(self):
        return getattr(self.model, "optimizer", None)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._last_counts = None
        self.consecutive_skips = 0
        self._heads = [
            layer for layer in [self.model] + compat.sublayers(self.model)
            if isinstance(layer, FP32OutputHead)
        ]
        self._head_totals = self._read_heads()
        self._shown_heads = set()

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        self.skipped_steps = 0
        self.nonfinite_counts = {
            head.name: {"inputs": 0, "outputs": 0} for head in self._heads
        }

    def on_train_batch_begin(self, batch, logs=None):
        super().on_train_batch_begin(batch, logs)
        if self._last_counts is None:
            # After any resume (restored in on_train_begin).
            self._last_counts = self.runtime.update_counts()

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        logs = logs if logs is not None else {}
        attempted, applied = self.runtime.update_counts()
        assert self._last_counts is not None  # read at the batch's begin
        last_attempted, last_applied = self._last_counts
        self._last_counts = attempted, applied
        if attempted > last_attempted:
            skipped = (attempted - last_attempted) - (applied - last_applied)
            if skipped > 0:
                self.skipped_steps += skipped
                self.skipped_steps_total += skipped
                self.consecutive_skips += skipped
                if self.consecutive_skips >= self.max_consecutive_skips > (
                        self.consecutive_skips - skipped):
                    warnings.warn(
                        f"LossScaleMonitor: {self.consecutive_skips} "
                        "consecutive optimizer steps skipped for non-finite "
                        "gradients. Look for NaN/inf in the data or "
                        "activations (FP32OutputHead counts them), or lower "
                        "the learning rate.",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            else:
                self.consecutive_skips = 0
        self.loss_scale = loss_scale(self._optimizer())
        self._check_scale()
        self._count_heads()
        self._add_to(logs)

    def on_test_end(self, logs=None):
        # Validation's forward passes are not training batches: start the
        # next batch's count after them.
        if self._head_totals is not None:
            self._head_totals = self._read_heads()

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if logs is not None:
            self._add_to(logs)

    def _read_heads(self) -> dict:
        return {head.name: head.nonfinite_counts for head in self._heads}

    def _count_heads(self):
        if not self._heads:
            return
        totals = self._read_heads()
        head_totals = self._head_totals
        assert head_totals is not None  # read at train begin
        for name, counts in totals.items():
            epoch = self.nonfinite_counts.setdefault(
                name, {"inputs": 0, "outputs": 0})
            for kind, value in counts.items():
                # A head's counts only grow, unless reset by hand.
                epoch[kind] += max(value - head_totals[name][kind], 0)
            if epoch["inputs"] or epoch["outputs"]:
                self._shown_heads.add(name)
        self._head_totals = totals

    def _check_scale(self):
        if self.loss_scale is None:
            return
        if self.loss_scale < self.min_scale:
            if not self._warned_low_scale:
                warnings.warn(
                    f"LossScaleMonitor: loss scale {self.loss_scale:g} fell "
                    f"below min_scale={self.min_scale:g}: gradients overflow "
                    "float16 even unscaled. Check for NaN/inf inputs or "
                    "labels, or compute the overflowing part in float32.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._warned_low_scale = True
        else:
            self._warned_low_scale = False

    def _add_to(self, logs: dict) -> None:
        prefix = self.log_prefix
        if self.loss_scale is not None:
            logs[f"{prefix}loss_scale"] = self.loss_scale
            logs[f"{prefix}skipped_steps"] = self.skipped_steps
            logs[f"{prefix}skipped_steps_total"] = self.skipped_steps_total
        for head in self._heads:
            if head.name in self._shown_heads:
                counts = self.nonfinite_counts.get(head.name, {})
                logs[f"{prefix}{head.name}_nonfinite_inputs"] = \
                    counts.get("inputs", 0)
                logs[f"{prefix}{head.name}_nonfinite_outputs"] = \
                    counts.get("outputs", 0)
