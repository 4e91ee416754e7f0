"""The training runtime's backend halves on JAX.

Keras's JAX `fit` calls `logs, state = model.train_function(state,
iterator)` at every step, with the Python iterator of the epoch's batches:
each batch is fetched on the host (sliced and put on the devices along the
distribution's batch axis), then the step is dispatched. The wrapper hands
Keras's train function an iterator that counts the batches each call reads
(a call of `steps_per_execution` steps may hold fewer where the data ends)
and, when asked, times each fetch with a host clock: the seconds the train
loop spent fetching input rather than dispatching steps. JAX dispatches
asynchronously, so the devices may still be running the previous step
meanwhile; a fetch the devices wait for is what makes a run input-bound.

During an epoch the train state lives in `model._jax_state`, not in the
model's variables (Keras purges them); the runtime puts it back
(`model.jax_state_sync()`) before it reads counters, and reads a record's
values eagerly. GPU memory comes from JAX's allocator (`memory_stats()`),
whose peak cannot be reset.

A resumed run's first calls go to the runtime's skipping
(`keras_mgpu/runtime/skipping.py`), which reads the batches the interrupted
run trained on and hands the rest of the call to Keras's function; a call
that trained nothing returns the state it was given.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Callable, Optional

import jax
import keras
import numpy as np
from jax.experimental import multihost_utils
from keras import tree

from keras_mgpu import compat

if TYPE_CHECKING:
    from keras_mgpu.runtime.counters import _Runtime as _Host
else:
    _Host = object


class TrainFunctionWrapper(_Host):
    """`TrainingRuntime`'s wrapper of the model's train function on JAX."""

    # --- the train function --------------------------------------------------

    def _install(self) -> None:
        """Puts the wrapper in place of `model.train_function` (again, if
        another callback swapped it since)."""
        model = self.model
        inner = self._take_train_function()
        if inner is None:
            return
        wait = self.input_wait_variable if self._timing_asked else None
        # Every call is counted; its fetches are timed where asked.
        self._runs_keras_step = wait is None

        def train_function(state, iterator):
            self._read_from(iterator)
            if self._skip is not None:
                result, read, trained = self._skip_then_train(
                    iterator,
                    lambda batches: self._scoped(inner, state, batches))
                if read:
                    self._account(read, trained)
                    # Nothing trained: the state goes on as it came.
                    return ({}, state) if result is None else result
                # Only batches of earlier epochs were skipped: the call
                # trains as any other.
            fetches = _Fetches(iterator, wait)
            try:
                logs, state = self._scoped(inner, state, fetches)
            except StopIteration:
                # The data ended: this call trained nothing.
                self._account(fetches.count, 0)
                raise
            self._account(fetches.count, fetches.count)
            return logs, state

        setattr(train_function, "keras_mgpu_inner", inner)
        self._wrapper = model.train_function = train_function

    def _uninstall(self) -> None:
        self._put_back_train_function()

    # --- the backend's hooks (backend/tensorflow/train_function.py has
    # TensorFlow's) ----------------------------------------------------------

    def _check_support(self) -> None:
        """What the runtime reads of Keras, checked as a `fit` begins: the
        loss tracker's sample count and the running `fit`'s epoch
        iterator."""
        model = self.model
        # A last batch that does not divide by the devices, placed whole.
        compat.enable_uneven_last_batches()
        compat.examples_count(model)
        epoch_iterator = compat.fit_epoch_iterator(model)
        if epoch_iterator is not None:
            compat.epoch_iterator_keeps_iterator(epoch_iterator)
            compat.epoch_iterator_count(epoch_iterator)
            compat.epoch_iterator_reads_on(epoch_iterator, None)

    @staticmethod
    def _new_input_wait():
        return _HostSeconds()

    @staticmethod
    def _next_batch(iterator):
        """The next batch; StopIteration at the end of the data."""
        return next(iterator)

    @staticmethod
    def _batch_samples(element) -> int:
        """Samples in one batch `element` over every process: Keras's JAX
        trainer hands the step global arrays (each process's rows placed
        on its devices along the batch axis)."""
        return int(tree.flatten(element)[0].shape[0])

    @staticmethod
    def host_array(value) -> np.ndarray:
        """A variable's or array's value in host memory, whole: an array
        sharded over devices of other processes (`ModelParallel` across
        hosts) is gathered from them, a collective every process calls in
        the same order."""
        value = getattr(value, "value", value)  # a Keras variable's array
        if (isinstance(value, jax.Array) and not value.is_fully_addressable
                and not value.is_fully_replicated):
            return np.asarray(multihost_utils.process_allgather(
                value, tiled=True))
        return np.asarray(value)

    def _sync_state(self) -> None:
        model = self.model
        if model is not None:
            # A no-op where the variables hold the state already.
            model.jax_state_sync()

    def read_device(self, read: Callable[[Callable], dict],
                    cached: Optional[tuple] = None, key=None,
                    compiled: bool = True) -> tuple[Optional[tuple], dict]:
        """The values `read(value)` returns, read eagerly once the train
        state is in the model's variables (`cached`, `key` and `compiled`
        are TensorFlow's: nothing is compiled here)."""
        self._sync_state()
        return cached, read(_host_value)

    @staticmethod
    def ready_fetch_seconds() -> float:
        """Seconds a timed fetch takes when its batch is already there: the
        median of a few host-timed fetches from an iterator whose batch is
        ready (measured once per process). Keras's JAX iterator prepares
        the next batch inside each fetch, so that work is the pipeline's:
        only the timing's own cost is fixed."""
        global _READY_FETCH
        if _READY_FETCH is None:
            wait = _HostSeconds()
            fetches = _Fetches(itertools.repeat(None), wait)
            samples = []
            for _ in range(_READY_SAMPLES):
                before = wait.value
                next(fetches)
                samples.append(wait.value - before)
            _READY_FETCH = float(np.median(samples))
        return _READY_FETCH

    @staticmethod
    def local_gpus() -> int:
        """This process's GPUs, as JAX sees them."""
        return len(_gpus())

    @staticmethod
    def gpu_memory(num_gpus: int, reset: bool) -> dict:
        """Current and peak bytes per local GPU, as JAX's allocator counts
        them; `{}` without GPUs. JAX cannot reset the peak: it is the
        process's (`reset` is TensorFlow's)."""
        out = {}
        for index, device in enumerate(_gpus()[:num_gpus]):
            stats = device.memory_stats() or {}
            if "bytes_in_use" not in stats:
                continue
            current = int(stats["bytes_in_use"])
            out[f"GPU{index}"] = {
                "current_bytes": current,
                "peak_bytes": int(stats.get("peak_bytes_in_use", current)),
            }
        return out


