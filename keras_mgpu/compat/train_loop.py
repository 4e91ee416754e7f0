"""What the runtime reads of the train loop of a running `fit`
(keras/src/backend/tensorflow/trainer.py): the twin of Keras's train
function whose input fetches are timed and counted, and the `fit`'s epoch
iterator, whose position a resume continues.
"""

from __future__ import annotations

from typing import Optional

from keras_mgpu.compat._core import _copied_variant, _require
from keras_mgpu.compat.fit_context import running_fit
from keras_mgpu.compat.keras_trainer import _TF_TRAINER, trainer_class
from keras_mgpu.compat.registry import _INPUT_WAIT, _STREAM
from keras_mgpu.compat.telemetry import examples_count


def check_runtime_support(model) -> None:
    """Raises `KerasInternalsError` unless this Keras has everything the
    training runtime reads of `model` and of the running `fit` (called as
    a `fit` or a hand-written loop begins, before any step)."""
    examples_count(model)
    _copied_variant(trainer_class(_INPUT_WAIT), "_make_function", _INPUT_WAIT)
    epoch_iterator = fit_epoch_iterator(model)
    if epoch_iterator is not None:
        epoch_iterator_keeps_iterator(epoch_iterator)
        epoch_iterator_count(epoch_iterator)
        _require(epoch_iterator, "_current_iterator", _STREAM)


# `function(iterator)` over `multi_step_on_iterator`, a `tf.function` that
# fetches each batch inside the graph and returns an `Optional` that
# `function` unwraps (raising StopIteration when empty); in the 3.16
# nightlies `function` fetches the batch of a one-step call on the host and
# calls `one_step_on_data` itself. A callback
# can neither time an in-graph fetch from the host nor see how many batches
# a call fetched (fewer than `steps_per_execution` where the data ends), so
# the same Python step is retraced with an iterator whose fetches are timed
# and counted. `function` itself is re-created here: `_KNOWN_SHAPES` checks
# that Keras's is one of the shapes this copy follows.


def timed_train_function(train_function, seconds_waited):
    """Keras's `model.train_function`, also timing its input fetches.

    `instrumented_train_function` with only `seconds_waited`.
    """
    return instrumented_train_function(train_function,
                                       seconds_waited=seconds_waited)


def instrumented_train_function(train_function, seconds_waited=None,
                                batches_read=None):
    """Keras's `model.train_function`, also timing or counting its fetches.

    The returned function trains exactly as `train_function` does (the same
    Python step, traced once more). With `seconds_waited` (a float64
    variable) it adds the time each step was blocked fetching its batch:
    from just before the iterator's get-next op starts until its outputs
    exist, as `tf.timestamp` sees it inside the graph. With `batches_read`
    (an int64 variable) it adds 1 for each batch fetched, so the caller
    knows how many a call trained where the data ended inside it. No value
    leaves the device per step.

    Returns None when `train_function` is not Keras's compiled train function
    (e.g. `run_eagerly=True`, another callback's stand-in): then nothing can
    be timed. Raises `KerasInternalsError` when it is Keras's but made by a
    `_make_function` of a shape this was not written for.
    """
    import tensorflow as tf

    if train_function is None:
        return None
    variant = _train_function_variant(train_function)
    multi_step = _closure_value(train_function, "multi_step_on_iterator")
    python_function = getattr(multi_step, "python_function", None)
    if variant is None or python_function is None:
        # Not Keras's, or run_eagerly=True (a plain Python step): n/a.
        return None

    @tf.function(reduce_retracing=True)
    def instrumented_multi_step(iterator):
        return python_function(
            _InstrumentedIterator(iterator, seconds_waited, batches_read))

    iterator_types = (tf.data.Iterator, tf.distribute.DistributedIterator)
    if variant == "host_fetch_one_step":
        model = _closure_value(train_function, "self")
        one_step_on_data = _closure_value(train_function, "one_step_on_data")
    else:
        model = one_step_on_data = None

    def function(iterator):
        if not isinstance(iterator, iterator_types):
            return train_function(iterator)
        if model is not None and model.steps_per_execution == 1:
            optional_inputs = _InstrumentedIterator(
                iterator, seconds_waited, batches_read).get_next_as_optional()
            if not optional_inputs.has_value():
                raise StopIteration
            return one_step_on_data(optional_inputs.get_value())
        optional_outputs = instrumented_multi_step(iterator)
        if not optional_outputs.has_value():
            raise StopIteration
        return optional_outputs.get_value()

    setattr(function, "keras_train_function", train_function)
    return function


