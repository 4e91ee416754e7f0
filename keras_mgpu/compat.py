"""Every use of Keras and TensorFlow private internals, in one place.

Each workaround is named for the bug it fixes, is gated on the Keras versions
it was written for, and is covered by tests that also show when a Keras
release no longer needs it.
"""

from __future__ import annotations

import contextlib
import threading

import keras
import numpy as np
from packaging.version import Version

KERAS_VERSION = Version(keras.__version__)

# keras-team/keras#20585: `fit`/`evaluate` fail under
# MultiWorkerMirroredStrategy. Measured broken on 3.15.1; still open.
MULTI_WORKER_FIT_BROKEN = (Version("3.0.0"), Version("3.16.0.dev0"))

_lock = threading.Lock()
_multi_worker_fit_enabled = False


def multi_worker_fit_needs_fix(version: Version = KERAS_VERSION) -> bool:
    """Whether `version` of Keras has keras-team/keras#20585."""
    low, high = MULTI_WORKER_FIT_BROKEN
    return low <= version < high


def multi_worker_fit_enabled() -> bool:
    """Whether `enable_multi_worker_fit()` has patched Keras in this process."""
    return _multi_worker_fit_enabled


def enable_multi_worker_fit() -> bool:
    """Makes `fit`, `evaluate` and `predict` work under MultiWorkerMirroredStrategy.

    Works around keras-team/keras#20585 in Keras's TensorFlow trainer:
    - the symbolic build before training reduces the first batch with
      `strategy.reduce("MEAN", batch, axis=None)`, which fails on a
      multi-worker `PerReplica` batch; only its shapes are needed, so the
      first local replica's batch is used instead, with no collective;
    - scalar logs are reduced with `strategy.reduce("MEAN", v, axis=0)`,
      which fails for a 0-d tensor; they are reduced with `axis=None`.

    The patch applies only to the Keras versions that have the bug
    (`MULTI_WORKER_FIT_BROKEN`); on others it does nothing. It is idempotent
    and never applied by `import keras_mgpu`.

    Returns:
        Whether the patch is active after the call.

    Example:

    >>> from keras_mgpu import compat
    >>> compat.enable_multi_worker_fit() == compat.multi_worker_fit_needs_fix()
    True
    """
    global _multi_worker_fit_enabled
    if not multi_worker_fit_needs_fix():
        return False
    with _lock:
        if _multi_worker_fit_enabled:
            return True
        from keras.src.backend.tensorflow import trainer as tf_trainer

        original_reduce = tf_trainer.reduce_per_replica
        original_build = tf_trainer.TensorFlowTrainer._maybe_symbolic_build

        def reduce_per_replica(values, strategy, reduction):
            if reduction not in ("auto", "mean", "sum") or not (
                tf_trainer._collective_all_reduce_multi_worker(strategy)
            ):
                return original_reduce(values, strategy, reduction)
            op = "SUM" if reduction == "sum" else "MEAN"

            def reduce(v):
                local = (
                    strategy.experimental_local_results(v)[0]
                    if tf_trainer._is_per_replica_instance(v)
                    else v
                )
                axis = None if local.shape.rank == 0 else 0
                return strategy.reduce(op, v, axis=axis)

            return tf_trainer.tree.map_structure(reduce, values)

        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            strategy = self._distribute_strategy
            if (
                strategy is None
                or iterator is None
                or not tf_trainer._collective_all_reduce_multi_worker(strategy)
            ):
                return original_build(self, iterator, data_batch)
            for _, _, it in iterator:
                batch = next(it)
                data_batch = tf_trainer.tree.map_structure(
                    lambda v: strategy.experimental_local_results(v)[0]
                    if tf_trainer._is_per_replica_instance(v)
                    else v,
                    batch,
                )
                break
            with strategy.scope():
                self._symbolic_build(data_batch=data_batch)

        tf_trainer.reduce_per_replica = reduce_per_replica
        tf_trainer.TensorFlowTrainer._maybe_symbolic_build = (
            _maybe_symbolic_build
        )
        _multi_worker_fit_enabled = True
    return True


