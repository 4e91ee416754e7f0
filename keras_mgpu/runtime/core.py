"""The training runtime under keras-mgpu's callbacks: one wrapper, one set of counters.

Every keras-mgpu callback of a model shares its `TrainingRuntime`
(`training_runtime(model)`). The runtime alone replaces
`model.train_function` (to skip the batches a resumed run already trained
on, and to time input fetches), and it keeps the run's counters: the global
step, which continues across resumes, samples seen, optimizer updates made
and skipped, and the resume events. `BackupAndRestore` saves and restores
them; `DistributedLogger` and `LossScaleMonitor` only read them.

Callbacks drive it from their hooks (`train_begin`, `epoch_begin`,
`train_batch_begin`, ...). Each hook is acted on once per event, by whichever
callback calls it first, so their order in the callback list does not
matter. It works with `run_eagerly=True` and in a hand-written loop that
drives the callbacks through `keras.callbacks.CallbackList` (no train
function then: nothing to wrap, the counters still count).
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Callable, ContextManager, Optional

import keras

from keras_mgpu import backend, compat
from keras_mgpu.goodput.ledger import ledger
from keras_mgpu.runtime.counters import _RuntimeCounters
from keras_mgpu.runtime.skipping import ResumeSkipping

# The backend's half of the runtime: the train-function wrapper, with the
# runtime's backend hooks (keras_mgpu/backend/__init__.py).
_backend = backend.active()
if TYPE_CHECKING:
    # The active backend's; type checkers read TensorFlow's.
    from keras_mgpu.backend.tensorflow.train_function import (
        TrainFunctionWrapper as _TrainFunctionWrapper)
else:
    _TrainFunctionWrapper = _backend.TrainFunctionWrapper
# Before any callback is made: `model.fit(x, callbacks=[...])` looks `fit`
# up before it makes them.
compat.record_fits_from_import()


def training_runtime(model: keras.Model) -> "TrainingRuntime":
    """The `TrainingRuntime` of `model`, created on first use.

    Example:

    >>> import keras
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> training_runtime(model) is training_runtime(model)
    True
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"training_runtime() needs the keras.Model being trained, got "
            f"{model!r} (a {type(model).__name__}). Pass the model itself, "
            "e.g. a callback's self.model."
        )
    runtime = getattr(model, "_keras_mgpu_runtime", None)
    if runtime is None:
        # On the model, not in a weak-keyed table: the runtime holds Keras's
        # train function, which holds the model, so a table entry would keep
        # every model alive; as an attribute it is one more collectable cycle.
        runtime = TrainingRuntime(model)
        model._keras_mgpu_runtime = runtime
        compat.record_fits()  # checks this Keras
        compat.keep_ctrl_c()
    return runtime


