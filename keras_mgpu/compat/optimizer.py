"""Keras's TensorFlow optimizer (keras/src/backend/tensorflow/optimizer.py,
keras/src/optimizers/base_optimizer.py): exact gradient clipping under a
strategy (keras-team/keras#19969) and the learning-rate schedule the tuner
scales.
"""

from __future__ import annotations

import threading
from typing import Any

import keras

from keras_mgpu.compat._core import _lock, _require, _require_module
from keras_mgpu.compat.registry import _EXACT_CLIPPING, _TUNER


def _tf_optimizer_class(used_for: str) -> type[Any]:
    return _require(
        _require_module("keras.src.backend.tensorflow.optimizer", used_for),
        "TFOptimizer", used_for)


# --- Gradient clipping under a strategy --------------------------------------
# In replica context Keras's TensorFlow optimizer clips (`_clip_gradients`,
# in `BaseOptimizer._backend_apply_gradients`) before it all-reduces
# (`TFOptimizer._all_reduce_sum_gradients`, in `_backend_update_step`, since
# keras-team/keras#19467 and #19969): `clipnorm`, `clipvalue` and
# `global_clipnorm` act on each replica's share of the gradient, not on the
# gradient one device would see (tf.keras 2 refused clipping under a
# strategy for this reason: tensorflow/tensorflow#33929). The fix
# all-reduces inside `_clip_gradients`, before clipping, and lets the later
# all-reduce pass those gradients through: still one all-reduce per step.
# Remove it once `test_stock_keras_still_clips_each_replica` in
# tests/test_compat.py fails, i.e. once Keras clips the all-reduced gradient
# itself.
#
# Sparse gradients (issue #43): a `tf.IndexedSlices` gradient (an
# embedding's, from `tf.gather`) holds one row per lookup, the same index
# as often as the token occurs, and the all-reduce under a strategy gathers
# the replicas' rows without merging them either. Keras clips those rows as
# they are (`_clip_gradients` in keras/src/optimizers/base_optimizer.py,
# `_clip_by_norm` and `clip_by_global_norm` norm the unmerged values,
# `clipvalue` clips each duplicate on its own), so the clip is not the one
# of the dense gradient the rows sum to, on one device too. Under the fix,
# an optimizer that clips merges the duplicate rows first (public ops only:
# `tf.unique`, `tf.math.unsorted_segment_sum`), on any replica count; it
# stays sparse. Upstream:
# https://github.com/keras-team/keras/blob/v3.15.1/keras/src/optimizers/base_optimizer.py
# The update is no better: Keras's Adam (and every optimizer whose update
# is not linear in the gradient) squares each row of an `IndexedSlices`
# (`ops.square` keeps it sparse), so duplicates add g1**2 + g2**2 to the
# second moment where the dense gradient gives (g1 + g2)**2 (tf.keras 2
# merged them first: `_deduplicate_indexed_slices`; keras-team/keras#19992
# is about their cost). So the patched all-reduce hands the update merged
# rows too, whether the optimizer clips or not.
# Remove the merge once `test_stock_keras_still_clips_unmerged_rows` and
# `test_stock_keras_adam_squares_unmerged_rows` in
# tests/test_sparse_clipping.py fail, i.e. once Keras merges duplicate rows
# before it clips and updates.

_exact_clipping_enabled = False
# The gradients this thread has all-reduced and not yet handed to the
# optimizer's own all-reduce. Per thread: MirroredStrategy runs each
# replica's step in a thread of its own, interleaved at its merge calls.
_reduced_here = threading.local()
_CLIP_ARGUMENTS = ("clipnorm", "clipvalue", "global_clipnorm")


def exact_clipping_enabled() -> bool:
    """Whether `enable_exact_clipping()` has patched Keras in this process."""
    return _exact_clipping_enabled


def _keep_reduced(grads_and_vars):
    # Stands in for the optimizer's all-reduce where gradients arrive
    # all-reduced already (`gradients_already_reduced`).
    return list(grads_and_vars)


def _reduction_taken_over(optimizer) -> bool:
    return vars(optimizer).get("_all_reduce_sum_gradients") is _keep_reduced


