"""Keras's TensorFlow trainer (keras/src/backend/tensorflow/trainer.py):
the trainer class, the multi-worker `fit` fix (keras-team/keras#20585) and
the `steps_per_execution` fix for several replicas (keras-team/keras#19246).
"""

from __future__ import annotations

from typing import Any

import keras

from keras_mgpu.compat._core import (
    _copied_variant,
    _internals_error,
    _lock,
    _require,
    _require_module,
)
from keras_mgpu.compat.registry import (
    _BACKUP,
    _MULTI_STEP_FIX,
    _MULTI_WORKER_FIX,
)
from keras_mgpu.compat.saving import _saving_lib

_TF_TRAINER = "keras.src.backend.tensorflow.trainer"


def active_trainer_module() -> str:
    """The module of the trainer `fit` runs in on the active backend
    (`keras.src.backend.<backend>.trainer`)."""
    return f"keras.src.backend.{keras.backend.backend()}.trainer"


def trainer_class(used_for: str = _MULTI_STEP_FIX,
                  module_name: str = _TF_TRAINER) -> type[Any]:
    """Keras's trainer: the class of `module_name` (default: the TensorFlow
    trainer's module) that `keras.Model` derives from (`TensorFlowTrainer`
    up to Keras 3.15, `Trainer` since keras-team/keras#23397).

    Example:

    >>> issubclass(keras.Model, trainer_class())
    True
    """
    module = _require_module(module_name, used_for)
    for cls in keras.Model.__mro__:
        if cls.__module__ == module.__name__:
            return cls
    raise _internals_error(
        f"a trainer class of `{module_name}` among `keras.Model`'s bases",
        used_for)


def _copied_originals() -> dict:
    """`{name: (owner, used_for)}` of every Keras function in
    `_KNOWN_SHAPES`."""
    saving_lib = _saving_lib()
    return {
        "_make_function": (trainer_class(), _MULTI_STEP_FIX),
        "_maybe_symbolic_build": (trainer_class(), _MULTI_WORKER_FIX),
        "save_weights_only": (saving_lib, _BACKUP),
        "load_weights_only": (saving_lib, _BACKUP),
    }


# --- keras-team/keras#20585: fit under MultiWorkerMirroredStrategy ----------
# Still open (measured broken on 3.10.0 and 3.15.1). The fix replaces two
# functions of Keras's TensorFlow trainer with versions that are also right
# where the bug is gone, so it is applied whenever those functions have the
# shape it was written for, whatever the version says.