# --- Gradient accumulation (keras_mgpu.accumulation) -------------------------
# Written for Keras 3.x's TensorFlow trainer and optimizers (checked on 3.15):
# the train-step building blocks below are the ones Keras's own
# `TensorFlowTrainer.train_step` uses, and the optimizer hooks are the
# replica-context all-reduce and the LossScaleOptimizer's two outcomes.
ACCUMULATION_WRITTEN_FOR = (Version("3.0.0"), Version("4.0.0.dev0"))


def check_accumulation_support(version: Version = KERAS_VERSION) -> None:
    """Raises if this Keras is outside the versions accumulation was written for."""
    low, high = ACCUMULATION_WRITTEN_FOR
    if not low <= version < high:
        raise RuntimeError(
            f"keras_mgpu.GradientAccumulationModel was written for Keras "
            f">={low},<{high}, but Keras {version} is installed. Install a "
            "supported Keras or a newer keras-mgpu."
        )


def compute_loss(model, x, y, y_pred, sample_weight):
    """The training loss as Keras computes it, scaled for distribution."""
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )


def track_loss(model, loss, batch_size) -> None:
    """Feeds `loss` to the model's `loss` metric, as Keras's train_step does."""
    from keras.src.losses import loss as loss_module

    model._loss_tracker.update_state(
        loss_module.unscale_loss_for_distribution(loss),
        sample_weight=batch_size,
    )


@contextlib.contextmanager
def gradients_already_reduced(optimizer):
    """Stops `optimizer.apply` from all-reducing gradients in replica context.

    Keras's TF optimizer sums gradients across replicas inside `apply`. The
    accumulation wrapper has already reduced them (once, for the whole
    window), so inside this block `apply` clips, decays and updates only.
    Takes effect while tracing, which is when the all-reduce would be built.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    inner._all_reduce_sum_gradients = list
    try:
        yield
    finally:
        del inner._all_reduce_sum_gradients


def loss_scale_apply(optimizer, grads, trainable_variables) -> None:
    """LossScaleOptimizer's finite-gradient branch: unscale, apply, grow scale."""
    optimizer._stateful_handle_finite_grads(grads, trainable_variables)


def loss_scale_skip(optimizer) -> None:
    """LossScaleOptimizer's non-finite branch: halve the scale, skip the step."""
    optimizer._stateful_handle_non_finite_grads()


# --- Mixed precision (keras_mgpu.mixed_precision, keras_mgpu.layers) ---------
# `keras.src.backend.tensorflow.nn._get_logits` reads this attribute on a
# softmax/sigmoid output to recover its logits for the cross-entropy losses;
# `keras.activations.softmax`/`sigmoid` set it. Checked on 3.0 to 3.15.
KERAS_LOGITS_ATTR = "_keras_logits"
LOGITS_RECOVERY_WRITTEN_FOR = (Version("3.0.0"), Version("4.0.0.dev0"))


def logits_recovery_supported(version: Version = KERAS_VERSION) -> bool:
    """Whether Keras `version` recovers logits from `_keras_logits`."""
    low, high = LOGITS_RECOVERY_WRITTEN_FOR
    return low <= version < high


def attach_logits(output, logits) -> bool:
    """Attaches `logits` to `output` so Keras's cross-entropy losses use them.

    Returns whether the attribute could be set (eager tensors of some builds
    refuse new attributes; the losses then see probabilities only).
    """
    try:
        setattr(output, KERAS_LOGITS_ATTR, logits)
    except AttributeError:
        return False
    return True


def attached_logits(output):
    """The logits attached to `output` by a softmax/sigmoid, or None."""
    return getattr(output, KERAS_LOGITS_ATTR, None)