def _clips(optimizer) -> bool:
    return any(getattr(optimizer, name, None) for name in _CLIP_ARGUMENTS)


def _same_tensors(a, b) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _merge_duplicate_rows(grads) -> list:
    """`grads` with each `tf.IndexedSlices` summed to one row per index, as
    its dense equivalent holds it (still sparse); other gradients as they
    are, the same objects."""
    import tensorflow as tf

    merged = []
    for g in grads:
        if isinstance(g, tf.IndexedSlices):
            indices, rows = tf.unique(g.indices)
            g = tf.IndexedSlices(
                tf.math.unsorted_segment_sum(g.values, rows,
                                             tf.shape(indices)[0]),
                indices, g.dense_shape)
        merged.append(g)
    return merged


def _take_reduced(grads) -> bool:
    """Whether `grads` are the ones this thread all-reduced last (and
    forgets them: each all-reduce stands in for one other)."""
    done = getattr(_reduced_here, "grads", None)
    _reduced_here.grads = None
    return done is not None and _same_tensors(done, grads)


def enable_exact_clipping() -> bool:
    """Makes `clipnorm`, `clipvalue` and `global_clipnorm` clip the
    gradient as one device would clip its dense equivalent: the all-reduced
    gradient under a strategy, with a sparse gradient's duplicate rows
    merged.

    Keras's TensorFlow optimizer clips each replica's gradient before it
    sums them across replicas, so under `MirroredStrategy` or
    `MultiWorkerMirroredStrategy` a clipped `fit` trains differently from the
    same global batch on one device (and `global_clipnorm` bounds each
    replica's share, not the gradient). With this fix, an optimizer that
    clips, called in replica context on more than one replica, sums the
    gradients across replicas first and then clips them, and Keras's own
    all-reduce passes them through: one all-reduce per step, as before.

    Sparse gradients: an embedding's gradient is a `tf.IndexedSlices` with
    one row per lookup, duplicates included (and, all-reduced, every
    replica's rows), and Keras clips those rows as they are: `clipnorm` and
    `global_clipnorm` take the norm of the unmerged rows, `clipvalue` clips
    each duplicate on its own, so the step differs from the one the dense
    gradient would take (keras-mgpu issue #43). With this fix, an optimizer
    that clips first sums each `IndexedSlices` gradient to one row per
    index (`tf.unique` and `tf.math.unsorted_segment_sum`; it stays sparse),
    after the all-reduce, and on one replica too: exact clipping means
    "clipped as the dense gradient would be", whatever the replica count.
    The update gets the merged rows too, whether the optimizer clips or
    not: Keras's Adam squares each row of a sparse gradient for its second
    moment, so duplicate rows (a token seen twice in a batch) would update
    it as no dense gradient does (on a tiny GPT-2, 2.4e-3 off the dense
    gradient's weights after 4 steps). Merging sparse rows is the one
    change on one replica, and it costs nothing where no gradient is
    sparse: dense gradients are clipped and applied as Keras does, to the
    bit.

    Beyond merging sparse rows, nothing changes for an optimizer that does
    not clip, nor with Keras's own
    `gradient_accumulation_steps` (clipped inside its own update branch,
    which fails under a strategy anyway: keras-team/keras#20582), or where
    the gradients arrive all-reduced already (`GradientAccumulationModel`
    clips the all-reduced window gradient itself, which it accumulates
    dense). `LossScaleOptimizer` (`mixed_float16`) clips through its inner
    optimizer, so it is covered too.

    Applied by `keras_mgpu.auto_strategy()`, never by `import keras_mgpu`.
    Call it yourself when you create your own strategy. It is decided by
    the optimizer's shape, not a version: a Keras whose
    `TFOptimizer._clip_gradients` or `_all_reduce_sum_gradients` is missing
    or has another signature gets `KerasInternalsError` here, before any
    training; where Keras all-reduces before it clips, the gradients are
    not reduced twice. It is idempotent.

    Returns:
        `True`: the patch is active after the call.

    Example:

    >>> from keras_mgpu import compat
    >>> compat.enable_exact_clipping()
    True
    >>> compat.exact_clipping_enabled()
    True
    """
    global _exact_clipping_enabled
    with _lock:
        if _exact_clipping_enabled:
            return True
        import tensorflow as tf

        TFOptimizer = _tf_optimizer_class(_EXACT_CLIPPING)
        clip = _require(TFOptimizer, "_clip_gradients", _EXACT_CLIPPING,
                        params=("self", "grads"))
        all_reduce = _require(
            TFOptimizer, "_all_reduce_sum_gradients", _EXACT_CLIPPING,
            params=("self", "grads_and_vars"))
        # Keras's own, should this process have patched them before.
        clip = getattr(clip, "keras_stock", clip)
        all_reduce = getattr(all_reduce, "keras_stock", all_reduce)

        def reduces_first(optimizer, grads):
            if not (_exact_clipping_enabled and _clips(optimizer)):
                return False
            context = tf.distribute.get_replica_context()
            return (
                context is not None
                and context.num_replicas_in_sync > 1
                and not getattr(optimizer, "gradient_accumulation_steps",
                                None)
                and not _reduction_taken_over(optimizer)
                # A Keras that all-reduced before clipping.
                and not _take_reduced(grads)
            )

        def _clip_gradients(self, grads):
            if not (_exact_clipping_enabled and _clips(self)):
                return clip(self, grads)
            if not reduces_first(self, grads):
                # One replica, or reduced already: clip as the dense
                # gradient would be clipped.
                return clip(self, _merge_duplicate_rows(grads))
            # Keras's own all-reduce (SUM of the per-replica gradients of
            # losses already divided by the replica count: the global mean).
            # It reads the variables only to name them in errors. Sparse
            # gradients come back as every replica's rows: merged here.
            reduced = [g for g, _ in all_reduce(self, [(g, None)
                                                       for g in grads])]
            clipped = clip(self, _merge_duplicate_rows(reduced))
            _reduced_here.grads = [g for g in clipped if g is not None]
            return clipped

        def _all_reduce_sum_gradients(self, grads_and_vars):
            grads_and_vars = list(grads_and_vars)
            grads = [g for g, _ in grads_and_vars if g is not None]
            if _exact_clipping_enabled and _take_reduced(grads):
                return grads_and_vars
            reduced = list(all_reduce(self, grads_and_vars))
            if not _exact_clipping_enabled:
                return reduced
            # The update itself needs merged rows too: Adam's second moment
            # squares each row, so duplicates would add g1**2 + g2**2 where
            # the dense gradient gives (g1 + g2)**2.
            merged = _merge_duplicate_rows([g for g, _ in reduced])
            reduced = [(g, v) for g, (_, v) in zip(merged, reduced)]
            if _clips(self):
                # Should Keras clip after this, it clips these as they are.
                _reduced_here.grads = [g for g, _ in reduced if g is not None]
            return reduced

        setattr(_clip_gradients, "keras_stock", clip)
        setattr(_all_reduce_sum_gradients, "keras_stock", all_reduce)
        TFOptimizer._clip_gradients = _clip_gradients
        TFOptimizer._all_reduce_sum_gradients = _all_reduce_sum_gradients
        _exact_clipping_enabled = True
    return True


# --- The learning-rate schedule (keras_mgpu.tuner) ---------------------------
# Keras 3 optimizers keep a schedule, if any, in `_learning_rate` (the
# public `learning_rate` evaluates it).


def learning_rate_schedule(optimizer):
    """The optimizer's `LearningRateSchedule`, or None for a fixed rate."""
    schedule = _require(optimizer, "_learning_rate", _TUNER)
    if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        return schedule
    return None


def learning_rate_callable(optimizer):
    """The optimizer's learning rate when it is a plain callable (a
    function, neither a number nor a schedule), else None."""
    rate = _require(optimizer, "_learning_rate", _TUNER)
    if callable(rate) and not isinstance(
        rate,
        (keras.optimizers.schedules.LearningRateSchedule, keras.Variable),
    ):
        return rate
    return None
