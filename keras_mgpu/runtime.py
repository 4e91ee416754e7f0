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

import dataclasses
import warnings
import weakref
from typing import Callable, ContextManager, Optional

import keras
import numpy as np
import tensorflow as tf

from keras_mgpu import compat
from keras_mgpu import strategy as strategy_lib


@dataclasses.dataclass(frozen=True)
class ResumeEvent:
    """A run resumed from a backup.

    Args:
        generation: The backup generation restored.
        step: The global step it was saved at (the first step trained after
            it is `step + 1`).
        epoch: The epoch it resumed in (0-based).
        saved_replicas: Replicas in sync when it was saved.
        replicas: Replicas in sync in the resumed run.
    """

    generation: int
    step: int
    epoch: int
    saved_replicas: int
    replicas: int

    def describe(self) -> str:
        """One line for logs, e.g. `"resumed from generation 3 at step 12"`."""
        text = f"resumed from generation {self.generation} at step {self.step}"
        if self.saved_replicas != self.replicas:
            text += f" ({self.saved_replicas} -> {self.replicas} replicas)"
        return text


@dataclasses.dataclass(frozen=True)
class RunCounters:
    """The run's counters at one moment, over all replicas and workers.

    Args:
        global_step: Train batches trained over the run, continuing across
            resumes (skipped and replayed batches are not counted twice).
        samples_seen: Samples trained on over the run, or None when the
            model is not compiled (Keras counts them in its loss tracker).
        updates_applied: Optimizer updates applied (`optimizer.iterations`),
            or None without an optimizer.
        updates_skipped: Updates skipped for a non-finite gradient under a
            `LossScaleOptimizer` over the run (0 without one), or None
            without an optimizer.
        micro_step: Micro-batches in the current accumulation window
            (`GradientAccumulationModel`), else None.
        input_wait_seconds: Seconds this process's train steps were blocked
            on input (0.0 unless a reader asked for input timing).
        resumes: The run's `ResumeEvent`s, oldest first.
    """

    global_step: int
    samples_seen: Optional[float]
    updates_applied: Optional[int]
    updates_skipped: Optional[int]
    micro_step: Optional[int]
    input_wait_seconds: float
    resumes: tuple


def training_runtime(model) -> "TrainingRuntime":
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
    return runtime