def sublayers(layer) -> list:
    """Every layer nested in `layer` (itself excluded), depth first."""
    return list(layer._flatten_layers(include_self=False, recursive=True))


def own_variables(layer) -> list:
    """The variables created by `layer` itself, not by its sublayers."""
    return list(layer._trainable_variables) + list(
        layer._non_trainable_variables
    )


def variable_autocasts(variable) -> bool:
    """Whether `variable` is cast to the compute dtype when read in `call`."""
    return bool(getattr(variable, "_autocast", True))


def producing_layer(keras_tensor):
    """The layer whose call produced a symbolic `keras_tensor`, or None."""
    history = getattr(keras_tensor, "_keras_history", None)
    return history[0] if history else None


# --- Backup and restore (keras_mgpu.callbacks.BackupAndRestore) --------------
# Keras 3.x's `fit` starts at `model._initial_epoch` when set (its own
# BackupAndRestore uses this), calls `model.train_function(iterator)` once per
# batch (or `steps_per_execution` batches), and calls each callback's
# `on_train_begin` from `CallbackList.on_train_begin`.


def set_initial_epoch(model, epoch) -> None:
    """Makes the running `fit` start at `epoch` (None: as the caller asked)."""
    model._initial_epoch = epoch


def calling_callback_list(frame_depth: int = 2):
    """The callbacks of the `CallbackList` that is calling a callback hook.

    Callbacks have no reference to their siblings; the `CallbackList` that
    invokes `on_train_begin` is the caller's `self` two frames up.
    """
    import sys

    from keras.src.callbacks.callback_list import CallbackList

    frame = sys._getframe(frame_depth)
    owner = frame.f_locals.get("self")
    if isinstance(owner, CallbackList):
        return list(owner.callbacks)
    return None


# --- Telemetry (keras_mgpu.callbacks.DistributedLogger) ----------------------
# Keras's `train_step` (and `compat.track_loss`) feeds the loss tracker with
# `sample_weight=batch_size`, so the tracker's `count` is the number of
# samples trained on since the metrics were last reset (each epoch).
# Checked on 3.15.
EXAMPLES_COUNT_WRITTEN_FOR = (Version("3.0.0"), Version("4.0.0.dev0"))


def examples_count_supported(version: Version = KERAS_VERSION) -> bool:
    """Whether Keras `version` counts samples in the loss tracker."""
    low, high = EXAMPLES_COUNT_WRITTEN_FOR
    return low <= version < high


def examples_seen(model) -> float | None:
    """Samples `fit` has trained on this epoch, over all replicas and workers.

    Read in cross-replica context, the tracker's on-read variable is summed
    over every replica; under MultiWorkerMirroredStrategy that is a
    collective, so every worker must call this at the same point. `None`
    when the model has no Keras loss tracker (e.g. a custom `train_step`
    that does not feed it) or Keras is outside the checked versions.
    """
    if not examples_count_supported():
        return None
    tracker = getattr(model, "_loss_tracker", None)
    count = getattr(tracker, "count", None)
    if count is None:
        return None
    return float(np.asarray(keras.ops.convert_to_numpy(count)))


# --- Tuning (keras_mgpu.tuner) -----------------------------------------------
# Keras 3.x optimizers keep a schedule, if any, in `_learning_rate` (the
# public `learning_rate` evaluates it). keras-tuner 1.4 appends its private
# `tuner_utils.TunerCallback(tuner, trial)` to every trial's callbacks.


def learning_rate_schedule(optimizer):
    """The optimizer's `LearningRateSchedule`, or None for a fixed rate."""
    schedule = getattr(optimizer, "_learning_rate", None)
    if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        return schedule
    return None


