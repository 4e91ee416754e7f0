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
        self._steps_before_batch = 0
        self._in_batch = False
        self._fit_params = None
        self._in_fit = False
        self._event = None
        self._skip_epoch = None
        self._skip_until = 0
        self._skip_now = 0
        self._skip_samples = None
        self._call_steps = 1
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
        self._in_batch = False
        self._epoch_samples_counted = False
        if epoch != self._skip_epoch:
            self._skip_until = 0
            self._skip_samples = None
            self._samples_at_epoch_start = self._samples_before_epoch

    def train_batch_begin(self, batch: int) -> None:
        if not self._once(("batch", self.epoch, batch)):
            return
        self._install()
        steps = self._steps_per_call
        if self._epoch_steps:
            steps = max(min(steps, self._epoch_steps - batch), 1)
        self._steps_before_batch = self.global_step
        self._in_batch = True
        self._call_steps = steps
        if batch < self._skip_until:
            self.batch_trains = False
            self._skip_now = min(steps, self._skip_until - batch)
        else:
            self.batch_trains = True
            self._skip_now = 0
            self.global_step += steps

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
        if epoch == self._skip_epoch:
            self._skip_epoch = None  # a later fit replays nothing

    def train_end(self) -> None:
        if not self._in_fit:
            return
        self._in_fit = False
        self._in_batch = False
        self._skip_epoch = None
        self._step_scope = None
        self._uninstall()

    def scope_steps(self, scope: Optional[Callable[[], ContextManager]]
                    ) -> None:
        """Enters `scope()` around every trained step of this `fit` (None:
        none): a context only the model's own step sees (a default summary
        writer), not other callbacks' hooks."""
        self._step_scope = scope

    # --- reading ------------------------------------------------------------

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
        return {
            "global_step": counters.global_step,
            "samples_seen": seen,
            # What a resume mid-epoch skips; by samples, so that it stays
            # exact under another batch size.
            "epoch_samples": (None if seen is None
                              else seen - self._samples_at_epoch_start),
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
        self._skip_epoch = epoch
        self._skip_until = step_in_epoch
        epoch_samples = state.get("epoch_samples")
        self._skip_samples = epoch_samples if step_in_epoch else None
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
        step = inner
        if self._timing:
            # Cached by the function it times: a function swapped out and
            # back gets the same twin, with no retrace.
            cached = self._timed.get(id(inner))
            if cached is None or cached[0] is not inner:
                cached = (inner, compat.timed_train_function(
                    inner, self.input_wait_variable))
                self._timed[id(inner)] = cached
            step = cached[1] or inner
        self._untimed = step is inner

        def train_function(iterator):
            if self._skip_now:
                # Batches the interrupted run trained on: consume them, train
                # nothing. Empty logs: the metrics may not be built yet.
                count, self._skip_now = self._skip_now, 0
                element = next(iterator)
                if self._skip_samples is not None:
                    count = self._skip_by_samples(element, count)
                for _ in range(count - 1):
                    next(iterator)
                return {}
            scope = self._step_scope
            if scope is None:
                return step(iterator)
            with scope():
                return step(iterator)

        train_function.keras_mgpu_inner = inner
        self._wrapper = model.train_function = train_function

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

    def _skip_by_samples(self, element, count: int) -> int:
        """Batches to skip in this call, now that the first skipped batch
        shows this run's batch size: the saved epoch's samples are skipped,
        whatever the size (or the resume is refused if it cannot be exact)."""
        samples, self._skip_samples = self._skip_samples, None
        saved_batches = self._skip_until
        batch = _global_batch(self.model.distribute_strategy, element)
        if batch * saved_batches == samples:
            return count
        saved_batch = samples / saved_batches
        where = (f"The backup resumed here was saved after {samples:g} "
                 f"samples of epoch {self.epoch} ({saved_batches} batches of "
                 f"{saved_batch:g}); this run's batches hold {batch}")
        if samples % batch or self._call_steps > 1:
            why = (f"steps_per_execution={self._steps_per_call} skips whole "
                   "groups of batches" if self._call_steps > 1 else
                   f"no whole number of them is {samples:g} samples")
            raise ValueError(
                f"{where}, and {why}: some samples would be trained twice or "
                f"never. Resume with the saved global batch size "
                f"{saved_batch:g}, or start fresh with a new backup_dir."
            )
        self._skip_until = int(samples // batch)
        warnings.warn(
            f"{where}: skipping {self._skip_until} batches, the same "
            f"{samples:g} samples. From here on each optimizer step takes "
            f"{batch} samples, not {saved_batch:g} as in the saved run.",
            stacklevel=2,
        )
        return min(self._call_steps, self._skip_until)

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
