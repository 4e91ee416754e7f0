"""The wrapper `TrainingRuntime` puts in place of `model.train_function`.

It counts the batches each call read and trained (a call of
`steps_per_execution` steps may hold fewer where the data ends), times input
fetches when asked, and hands a resumed run's first calls to the runtime's
skipping (`keras_mgpu/runtime/skipping.py`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

import keras
import numpy as np
import tensorflow as tf

from keras_mgpu import compat
from keras_mgpu import strategy as strategy_lib

if TYPE_CHECKING:
    from keras_mgpu.runtime.counters import _Runtime as _Host
else:
    _Host = object


class TrainFunctionWrapper(_Host):
    """`TrainingRuntime`'s wrapper of the model's train function, and the
    runtime's backend hooks (`keras_mgpu/backend/__init__.py` lists them)."""

    # --- the train function --------------------------------------------------

    def _install(self) -> None:
        """Puts the wrapper in place of `model.train_function` (again, if
        another callback swapped it since)."""
        model = self.model
        inner = self._take_train_function()
        if inner is None:
            return
        # The twin that fetches as `inner` does but also counts the batches
        # (and times the fetches, if asked): a call of several steps may
        # hold fewer batches than `steps_per_execution` where the data ends.
        twin = None
        if self._timing_asked or self._steps_per_call > 1:
            twin = self._twin(inner, timed=self._timing_asked)
        step = twin if self._timing_asked and twin is not None else inner
        self._runs_keras_step = step is inner

        def train_function(iterator):
            self._read_from(iterator)
            if self._skip is not None:
                logs, read, trained = self._skip_then_train(
                    iterator, lambda batches: self._scoped(step, batches))
                if read:
                    self._account(read, trained)
                    return {} if logs is None else logs
                # Only batches of earlier epochs were skipped: the call
                # trains as any other.
            logs, read = self._train(iterator, step, twin)
            self._account(read, read)
            return logs

        setattr(train_function, "keras_mgpu_inner", inner)
        self._wrapper = model.train_function = train_function

    def _twin(self, inner, timed: bool):
        # Cached by the function it instruments: a function swapped out and
        # back gets the same twin, with no retrace.
        key = (id(inner), timed)
        cached = self._twins.get(key)
        if cached is None or cached[0] is not inner:
            if self._batches_read is None:
                self._batches_read = strategy_lib.local_variable(0, tf.int64)
                self._fetched = 0
            cached = (inner, compat.instrumented_train_function(
                inner, seconds_waited=(self.input_wait_variable if timed
                                       else None),
                batches_read=self._batches_read))
            self._twins[key] = cached
        return cached[1]

    def _train(self, iterator, step, twin):
        """One call of the train function; (logs, batches it trained)."""
        expected = self._call_steps
        # Where the call may hold another number of batches than predicted:
        # an epoch of unknown length (its end), an epoch's last call (fewer
        # where the data ends, all of them where it goes on past
        # steps_per_epoch).
        measure = self._steps_per_call > 1 and (
            not self._epoch_steps or expected < self._steps_per_call)
        try:
            if not measure:
                logs = self._scoped(step, iterator)
                if step is twin:
                    self._fetched += expected
                return logs, expected
            if twin is not None:
                logs = self._scoped(twin, iterator)
                fetched = int(self._batches_read.numpy())
                read, self._fetched = fetched - self._fetched, fetched
                return logs, read
            # Nothing to instrument (run_eagerly, another stand-in): the
            # batches go one by one through the function's own loop.
            return self._train_batches(
                lambda batches: self._scoped(step, batches), iterator,
                self._steps_per_call)
        except (StopIteration, tf.errors.OutOfRangeError):
            self._account(0, 0)  # the data ended: this call trained nothing
            raise

    def _uninstall(self) -> None:
        self._put_back_train_function()
        # Keep the twin of the function a next `fit` will call, not those of
        # functions Keras has dropped (a recompile makes a new one).
        current = getattr(self.model, "train_function", None)
        self._twins = {key: entry for key, entry in self._twins.items()
                       if entry[0] is current}

    # --- the backend's hooks ----------------------------------------------

    def _check_support(self) -> None:
        compat.check_runtime_support(self.model)

    @staticmethod
    def _new_input_wait():
        return strategy_lib.local_variable(0.0, tf.float64)

    @staticmethod
    def _next_batch(iterator):
        """The next batch; StopIteration at the end of the data (TensorFlow
        may raise OutOfRangeError there)."""
        try:
            return next(iterator)
        except tf.errors.OutOfRangeError:
            raise StopIteration from None

    def _batch_samples(self, element) -> int:
        """Samples in one batch `element` of a distributed iterator, over
        all workers (each worker holds an equal shard)."""
        strategy = self.model.distribute_strategy
        leaf = tf.nest.flatten(element)[0]
        local = sum(int(t.shape[0])
                    for t in strategy.experimental_local_results(leaf))
        if strategy_lib.is_multi_worker(strategy):
            return local * strategy_lib.num_workers()
        return local

    @staticmethod
    def host_array(value) -> np.ndarray:
        """A variable's or tensor's value in host memory."""
        return np.asarray(value)

    def _sync_state(self) -> None:
        pass

    def read_device(self, read: Callable[[Callable], dict],
                    cached: Optional[tuple] = None, key=None,
                    compiled: bool = True) -> tuple[Optional[tuple], dict]:
        """The values `read(value)` returns, read at once.

        Args:
            read: Builds the dict of values to read; `value(x)` converts a
                variable or tensor to what it holds.
            cached: Defaults to None. The `(key, reader)` kept from an
                earlier read.
            key: Defaults to None: reuse `cached`. Else what `read` reads,
                by identity: `cached` is traced anew where it differs.
            compiled: Defaults to True. False reads eagerly (variables
                that may not exist yet).

        Returns:
            The `(key, reader)` to keep, and the values (tensors, or
            arrays: `np.asarray` takes either).
        """
        if not compiled:
            return cached, read(_tensor)
        if key is not None and (cached is None or cached[0] != key):
            # The concrete function holds what it reads, so the ids in the
            # key stay theirs while it lives.
            cached = (key, tf.function(lambda: read(_tensor),
                                       autograph=False).get_concrete_function())
        # Without a key, the caller hands back the reader it kept.
        assert cached is not None
        return cached, cached[1]()

    def ready_fetch_seconds(self) -> float:
        """Seconds a timed fetch takes when its batch is already there: the
        fixed cost under any pipeline's input wait (what `keras-mgpu bench`
        measures in a whole `fit`).

        The median of a few fetches of an always-ready batch through the
        model's strategy, each bracketed by timestamps as the timed train
        step brackets its fetches; measured once per strategy (a fraction
        of a second, most of it tracing).
        """
        strategy = self.model.distribute_strategy
        seconds = _READY_FETCH.get(strategy)
        if seconds is None:
            seconds = _READY_FETCH[strategy] = _time_ready_fetches(strategy)
        return seconds

    @staticmethod
    def local_gpus() -> int:
        """This process's GPUs."""
        return len(tf.config.list_logical_devices("GPU"))

    @staticmethod
    def gpu_memory(num_gpus: int, reset: bool) -> dict:
        """Current and peak bytes per local GPU (the peak reset after the
        read with `reset`); `{}` without GPUs."""
        out = {}
        for index in range(num_gpus):
            device = f"GPU:{index}"
            try:
                info = tf.config.experimental.get_memory_info(device)
                if reset:
                    tf.config.experimental.reset_memory_stats(device)
            except (ValueError, tf.errors.OpError):
                continue
            out[f"GPU{index}"] = {
                "current_bytes": int(info["current"]),
                "peak_bytes": int(info["peak"]),
            }
        return out


def _tensor(value):
    return tf.identity(keras.ops.convert_to_tensor(value))


_READY_FETCH: weakref.WeakKeyDictionary[Any, float] = (
    weakref.WeakKeyDictionary())  # strategy: seconds
_READY_SAMPLES = 16


def _time_ready_fetches(strategy) -> float:
    # One tiny batch (a row per replica), repeated and prefetched: every
    # fetch finds it there. Not sharded, so no worker waits for another.
    rows = np.zeros((strategy.num_replicas_in_sync, 1), np.float32)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF)
    dataset = (tf.data.Dataset.from_tensors((rows, rows)).repeat()
               .prefetch(2).with_options(options))
    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    @tf.function(autograph=False)
    def timed_fetch(iterator):
        start = tf.timestamp()
        with tf.control_dependencies([start]):
            element = iterator.get_next()
        outputs = [t for t in tf.nest.flatten(element, expand_composites=True)
                   if isinstance(t, tf.Tensor)]
        with tf.control_dependencies(outputs):
            return tf.timestamp() - start

    timed_fetch(iterator)  # traced, and the pipeline started
    return float(np.median([timed_fetch(iterator).numpy()
                            for _ in range(_READY_SAMPLES)]))
