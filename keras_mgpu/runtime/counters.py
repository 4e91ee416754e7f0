"""The run's counters: what `TrainingRuntime` counts, reads and saves.

`RunCounters` is the counters at one moment, `ResumeEvent` one resume;
`counter_variables()` names their device-side sources for a compiled reader,
and `state()`/`resume()` are what a backup carries of them.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import (TYPE_CHECKING, Any, Callable, ContextManager, Iterator,
                    Optional)

import keras
import numpy as np

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


if TYPE_CHECKING:

    class _Runtime:
        """For type checkers only: the state `TrainingRuntime.__init__`
        sets (keras_mgpu/runtime/core.py) and the methods its halves call
        on one another: the counters here, `ResumeSkipping`
        (skipping.py) and the backend's `TrainFunctionWrapper`
        (keras_mgpu/backend/<name>/). At run time they derive from
        `object`."""

        _model: Callable[[], Any]
        global_step: int
        epoch: int
        batch_trains: bool
        resumes: list[ResumeEvent]
        resumed_here: list[ResumeEvent]
        epoch_step: int
        _steps_before_batch: int
        _in_batch: bool
        _fit_params: Optional[dict]
        _in_fit: bool
        _event: Optional[tuple]
        _steps_per_call: int
        _epoch_steps: Optional[int]
        _batch_begin: int
        _call_steps: int
        _batch_lock: threading.Lock
        _skip: Optional[_Skip]
        _stream: Optional[Iterator]
        _stream_read: int
        _epoch_open: bool
        _first_call: bool
        _stream_base: int
        _keras_base: int
        _next_stream_base: int
        _next_keras_base: int
        _batches_read: Any
        _fetched: int
        _samples_before_epoch: float
        _samples_at_epoch_start: float
        _epoch_samples_counted: bool
        _updates_offset: Optional[int]
        _input_wait: Any
        _timing_asked: bool
        _wrapper: Optional[Callable]
        _inner: Optional[Callable]
        _runs_keras_step: bool
        _twins: dict[tuple[int, bool], tuple[Callable, Callable]]
        _step_scope: Optional[Callable[[], ContextManager]]

        # TrainingRuntime's (core.py).
        @property
        def model(self) -> Any: ...

        def _take_train_function(self) -> Optional[Callable]: ...

        def _scoped(self, function: Callable, *args: Any) -> Any: ...

        def _train_batches(self, run: Callable, iterator: Iterator,
                           limit: int) -> tuple[Any, int]: ...

        def _put_back_train_function(self) -> None: ...

        def _account(self, read: int, trained: int) -> None: ...

        def _read_from(self, iterator: Iterator) -> None: ...

        # _RuntimeCounters' (here).
        @property
        def input_wait_variable(self) -> Any: ...

        # ResumeSkipping's (skipping.py).
        def _skip_then_train(self, iterator: Iterator, run: Callable
                             ) -> tuple[Any, int, int]: ...

        def _short_data_message(self, skip: _Skip, what: str) -> str: ...

        # The backend's TrainFunctionWrapper's.
        def _install(self) -> None: ...

        def _uninstall(self) -> None: ...

        def _check_support(self) -> None: ...

        @staticmethod
        def _new_input_wait() -> Any: ...

        @staticmethod
        def _next_batch(iterator: Iterator) -> Any: ...

        def _batch_samples(self, element: Any) -> int: ...

        def _sync_state(self) -> None: ...

    _Host = _Runtime
else:
    _Host = object


class _RuntimeCounters(_Host):
    """`TrainingRuntime`'s counters: reading them, saving and restoring them."""

    @property
    def completed_steps(self) -> int:
        """Train batches finished (the global step minus a batch in progress)."""
        return self._steps_before_batch if self._in_batch else self.global_step

    def time_input(self):
        """Asks for input timing (from the next batch on); returns what holds
        this process's seconds waited for input (`input_wait_variable`)."""
        self._timing_asked = True
        return self.input_wait_variable

    @property
    def input_wait_variable(self):
        """This process's seconds waited for input: a float64 variable the
        compiled step adds to on TensorFlow, a host counter on JAX (whose
        `fit` fetches batches on the host); `np.asarray` reads either."""
        if self._input_wait is None:
            self._input_wait = self._new_input_wait()
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
            self._sync_state()
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
            attempted = self._plain_updates()
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

    def _plain_updates(self) -> int:
        """The updates a model without accumulation windows attempted: one
        per batch, or per `gradient_accumulation_steps` batches with
        Keras's own accumulation."""
        optimizer = getattr(self.model, "optimizer", None)
        steps = getattr(optimizer, "gradient_accumulation_steps", None) or 1
        return self.completed_steps // int(steps)

    def update_counts(self) -> tuple:
        """(attempted, applied) optimizer updates so far; two scalar reads.
        Applied is None without an optimizer."""
        self._sync_state()
        model = self.model
        optimizer = getattr(model, "optimizer", None)
        # A plain model attempts one update per batch; an accumulating one
        # counts its windows.
        attempted = getattr(model, "update_count", None)
        if attempted is None:
            attempted = self._plain_updates()
        if optimizer is None:
            return attempted, None
        # Not `.numpy()`: with Keras's own `gradient_accumulation_steps`,
        # `iterations` is a computed value (a plain array on JAX).
        return attempted, int(keras.ops.convert_to_numpy(optimizer.iterations))

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
                strategy_lib.of_model(self.model)),
            "resumes": [dataclasses.asdict(e) for e in self.resumes],
        }

    @property
    def skipping(self) -> bool:
        """Whether a resume still has batches to skip: until they are read,
        this run's data or batch size may refuse it (a `ValueError` from
        `fit`)."""
        return self._skip is not None

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
            replicas=strategy_lib.num_replicas(
                strategy_lib.of_model(self.model)),
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

    def _count_epoch_samples(self) -> None:
        if self._epoch_samples_counted:
            return
        self._epoch_samples_counted = True
        self._sync_state()
        seen = compat.examples_seen(self.model)
        if seen is not None:
            self._samples_before_epoch += seen


def _int(value) -> Optional[int]:
    return None if value is None else int(value)


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