_multi_worker_fit_enabled = False


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

    Both replacements act only under a multi-worker strategy and are correct
    with or without the bug, so the patch is applied on every Keras whose
    trainer has the two functions in the expected shape; otherwise it raises
    `KerasInternalsError` naming the Keras version, before any training. It
    is idempotent and never applied by `import keras_mgpu`.

    Returns:
        `True`: the patch is active after the call.

    Example:

    >>> from keras_mgpu import compat
    >>> compat.enable_multi_worker_fit()
    True
    >>> compat.multi_worker_fit_enabled()
    True
    """
    global _multi_worker_fit_enabled
    with _lock:
        if _multi_worker_fit_enabled:
            return True
        tf_trainer = _require_module(_TF_TRAINER, _MULTI_WORKER_FIX)
        trainer = trainer_class(_MULTI_WORKER_FIX)
        original_reduce = _require(
            tf_trainer, "reduce_per_replica", _MULTI_WORKER_FIX,
            params=("values", "strategy", "reduction"))
        original_build = _require(
            trainer, "_maybe_symbolic_build",
            _MULTI_WORKER_FIX, params=("self", "iterator", "data_batch"))
        _copied_variant(trainer, "_maybe_symbolic_build", _MULTI_WORKER_FIX)
        _require(trainer, "_symbolic_build", _MULTI_WORKER_FIX,
            params=("self", "iterator", "data_batch"))
        is_multi_worker = _require(
            tf_trainer, "_collective_all_reduce_multi_worker",
            _MULTI_WORKER_FIX)
        is_per_replica = _require(
            tf_trainer, "_is_per_replica_instance", _MULTI_WORKER_FIX)
        tree = keras.tree

        def first_local(v, strategy):
            return (strategy.experimental_local_results(v)[0]
                    if is_per_replica(v) else v)

        def reduce_per_replica(values, strategy, reduction):
            if reduction not in ("auto", "mean", "sum") or not (
                is_multi_worker(strategy)
            ):
                return original_reduce(values, strategy, reduction)
            op = "SUM" if reduction == "sum" else "MEAN"

            def reduce(v):
                axis = None if first_local(v, strategy).shape.rank == 0 else 0
                return strategy.reduce(op, v, axis=axis)

            return tree.map_structure(reduce, values)

        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            # Set by the trainer's `__init__`: read on the model, before
            # anything is built or trained.
            strategy = _require(self, "_distribute_strategy",
                                _MULTI_WORKER_FIX)
            if (
                strategy is None
                or iterator is None
                or not is_multi_worker(strategy)
            ):
                return original_build(self, iterator, data_batch)
            # The epoch iterator yields (step, iterator) in Keras 3.10 and
            # (begin, end, iterator) in 3.15: the iterator comes last.
            for *_, it in iterator:
                batch = next(it)
                data_batch = tree.map_structure(
                    lambda v: first_local(v, strategy), batch)
                break
            with strategy.scope():
                self._symbolic_build(data_batch=data_batch)

        setattr(_maybe_symbolic_build, "keras_stock", original_build)
        tf_trainer.reduce_per_replica = reduce_per_replica
        trainer._maybe_symbolic_build = _maybe_symbolic_build
        _multi_worker_fit_enabled = True
    return True


# --- steps_per_execution on several replicas ---------------------------------
# Keras's multi-step loop runs each step inside a `tf.cond` on its end-of-data
# `Optional`, within a `tf.while_loop`; on more than one replica TensorFlow
# then fails ("You must feed a value for placeholder tensor
# .../while/cond/Placeholder"), for plain models and for every train step.
# The loop's own condition already checks that `Optional`, so the step needs
# no `tf.cond`: the replacement is Keras's loop without it.

_multi_step_fit_enabled = False


def multi_step_fit_enabled() -> bool:
    """Whether `enable_multi_step_fit()` has patched Keras in this process."""
    return _multi_step_fit_enabled


def enable_multi_step_fit() -> bool:
    """Makes `steps_per_execution > 1` work on more than one replica.

    Replaces the multi-step loop Keras's TensorFlow trainer builds for `fit`
    and `evaluate` when `steps_per_execution > 1` and the strategy has more
    than one replica (`MirroredStrategy`, `MultiWorkerMirroredStrategy`),
    where Keras's own loop fails to run. The replacement runs the same steps
    in the same order, fetches each batch only when it is about to be
    trained (no batch skipped or repeated at the end of the data, whether
    its length is known or not), and ends the epoch together on every worker
    (the distributed iterator agrees on the end of data). On one replica, or
    with `steps_per_execution=1`, Keras's own function is used unchanged.

    Applied by `keras_mgpu.auto_strategy()` and `GradientAccumulationModel`,
    never by `import keras_mgpu`. It is decided by the trainer's shape, not a
    version: a Keras whose `TensorFlowTrainer._make_function` has another
    signature gets `KerasInternalsError` here, before any training. It is
    idempotent.

    Returns:
        `True`: the patch is active after the call.

    Example:

    >>> from keras_mgpu import compat
    >>> compat.enable_multi_step_fit()
    True
    >>> compat.multi_step_fit_enabled()
    True
    """
    global _multi_step_fit_enabled
    with _lock:
        if _multi_step_fit_enabled:
            return True
        import tensorflow as tf

        tf_trainer = _require_module(_TF_TRAINER, _MULTI_STEP_FIX)
        trainer = trainer_class(_MULTI_STEP_FIX)
        original = _require(trainer, "_make_function", _MULTI_STEP_FIX,
                            params=("self", "step_function"))
        _copied_variant(trainer, "_make_function", _MULTI_STEP_FIX)
        _require(tf_trainer, "reduce_per_replica", _MULTI_STEP_FIX,
                 params=("values", "strategy", "reduction"))

        def _make_function(self, step_function):
            strategy = self.distribute_strategy
            steps = self.steps_per_execution
            if steps == 1 or strategy.num_replicas_in_sync == 1:
                return original(self, step_function)
            # Set below while the loop is traced, where an error would
            # reach the user wrapped in TensorFlow's: checked here.
            _require(tf.experimental.Optional.empty(None), "_element_spec",
                     _MULTI_STEP_FIX)

            @tf.autograph.experimental.do_not_convert
            def one_step_on_data(data):
                outputs = strategy.run(step_function, args=(data,))
                # Looked up per call: the multi-worker fix may replace it.
                return tf_trainer.reduce_per_replica(
                    outputs, strategy, reduction="auto")

            if not self.run_eagerly:
                one_step_on_data = tf.function(
                    one_step_on_data, reduce_retracing=True,
                    jit_compile=self.jit_compile)
            # Keras 3.15 turns `Optional` inputs into None; 3.10 has no such
            # step.
            autoconvert = getattr(self, "_autoconvert_optionals", None)
            if autoconvert is not None:
                one_step_on_data = autoconvert(one_step_on_data)

            @tf.autograph.experimental.do_not_convert
            def multi_step_on_iterator(iterator):
                # Its element spec is set while the loop body is traced, as
                # Keras's own loop does.
                empty = tf.experimental.Optional.empty(None)

                def cond(step, outputs, next_inputs):
                    return tf.logical_and(step < steps, next_inputs.has_value())

                def body(step, outputs, next_inputs):
                    outputs = tf.experimental.Optional.from_value(
                        one_step_on_data(next_inputs.get_value()))
                    empty._element_spec = outputs.element_spec
                    # The last step of a call fetches nothing more, so the
                    # next call starts on the next batch.
                    next_inputs = tf.cond(
                        step + 1 < steps,
                        iterator.get_next_as_optional,
                        lambda: next_inputs)
                    return step + 1, outputs, next_inputs

                _, outputs, _ = tf.while_loop(
                    cond, body,
                    [tf.constant(0), empty, iterator.get_next_as_optional()])
                outputs._element_spec = empty.element_spec
                return outputs

            if not self.run_eagerly:
                multi_step_on_iterator = tf.function(
                    multi_step_on_iterator, reduce_retracing=True)

            def function(iterator):
                if isinstance(iterator, (tf.data.Iterator,
                                         tf.distribute.DistributedIterator)):
                    optional_outputs = multi_step_on_iterator(iterator)
                    if not optional_outputs.has_value():
                        raise StopIteration
                    return optional_outputs.get_value()
                for _, data in zip(range(steps), iterator):
                    outputs = one_step_on_data(data)
                return outputs

            return function

        setattr(_make_function, "keras_stock", original)
        trainer._make_function = _make_function
        _multi_step_fit_enabled = True
    return True