class _Fetches:
    """The iterator Keras's train function reads, counting its batches and
    adding the seconds each fetch took to `wait` (None: untimed)."""

    __slots__ = ("_iterator", "_wait", "count")

    def __init__(self, iterator, wait: Optional["_HostSeconds"]):
        self._iterator = iterator
        self._wait = wait
        self.count = 0

    def __iter__(self):
        return self

    def __next__(self):
        wait = self._wait
        if wait is None:
            element = next(self._iterator)
        else:
            start = time.perf_counter()
            try:
                element = next(self._iterator)
            finally:
                wait.value += time.perf_counter() - start
        self.count += 1
        return element


class _HostSeconds:
    """Seconds waited for input, kept on the host: what the runtime's
    `input_wait_variable` is on JAX (`np.asarray` and `float` read it)."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = 0.0

    def assign(self, value) -> None:
        self.value = float(value)

    def numpy(self) -> np.float64:
        return np.float64(self.value)

    def __float__(self) -> float:
        return self.value

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.value, dtype=dtype or np.float64)


_READY_FETCH: Optional[float] = None  # seconds, once measured
_READY_SAMPLES = 16


def _gpus() -> list:
    return [device for device in jax.local_devices()
            if device.platform == "gpu"]


def _host_value(value) -> np.ndarray | np.float64:
    if isinstance(value, _HostSeconds):
        return value.numpy()
    return np.asarray(keras.ops.convert_to_numpy(value))