def tuner_and_trial(callbacks):
    """(tuner, trial) from the callbacks KerasTuner passes to `fit`, or None.

    `HyperModel.fit` gets no trial; the trial id and the tuner's
    `get_trial_dir` key the per-trial backup.
    """
    for callback in callbacks:
        tuner = getattr(callback, "tuner", None)
        trial = getattr(callback, "trial", None)
        if (
            tuner is not None
            and hasattr(tuner, "get_trial_dir")
            and getattr(trial, "trial_id", None) is not None
        ):
            return tuner, trial
    return None


# --- Input wait (keras_mgpu.callbacks.DistributedLogger) ---------------------
# Keras 3.15's TensorFlow trainer makes `model.train_function` a plain closure
# `function(iterator)` over `multi_step_on_iterator`, a `tf.function` that
# fetches each batch inside the graph, with `iterator.get_next()` (or
# `get_next_as_optional()` when `steps_per_execution > 1`), and returns an
# `Optional` that `function` unwraps (raising StopIteration when empty).
# A callback cannot time that fetch from the host, so the same Python step
# is retraced with an iterator whose fetches are timed in the graph.
INPUT_WAIT_WRITTEN_FOR = (Version("3.15.0"), Version("3.16.0.dev0"))


def input_wait_supported(version: Version = KERAS_VERSION) -> bool:
    """Whether Keras `version` has the train function `timed_train_function`
    was written for."""
    low, high = INPUT_WAIT_WRITTEN_FOR
    return low <= version < high


def timed_train_function(train_function, seconds_waited):
    """Keras's `model.train_function`, also timing its input fetches.

    The returned function trains exactly as `train_function` does (the same
    Python step, traced once more) and adds to the float64 variable
    `seconds_waited` the time each step was blocked fetching its batch:
    from just before the iterator's get-next op starts until its outputs
    exist, as `tf.timestamp` sees it inside the graph. No value leaves the
    device per step.

    Returns None when `train_function` is not Keras's compiled train function
    (e.g. `run_eagerly=True`, another callback's stand-in, an unchecked Keras
    version): then nothing can be timed.
    """
    import tensorflow as tf

    if not input_wait_supported() or train_function is None:
        return None
    multi_step = _closure_value(train_function, "multi_step_on_iterator")
    python_function = getattr(multi_step, "python_function", None)
    if python_function is None:
        return None

    @tf.function(reduce_retracing=True)
    def timed_multi_step(iterator):
        return python_function(_TimedIterator(iterator, seconds_waited))

    iterator_types = (tf.data.Iterator, tf.distribute.DistributedIterator)

    def function(iterator):
        if not isinstance(iterator, iterator_types):
            return train_function(iterator)
        optional_outputs = timed_multi_step(iterator)
        if not optional_outputs.has_value():
            raise StopIteration
        return optional_outputs.get_value()

    function.keras_train_function = train_function
    return function


def _closure_value(function, name):
    code = getattr(function, "__code__", None)
    if code is None or name not in code.co_freevars:
        return None
    return function.__closure__[code.co_freevars.index(name)].cell_contents


class _TimedIterator:
    """Wraps a dataset iterator while a train step is traced: each fetch is
    bracketed by timestamps and its duration added to a variable."""

    def __init__(self, iterator, seconds_waited):
        self._iterator = iterator
        self._seconds_waited = seconds_waited

    def get_next(self):
        return self._timed(self._iterator.get_next)

    def get_next_as_optional(self):
        return self._timed(self._iterator.get_next_as_optional)

    def __next__(self):
        return self._timed(self._iterator.__next__)

    def __getattr__(self, name):
        return getattr(self._iterator, name)

    def _timed(self, fetch):
        import tensorflow as tf

        start = tf.timestamp()
        with tf.control_dependencies([start]):
            element = fetch()
        outputs = [
            t for t in tf.nest.flatten(element, expand_composites=True)
            if isinstance(t, tf.Tensor)
        ]
        with tf.control_dependencies(outputs):
            self._seconds_waited.assign_add(tf.timestamp() - start)
        return element