class TrainingRuntime(_TrainFunctionWrapper, ResumeSkipping,
                      _RuntimeCounters):
    """One model's training runtime: the train-function wrapper and counters.

    Get it with `training_runtime(model)`; callbacks call its hooks, in any
    order, and read its public attributes and `counters()`.

    Args:
        model: The model being trained.

    Attributes:
        global_step: Train batches trained over the run, including the batch
            in progress (its step number once done).
        epoch: The current epoch (0-based).
        epoch_step: Batches of the current epoch read from the data (trained,
            or skipped by a resume), including the call in progress. Counted
            from what the train function consumed, so a last, partial
            `steps_per_execution` call counts the batches it held.
        batch_trains: Whether the batch in progress trains (False while a
            resume skips batches already trained).
        resumes: The run's `ResumeEvent`s, oldest first.
        resumed_here: Those this process made (a backup restored here).

    Example:

    >>> import tempfile, numpy as np, keras
    >>> from keras_mgpu.callbacks import DistributedLogger
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> logger = DistributedLogger(tempfile.mkdtemp(), console=False)
    >>> _ = model.fit(np.ones((32, 4)), np.ones((32, 1)), batch_size=8,
    ...               verbose=0, callbacks=[logger])
    >>> counters = training_runtime(model).counters()
    >>> counters.global_step, counters.samples_seen, counters.updates_applied
    (4, 32.0, 4)
    """

    def __init__(self, model: keras.Model) -> None:
        self._model = weakref.ref(model)
        self.global_step = 0
        self.epoch = 0
        self.batch_trains = True
        self.resumes = []
        self.resumed_here = []
        self.epoch_step = 0
        self._steps_before_batch = 0
        self._in_batch = False
        self._fit_params = None
        self._in_fit = False
        self._event = None
        self._steps_per_call = 1
        self._epoch_steps = None
        # The call in progress: Keras's index of its first batch, and the
        # batches it reads as predicted before it runs.
        self._batch_begin = 0
        self._call_steps = 1
        # Keras on JAX runs the batch ends of `async_safe` callbacks on
        # other threads, possibly after the next batch began.
        self._batch_lock = threading.Lock()
        # What a resume skips (a `_Skip`), until it is done.
        self._skip = None
        # The data iterator being read and the batches read from it; with
        # `steps_per_epoch` Keras reads one iterator across epochs.
        self._stream = None
        self._stream_read = 0
        self._epoch_open = False
        self._first_call = False
        # Of the stream, read before this epoch (and Keras's count of it).
        self._stream_base = 0
        self._keras_base = 0
        # The same for the next epoch, known at this one's end.
        self._next_stream_base = 0
        self._next_keras_base = 0
        # Device-side count of the batches the instrumented train function
        # fetched, and its host mirror.
        self._batches_read = None
        self._fetched = 0
        self._samples_before_epoch = 0.0
        self._samples_at_epoch_start = 0.0
        self._epoch_samples_counted = True
        # attempted - applied updates before this run's counting began.
        self._updates_offset = None
        self._input_wait = None
        self._timing_asked = False
        self._wrapper = None
        self._inner = None
        # Whether calls run Keras's own train function, not a twin (then
        # nothing times their input).
        self._runs_keras_step = True
        # Instrumented twins (timed, or counting only) by (id(function),
        # timed): (function, twin).
        self._twins = {}
        self._step_scope = None
        # The train functions called once (traced and compiled by then),
        # and whether this fit's loop and validation are on the ledger.
        self._compiled: weakref.WeakSet = weakref.WeakSet()
        self._loop_on_ledger = False
        self._in_validation = False

    @property
    def model(self):
        return self._model()

    # --- hooks (called by callbacks; each acts once per event) -------------

    def train_begin(self, callback: keras.callbacks.Callback) -> None:
        """Starts a `fit` (or a hand-driven callback loop)."""
        params = callback.params
        if self._in_fit and (not params or params is self._fit_params):
            return
        self._check_support()
        compat.defer_ctrl_c(compat.running_fit(self.model))
        self._in_fit = True
        self._fit_params = params
        self._event = None
        self._wrapper = None
        self._step_scope = None  # one a `fit` that raised left
        self._steps_per_call = int(getattr(self.model, "steps_per_execution", 1))
        self._epoch_steps = (params or {}).get("steps")
        if self._updates_offset is None:
            attempted, applied = self.update_counts()
            if applied is not None:
                self._updates_offset = attempted - applied

    def epoch_begin(self, epoch: int) -> None:
        if not self._once(("epoch", epoch)):
            return
        self.epoch = epoch
        self.epoch_step = 0
        self._in_batch = False
        self._epoch_open = False
        self._first_call = True
        self._epoch_samples_counted = False
        if self._skip is not None and self._skip.epoch != epoch:
            self._skip = None
        if self._skip is None:
            self._samples_at_epoch_start = self._samples_before_epoch

    def train_batch_begin(self, batch: int) -> None:
        compat.raise_deferred_ctrl_c()
        if not self._once(("batch", self.epoch, batch)):
            return
        self._install()
        steps = self._steps_per_call
        if self._epoch_steps:
            steps = max(min(steps, self._epoch_steps - batch), 1)
        # A prediction: the train function's wrapper corrects both counts
        # with what the call read and trained.
        skipped = 0
        if self._skip is not None:
            skipped = min(steps, max(self._skip.batches - batch, 0))
        with self._batch_lock:
            self._steps_before_batch = self.global_step
            self._in_batch = True
            self._batch_begin = batch
        self._epoch_open = True
        self._call_steps = steps
        if not self._loop_on_ledger:
            self._loop_on_ledger = True
            ledger().set_training(True)
        self.epoch_step = batch + steps
        self.batch_trains = steps > skipped
        self.global_step += steps - skipped

    def train_batch_end(self, batch: int) -> None:
        # Only the end of the call in progress closes it: an end that Keras
        # dispatched late (after the next batch began) is stale.
        with self._batch_lock:
            if batch >= self._batch_begin:
                self._in_batch = False

    def test_begin(self) -> None:
        """Validation inside `fit` resets the metrics: count the epoch's
        samples first."""
        self._in_batch = False
        self._count_epoch_samples()
        if not self._in_validation:
            self._in_validation = True
            ledger().enter("evaluation")

    def test_end(self) -> None:
        if self._in_validation:
            self._in_validation = False
            ledger().leave()

    def epoch_end(self, epoch: int) -> None:
        self._in_batch = False
        self._count_epoch_samples()
        if not self._epoch_open:
            return  # already ended, or a callback list without batches
        self._epoch_open = False
        skip = self._skip
        if skip is not None and skip.epoch == epoch and self._wrapper is not None:
            # Keras ended the epoch before the batches to skip: its data
            # is shorter than the saved run's.
            self._skip = None
            raise ValueError(self._short_data_message(
                skip, f"this run's epoch ended after {skip.skipped} of "
                "them"))
        self._skip = None
        # Whether Keras's next epoch reads on from this epoch's iterator
        # (`steps_per_epoch`): then a resume there starts that far into it.
        epoch_iterator = compat.fit_epoch_iterator(self.model)
        if self._stream is not None and compat.epoch_iterator_reads_on(
                epoch_iterator, self._stream):
            self._next_stream_base = self._stream_read
            self._next_keras_base = compat.epoch_iterator_count(
                epoch_iterator)
        else:
            self._next_stream_base = self._next_keras_base = 0

    def train_end(self) -> None:
        self.test_end()  # a validation that raised never ended
        if self._loop_on_ledger:
            self._loop_on_ledger = False
            ledger().set_training(False)
        if not self._in_fit:
            return
        self._in_fit = False
        self._in_batch = False
        self._skip = None
        self._step_scope = None
        self._stream = None  # the next fit reads its own iterator
        self._next_stream_base = self._next_keras_base = 0
        self._uninstall()

    def scope_steps(self, scope: Optional[Callable[[], ContextManager]]
                    ) -> None:
        """Enters `scope()` around every trained step of this `fit` (None:
        none): a context only the model's own step sees (a default summary
        writer), not other callbacks' hooks."""
        self._step_scope = scope

    # --- reading ------------------------------------------------------------

    def sync_variables(self) -> None:
        """Puts the train state into the model's variables, before a read
        of them: Keras's JAX `fit` trains on a state it keeps outside them
        (a no-op on TensorFlow, and where they hold it already)."""
        self._sync_state()

    @property
    def last_call_of_epoch(self) -> bool:
        """Whether the call in progress (or just done) is its epoch's last,
        as Keras plans the epoch (False where its length is unknown)."""
        epoch_steps = self._epoch_steps
        if not epoch_steps:
            return False
        return self._batch_begin + self._steps_per_call >= epoch_steps

    @property
    def input_timed(self) -> bool:
        """Whether the batch in progress has its input wait timed."""
        return (self._timing_asked and self._wrapper is not None
                and not self._runs_keras_step and self.batch_trains)

    # --- helpers -------------------------------------------------------------

    # What each backend's train-function wrapper (and the resume's
    # skipping) shares: finding Keras's function, putting it back, training
    # at most some batches in one call, and telling the runtime of a call.

    def _take_train_function(self):
        """Keras's train function, to wrap now (unwrapped, where another
        callback put ours back in meanwhile), kept to be put back; None
        where the wrapper is in place or there is no function yet."""
        current = getattr(self.model, "train_function", None)
        if current is None or current is self._wrapper:
            return None
        self._inner = getattr(current, "keras_mgpu_inner", current)
        return self._inner

    def _scoped(self, function, *args):
        """`function(*args)` inside the step scope a caller set with
        `scope_steps`, if any; its first call (tracing and compiling it) on
        the ledger as `compile`."""
        if function in self._compiled:
            return self._call_scoped(function, *args)
        with ledger().spending("compile"):
            result = self._call_scoped(function, *args)
        self._compiled.add(function)
        return result

    def _call_scoped(self, function, *args):
        scope = self._step_scope
        if scope is None:
            return function(*args)
        with scope():
            return function(*args)

    def _train_batches(self, run: Callable, iterator, limit: int):
        """Trains at most `limit` batches of `iterator` in one call of
        `run(batches)` (the train function's own loop over a Python
        iterator, as for `train_on_batch`): (what it returned, batches
        trained). Raises StopIteration when the data has none left."""
        first = self._next_batch(iterator)
        count = [1]

        def batches():
            yield first
            for _ in range(limit - 1):
                try:
                    element = self._next_batch(iterator)
                except StopIteration:
                    return
                count[0] += 1
                yield element

        result = run(batches())
        return result, count[0]

    def _put_back_train_function(self) -> None:
        model = self.model
        if self._wrapper is not None and getattr(
                model, "train_function", None) is self._wrapper:
            model.train_function = self._inner
        self._wrapper = None

    def _account(self, read: int, trained: int) -> None:
        """The call in progress read `read` batches of the epoch and trained
        `trained` of them."""
        self.global_step = self._steps_before_batch + trained
        self.epoch_step = self._batch_begin + read
        self.batch_trains = trained > 0
        self._stream_read += read

    def _read_from(self, iterator) -> None:
        """Notes the data iterator of this call: a new one, or the one an
        earlier epoch read (Keras with `steps_per_epoch`)."""
        if not self._first_call:
            return
        self._first_call = False
        if iterator is self._stream:
            self._stream_base = self._next_stream_base
            self._keras_base = self._next_keras_base
        else:
            self._stream = iterator
            self._stream_read = self._stream_base = self._keras_base = 0

    def _once(self, event) -> bool:
        if event == self._event:
            return False
        self._event = event
        return True