class TrainingRuntime:
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

    def __init__(self, model):
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
        self._timing = False
        self._wrapper = None
        self._inner = None
        self._untimed = True
        # Instrumented twins (timed, or counting only) by (id(function),
        # timed): (function, twin).
        self._timed = {}
        self._step_scope = None

    @property
    def model(self):
        return self._model()

    # --- hooks (called by callbacks; each acts once per event) -------------

    def train_begin(self, callback) -> None:
        """Starts a `fit` (or a hand-driven callback loop)."""
        params = callback.params
        if self._in_fit and (not params or params is self._fit_params):
            return
        compat.check_runtime_support(self.model)
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
        self._steps_before_batch = self.global_step
        self._in_batch = True
        self._epoch_open = True
        self._batch_begin = batch
        self._call_steps = steps
        self.epoch_step = batch + steps
        self.batch_trains = steps > skipped
        self.global_step += steps - skipped

    def train_batch_end(self, batch: int) -> None:
        self._in_batch = False

    def test_begin(self) -> None:
        """Validation inside `fit` resets the metrics: count the epoch's
        samples first."""
        self._in_batch = False
        self._count_epoch_samples()

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

    @property
    def last_call_of_epoch(self) -> bool:
        """Whether the call in progress (or just done) is its epoch's last,
        as Keras plans the epoch (False where its length is unknown)."""
        return bool(self._epoch_steps) and (
            self._batch_begin + self._steps_per_call >= self._epoch_steps)

    @property
    def completed_steps(self) -> int:
        """Train batches finished (the global step minus a batch in progress)."""
        return self._steps_before_batch if self._in_batch else self.global_step

    def time_input(self) -> tf.Variable:
        """Asks for input timing (from the next batch on); returns the float64
        variable holding this process's seconds waited for input."""
        self._timing = True
        return self.input_wait_variable

    @property
    def input_wait_variable(self) -> tf.Variable:
        if self._input_wait is None:
            self._input_wait = strategy_lib.local_variable(0.0, tf.float64)
        return self._input_wait

    def counter_variables(self) -> dict:
        """The device-side sources of `counters()`, for a compiled reader:
        `samples` (this epoch's), `applied`, `attempted` (None for a plain
        model: its attempts are its batches), `micro_step`, `input_wait`.
        Each is a variable or None."""
        model = self.model
        optimizer = getattr(model, "optimizer", None)
        window = getattr(model, "window_variables", None) or {}
        return {
            "samples": compat.examples_count(model),
            "applied": None if optimizer is None else optimizer.iterations,
            "attempted": window.get("update_count"),
            "micro_step": window.get("micro_step"),
            "input_wait": self.input_wait_variable,
        }

    def counters(self, values: Optional[dict] = None) -> RunCounters:
        """The run's counters now.

        Args:
            values: Defaults to `None`: read `counter_variables()` eagerly
                (under MultiWorkerMirroredStrategy the sample count is a
                collective: call it on every worker at the same point).
                Or their values, read by the caller in its own compiled call.
        """
        if values is None:
            values = {
                key: None if v is None else np.asarray(
                    keras.ops.convert_to_numpy(v))
                for key, v in self.counter_variables().items()
            }
        samples = values["samples"]
        if samples is not None:
            samples = self._samples_before_epoch + (
                0.0 if self._epoch_samples_counted else float(samples))
        applied = _int(values["applied"])
        attempted = _int(values["attempted"])
        if attempted is None:
            attempted = self.completed_steps
        skipped = None
        if applied is not None:
            if self._updates_offset is None:
                self._updates_offset = attempted - applied
            skipped = max(attempted - applied - self._updates_offset, 0)
        return RunCounters(
            global_step=self.completed_steps,
            samples_seen=samples,
            updates_applied=applied,
            updates_skipped=skipped,
            micro_step=_int(values["micro_step"]),
            input_wait_seconds=float(values["input_wait"]),
            resumes=tuple(self.resumes),
        )

    def update_counts(self) -> tuple:
        """(attempted, applied) optimizer updates so far; two scalar reads.
        Applied is None without an optimizer."""
        model = self.model
        optimizer = getattr(model, "optimizer", None)
        # A plain model attempts one update per batch; an accumulating one
        # counts its windows.
        attempted = getattr(model, "update_count", None)
        if attempted is None:
            attempted = self.completed_steps
        if optimizer is None:
            return attempted, None
        return attempted, int(optimizer.iterations.numpy())

    # --- saving and resuming (BackupAndRestore) ------------------------------

    def state(self) -> dict:
        """The counters a backup carries, as plain JSON values."""
        counters = self.counters()
        seen = counters.samples_seen
        epoch_samples = None
        if seen is not None:
            # Between epochs (an epoch's end): the next one trained nothing.
            epoch_samples = (seen - self._samples_at_epoch_start
                             if self._epoch_open else 0.0)
        if self._epoch_open:
            stream_base, keras_base = self._stream_base, self._keras_base
        else:
            stream_base = self._next_stream_base
            keras_base = self._next_keras_base
        return {
            "global_step": counters.global_step,
            "samples_seen": seen,
            # What a resume mid-epoch skips; by samples, so that it stays
            # exact under another batch size.
            "epoch_samples": epoch_samples,
            # Batches of the data iterator read before this epoch, when
            # Keras reads one iterator across epochs (`steps_per_epoch`),
            # and Keras's own count of them.
            "stream_before_epoch": stream_base,
            "keras_count_before_epoch": keras_base,
            "updates_offset": self._updates_offset,
            "input_wait_seconds": counters.input_wait_seconds,
            "replicas": strategy_lib.num_replicas(
                self.model.distribute_strategy),
            "resumes": [dataclasses.asdict(e) for e in self.resumes],
        }

    def resume(self, state: dict, *, generation: int, epoch: int,
               step_in_epoch: int) -> ResumeEvent:
        """Continues the run saved in `state`: counters restored, and the
        first `step_in_epoch` batches of `epoch` skipped."""
        self.global_step = self._steps_before_batch = state["global_step"]
        self._samples_before_epoch = float(state["samples_seen"] or 0.0)
        self._updates_offset = state["updates_offset"]
        self.input_wait_variable.assign(state["input_wait_seconds"])
        self.resumes = [ResumeEvent(**e) for e in state["resumes"]]
        event = ResumeEvent(
            generation=generation, step=state["global_step"], epoch=epoch,
            saved_replicas=state["replicas"],
            replicas=strategy_lib.num_replicas(self.model.distribute_strategy),
        )
        self.resumes.append(event)
        self.resumed_here.append(event)
        epoch_samples = state.get("epoch_samples")
        before = int(state.get("stream_before_epoch") or 0)
        self._skip = None
        if step_in_epoch or before:
            self._skip = _Skip(
                epoch=epoch, batches=step_in_epoch,
                # 0 samples over several batches: a train step that does
                # not count them; skip by batches then.
                samples=epoch_samples if step_in_epoch and epoch_samples
                else None,
                before_epoch=before,
                keras_count=int(state.get("keras_count_before_epoch") or 0))
        self._samples_at_epoch_start = self._samples_before_epoch - (
            epoch_samples or 0.0)
        # Saved mid-epoch, the epoch's samples so far are in samples_seen;
        # the tracker restarts at 0 for the batches still to train.
        self._epoch_samples_counted = False
        return event

    # --- the train function --------------------------------------------------

    def _install(self) -> None:
        """Puts the wrapper in place of `model.train_function` (again, if
        another callback swapped it since)."""
        model = self.model
        current = getattr(model, "train_function", None)
        if current is None or current is self._wrapper:
            return
        inner = getattr(current, "keras_mgpu_inner", current)
        self._inner = inner
        # The twin that fetches as `inner` does but also counts the batches
        # (and times the fetches, if asked): a call of several steps may
        # hold fewer batches than `steps_per_execution` where the data ends.
        twin = None
        if self._timing or self._steps_per_call > 1:
            twin = self._twin(inner, timed=self._timing)
        step = twin if self._timing and twin is not None else inner
        self._untimed = step is inner

        def train_function(iterator):
            self._read_from(iterator)
            if self._skip is not None:
                logs, read, trained = self._skip_then_train(iterator, step)
                if read:
                    self._account(read, trained)
                    return logs
                # Only batches of earlier epochs were skipped: the call
                # trains as any other.
            logs, read = self._train(iterator, step, twin)
            self._account(read, read)
            return logs

        train_function.keras_mgpu_inner = inner
        self._wrapper = model.train_function = train_function

    def _twin(self, inner, timed: bool):
        # Cached by the function it instruments: a function swapped out and
        # back gets the same twin, with no retrace.
        key = (id(inner), timed)
        cached = self._timed.get(key)
        if cached is None or cached[0] is not inner:
            if self._batches_read is None:
                self._batches_read = strategy_lib.local_variable(0, tf.int64)
                self._fetched = 0
            cached = (inner, compat.instrumented_train_function(
                inner, seconds_waited=(self.input_wait_variable if timed
                                       else None),
                batches_read=self._batches_read))
            self._timed[key] = cached
        return cached[1]

    def _scoped(self, function, iterator):
        scope = self._step_scope
        if scope is None:
            return function(iterator)
        with scope():
            return function(iterator)

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
            return self._train_batches(step, iterator, self._steps_per_call)
        except (StopIteration, tf.errors.OutOfRangeError):
            self._account(0, 0)  # the data ended: this call trained nothing
            raise

    def _train_batches(self, step, iterator, limit: int):
        """Trains at most `limit` batches of `iterator` in one call, through
        the train function's loop over a Python iterator (Keras's own, as
        for `train_on_batch`): (logs, batches trained). Raises StopIteration
        when the data has none left."""
        first = _next(iterator)
        count = [1]

        def batches():
            yield first
            for _ in range(limit - 1):
                try:
                    element = _next(iterator)
                except StopIteration:
                    return
                count[0] += 1
                yield element

        logs = self._scoped(step, batches())
        return logs, count[0]

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

    # --- resuming: skipping what the interrupted run trained -----------------

    def _skip_then_train(self, iterator, step):
        """A call while a resume skips: reads the batches the interrupted run
        had trained on, trains nothing on them, and trains the rest of the
        call (where the saved position lies inside it). Returns (logs, batches
        of the epoch read, batches trained); logs are empty while nothing
        trained (the metrics may not be built yet)."""
        skip = self._skip
        if skip.before_epoch:
            # The interrupted run's epoch began this far into its iterator.
            epoch_iterator = compat.fit_epoch_iterator(self.model)
            if (epoch_iterator is not None
                    and not compat.epoch_iterator_keeps_iterator(
                        epoch_iterator)):
                self._skip = None
                raise ValueError(
                    f"{self._saved_where(skip)}, which began "
                    f"{skip.before_epoch} batches into data that "
                    "steps_per_epoch read on across epochs; this run reads "
                    "its data afresh each epoch (no steps_per_epoch), so it "
                    "cannot start where that epoch did. Nothing was trained. "
                    "Resume with the steps_per_epoch the backup was made "
                    "with, or start fresh with a new backup_dir."
                )
            for read in range(skip.before_epoch):
                try:
                    _next(iterator)
                except StopIteration:
                    self._skip = None
                    raise ValueError(self._short_data_message(
                        skip, f"the saved epoch began {skip.before_epoch} "
                        "batches into the data, which steps_per_epoch reads "
                        "on across epochs, but this run's data ended after "
                        f"{read}")) from None
            self._stream_read += skip.before_epoch
            self._stream_base = skip.before_epoch
            self._keras_base = skip.keras_count
            compat.add_epoch_iterator_count(epoch_iterator, skip.keras_count)
            skip.before_epoch = 0
        limit = self._steps_per_call
        read = 0
        while read < limit and not skip.done:
            try:
                element = _next(iterator)
            except StopIteration:
                self._skip = None
                raise ValueError(self._short_data_message(
                    skip, f"this run's data ended after {skip.skipped} of "
                    "them")) from None
            read += 1
            skip.skipped += 1
            if skip.samples is not None:
                self._skip_samples_of(element)
        if not skip.done:
            return {}, read, 0
        self._skip = None
        if read == 0 or read == limit:
            return {}, read, 0
        try:
            logs, trained = self._train_batches(step, iterator, limit - read)
        except StopIteration:
            # The interrupted run had read the data to its end.
            return {}, read, 0
        return logs, read + trained, trained

    def _skip_samples_of(self, element) -> None:
        """Counts a skipped batch's samples; refuses the resume when this
        run's batches cannot end where the saved run's did."""
        skip = self._skip
        batch = _global_batch(self.model.distribute_strategy, element)
        if not skip.checked:
            self._check_skip(batch)
        skip.skipped_samples += batch
        if skip.skipped_samples > skip.samples:
            self._skip = None
            raise ValueError(
                f"{self._saved_where(skip)}; {skip.skipped} of this run's "
                f"batches hold {skip.skipped_samples:g} samples: they do not "
                f"end at {skip.samples:g}, so some samples would be trained "
                "twice or never. Resume with the data and global batch size "
                "the backup was made with, or start fresh with a new "
                "backup_dir."
            )

    def _check_skip(self, batch: int) -> None:
        """At the first skipped batch, which shows this run's batch size:
        the saved epoch's samples are skipped, whatever the size, or the
        resume is refused if that cannot be exact."""
        skip = self._skip
        skip.checked = True
        samples, saved_batches = skip.samples, skip.saved_batches
        where = f"{self._saved_where(skip)}; this run's batches hold {batch}"
        # Equal, or the saved run's last batch held fewer: its data ended
        # there (only the last batch of the data is partial).
        same = batch * (saved_batches - 1) < samples <= batch * saved_batches
        if not same:
            if samples % batch:
                self._skip = None
                raise ValueError(
                    f"{where}, and no whole number of them is {samples:g} "
                    "samples: some samples would be trained twice or never. "
                    f"Resume with the saved global batch size "
                    f"{samples / saved_batches:g}, or start fresh with a new "
                    "backup_dir."
                )
            skip.batches = int(samples // batch)
            warnings.warn(
                f"{where}: skipping {skip.batches} batches, the same "
                f"{samples:g} samples. From here on each optimizer step "
                f"takes {batch} samples, not {samples / saved_batches:g} as "
                "in the saved run.",
                stacklevel=2,
            )
        epoch = self._epoch_steps
        if epoch:
            # Keras reads at most this many: calls of steps_per_execution.
            most = -(-epoch // self._steps_per_call) * self._steps_per_call
            if skip.batches > most:
                self._skip = None
                raise ValueError(self._short_data_message(
                    skip, f"this run's epochs hold {epoch} batches of "
                    f"{batch}"))

    @staticmethod
    def _saved_where(skip) -> str:
        text = "The backup resumed here was saved after "
        if not skip.saved_batches:
            return ("The backup resumed here was saved at the start of epoch "
                    f"{skip.epoch}")
        if skip.samples is None:
            return text + f"{skip.saved_batches} batches of epoch {skip.epoch}"
        size = skip.samples / skip.saved_batches
        of = f" of {size:g}" if size == int(size) else ""
        return text + (f"{skip.samples:g} samples of epoch {skip.epoch} "
                       f"({skip.saved_batches} batches{of})")

    def _short_data_message(self, skip, what: str) -> str:
        return (
            f"{self._saved_where(skip)}; {what}: this run's data is shorter "
            "than the saved run's, and resuming would skip what it never "
            "trained. Nothing was trained. Resume with the data (and "
            "steps_per_epoch) the backup was made with, or start fresh with "
            "a new backup_dir."
        )

    @property
    def input_timed(self) -> bool:
        """Whether the batch in progress has its input wait timed."""
        return (self._timing and self._wrapper is not None
                and not self._untimed and self.batch_trains)

    def _uninstall(self) -> None:
        model = self.model
        if self._wrapper is not None and getattr(
                model, "train_function", None) is self._wrapper:
            model.train_function = self._inner
        self._wrapper = None
        # Keep the twin of the function a next `fit` will call, not those of
        # functions Keras has dropped (a recompile makes a new one).
        current = getattr(model, "train_function", None)
        self._timed = {key: entry for key, entry in self._timed.items()
                       if entry[0] is current}

    # --- helpers -------------------------------------------------------------

    def _once(self, event) -> bool:
        if event == self._event:
            return False
        self._event = event
        return True

    def _count_epoch_samples(self) -> None:
        if self._epoch_samples_counted:
            return
        self._epoch_samples_counted = True
        seen = compat.examples_seen(self.model)
        if seen is not None:
            self._samples_before_epoch += seen


@dataclasses.dataclass
class _Skip:
    """What a resume skips of its first epoch."""

    epoch: int
    batches: int  # of the epoch (this run's, once the batch size is seen)
    samples: Optional[float]  # they hold (None: skip by batches)
    before_epoch: int  # batches of the iterator read in earlier epochs
    keras_count: int  # Keras's count of those
    skipped: int = 0
    skipped_samples: float = 0.0
    checked: bool = False

    def __post_init__(self):
        self.saved_batches = self.batches

    @property
    def done(self) -> bool:
        if self.samples is None:
            return self.skipped >= self.batches
        return self.skipped_samples >= self.samples


def _next(iterator):
    """The next batch; StopIteration at the end of the data (TensorFlow may
    raise OutOfRangeError there)."""
    try:
        return next(iterator)
    except tf.errors.OutOfRangeError:
        raise StopIteration from None


def _global_batch(strategy, element) -> int:
    """Samples in one batch `element` of a distributed iterator, over all
    workers (each worker holds an equal shard)."""
    leaf = tf.nest.flatten(element)[0]
    local = sum(int(t.shape[0])
                for t in strategy.experimental_local_results(leaf))
    if strategy_lib.is_multi_worker(strategy):
        return local * strategy_lib.num_workers()
    return local


def _int(value) -> Optional[int]:
    return None if value is None else int(value)
