"""Batches of a `tf.data.Dataset`: `batch_size_of` and `rebatch` (a
re-batched dataset that keeps its length)."""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from keras_mgpu._checks import is_positive_integer


class UnknownLengthWarning(UserWarning):
    """A dataset's number of batches is unknown, so Keras takes an extra step."""


# Per dataset object, so a tuner's trials (same dataset, every trial) read
# the first batch or count the samples once.
_FIRST_BATCH: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_SAMPLES: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_WARNED_UNKNOWN: weakref.WeakSet[Any] = weakref.WeakSet()


def batch_size_of(dataset: tf.data.Dataset) -> int:
    """The batch size of a batched `tf.data.Dataset`, static or not.

    Read from the element spec when the batch dimension is static
    (`drop_remainder=True`); otherwise from the first batch, which is read
    once per dataset object (running the pipeline for one batch).

    Args:
        dataset: A batched dataset (its elements' first dimension is the
            batch).

    Returns:
        The number of samples in a (full) batch.

    Example:

    >>> ds = tf.data.Dataset.range(10).batch(4)   # last batch: 2
    >>> batch_size_of(ds)
    4
    """
    _check_dataset("batch_size_of", dataset)
    static = _static_batch(dataset)
    if static is not None:
        return static
    if dataset not in _FIRST_BATCH:
        first = next(iter(dataset.take(1)), None)
        if first is None:
            raise ValueError(
                "batch_size_of: the dataset is empty, so it has no batch "
                "size. Check the pipeline (a filter or take(0) can empty it)."
            )
        _FIRST_BATCH[dataset] = int(_batch_length(first))
    return _FIRST_BATCH[dataset]


def rebatch(dataset: tf.data.Dataset, batch_size: int) -> tf.data.Dataset:
    """Re-batches a batched dataset to `batch_size`, keeping every sample
    and a known length.

    `tf.data.Dataset.rebatch` keeps the samples, but its result has an
    unknown number of batches, and on such a dataset Keras 3's `fit` takes
    one extra, empty optimizer step at the end of every epoch (Adam moves on
    a zero gradient, schedules run ahead). This asserts the number of batches
    the re-batched dataset has, `ceil(samples / batch_size)`, so `fit` takes
    exactly that many steps. The sample count is the batch count times the
    static batch size, or, when the batch size is not static (a partial last
    batch), counted once per dataset object (one pass over its batches).
    An infinite dataset stays infinite. A dataset whose own length is
    unknown (after `filter`, or `tfrecord_dataset`) stays unknown, with an
    `UnknownLengthWarning` once per dataset: assert its length with
    `dataset.apply(tf.data.experimental.assert_cardinality(n))` first.

    Args:
        dataset: A batched dataset.
        batch_size: The new batch size, a positive integer (the last batch
            holds the remainder).

    Returns:
        The re-batched dataset.

    Example:

    >>> ds = tf.data.Dataset.range(64).batch(5)
    >>> again = rebatch(ds, 16)
    >>> int(again.cardinality()), [int(b.shape[0]) for b in again]
    (4, [16, 16, 16, 16])
    """
    _check_dataset("rebatch", dataset)
    if not is_positive_integer(batch_size):
        raise ValueError(
            f"rebatch: batch_size must be a positive integer, got "
            f"{batch_size!r}."
        )
    batch_size = int(batch_size)
    batches = int(dataset.cardinality())
    rebatched = dataset.rebatch(batch_size)
    if batches == tf.data.INFINITE_CARDINALITY:
        length = batches
    elif batches == tf.data.UNKNOWN_CARDINALITY:
        if dataset not in _WARNED_UNKNOWN:
            _WARNED_UNKNOWN.add(dataset)
            warnings.warn(
                "rebatch: the dataset's number of batches is unknown, so the "
                "re-batched one's is too, and Keras 3's fit takes one extra, "
                "empty optimizer step per epoch on it. If you know the "
                "number of batches n, apply "
                "tf.data.experimental.assert_cardinality(n) to the dataset "
                "first.",
                UnknownLengthWarning,
                stacklevel=2,
            )
        return rebatched
    else:
        length = -(-_sample_count(dataset, batches) // batch_size)
    return rebatched.apply(tf.data.experimental.assert_cardinality(length))


def _sample_count(dataset, batches: int) -> int:
    static = _static_batch(dataset)
    if static is not None:
        return batches * static
    if dataset not in _SAMPLES:
        _SAMPLES[dataset] = int(dataset.reduce(
            np.int64(0), lambda count, batch: count + _batch_length(batch)))
    return _SAMPLES[dataset]


def _static_batch(dataset) -> Optional[int]:
    shape = tf.nest.flatten(dataset.element_spec)[0].shape
    return shape[0] if shape.rank else None


def _batch_length(batch):
    first = tf.nest.flatten(batch)[0]
    return tf.shape(first, out_type=tf.int64)[0]


def _check_dataset(name: str, dataset) -> None:
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            f"{name} needs a batched tf.data.Dataset, got "
            f"{type(dataset).__name__}."
        )
    if not tf.nest.flatten(dataset.element_spec)[0].shape.rank:
        raise ValueError(
            f"{name} needs a batched dataset, but its elements are scalars "
            f"({dataset.element_spec}). Batch it first: dataset.batch(n)."
        )