def _train_function_variant(train_function) -> Optional[str]:
    """The shape of the `_make_function` that made `train_function`: Keras's
    (checked against `_KNOWN_SHAPES`), keras-mgpu's multi-step loop, or None
    for a function neither made."""
    qualname = getattr(train_function, "__qualname__", "")
    if qualname.startswith("enable_multi_step_fit.<locals>"):
        return "graph_fetch"
    if getattr(train_function, "__module__", None) != _TF_TRAINER:
        return None
    return _copied_variant(trainer_class(_INPUT_WAIT), "_make_function",
                           _INPUT_WAIT)


# --- The data stream of a running `fit` (keras_mgpu.runtime) -----------------
# Keras 3.10 to 3.15 `fit` hands the next epoch the same data iterator
# (`_current_iterator`) when given `steps_per_epoch`, unless the data ran
# out, and counts the batches it handed out (`_steps_seen`,
# `steps_per_execution` per call) to know when a dataset of known length is
# used up. A resume that continues such a stream mid-way must start that
# count where the interrupted run had it. Remove when Keras exposes the
# epoch iterator's position (no upstream issue yet).


def fit_epoch_iterator(model):
    """The epoch iterator of the `fit` now running on `model`, or None (not
    inside Keras's `fit`, e.g. a hand-written loop, or not made yet)."""
    running = running_fit(model)
    return None if running is None else running.epoch_iterator


def epoch_iterator_keeps_iterator(epoch_iterator) -> bool:
    """Whether `epoch_iterator` reads one data iterator across epochs (it was
    given `steps_per_epoch`) rather than a new one each epoch."""
    if epoch_iterator is None:
        return False
    return bool(_require(epoch_iterator, "steps_per_epoch", _STREAM))


def epoch_iterator_reads_on(epoch_iterator, iterator) -> bool:
    """Whether the next epoch of `epoch_iterator` reads on from `iterator`
    (call it after an epoch's last batch)."""
    if not epoch_iterator_keeps_iterator(epoch_iterator):
        return False
    current = _require(epoch_iterator, "_current_iterator", _STREAM)
    return current is iterator


def epoch_iterator_count(epoch_iterator) -> int:
    """The batches `epoch_iterator` has counted out of its current stream."""
    if epoch_iterator is None:
        return 0
    return int(_require(epoch_iterator, "_steps_seen", _STREAM))


def add_epoch_iterator_count(epoch_iterator, count: int) -> None:
    """Adds `count` (read by an earlier run) to that count."""
    if epoch_iterator is not None and count:
        _require(epoch_iterator, "_steps_seen", _STREAM)
        epoch_iterator._steps_seen += count


def _closure_value(function, name):
    code = getattr(function, "__code__", None)
    if code is None or name not in code.co_freevars:
        return None
    return function.__closure__[code.co_freevars.index(name)].cell_contents


class _InstrumentedIterator:
    """Wraps a dataset iterator while a train step is traced: each fetch is
    bracketed by timestamps and its duration added to a variable, and/or
    counted in another."""

    def __init__(self, iterator, seconds_waited, batches_read):
        self._iterator = iterator
        self._seconds_waited = seconds_waited
        self._batches_read = batches_read

    def get_next(self):
        return self._fetch(self._iterator.get_next, optional=False)

    def get_next_as_optional(self):
        return self._fetch(self._iterator.get_next_as_optional, optional=True)

    def __next__(self):
        return self._fetch(self._iterator.__next__, optional=False)

    def __getattr__(self, name):
        return getattr(self._iterator, name)

    def _fetch(self, fetch, optional):
        import tensorflow as tf

        if self._seconds_waited is None:
            element = fetch()
        else:
            start = tf.timestamp()
            with tf.control_dependencies([start]):
                element = fetch()
        outputs = [
            t for t in tf.nest.flatten(element, expand_composites=True)
            if isinstance(t, tf.Tensor)
        ]
        with tf.control_dependencies(outputs):
            if self._seconds_waited is not None:
                self._seconds_waited.assign_add(tf.timestamp() - start)
            if self._batches_read is not None:
                # An empty Optional is the end of the data, not a batch.
                read = (tf.cast(element.has_value(), tf.int64) if optional
                        else tf.constant(1, tf.int64))
                self._batches_read.assign_add(read)
        return element
