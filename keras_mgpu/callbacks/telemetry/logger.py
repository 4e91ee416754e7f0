"""`DistributedLogger`: chief-only training telemetry for distributed `fit`."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib.util
import os
import sys
import threading
import time
import warnings
import weakref
from typing import Optional, Union

import keras
import numpy as np
import tensorflow as tf

from keras_mgpu import compat
from keras_mgpu._checks import is_nonempty_path, is_positive_int, is_url
from keras_mgpu import strategy as strategy_lib
from keras_mgpu.callbacks._console import print_msg as _print_msg
from keras_mgpu.callbacks._sinks import Sinks
from keras_mgpu.callbacks.backup_and_restore import _inside_fit
from keras_mgpu.runtime import training_runtime

# Every JSONL line has exactly these keys, in this order; a value that cannot
# be measured in this run is `null`.
JSONL_KEYS = (
    "kind",  # "window" (every `update_freq` steps), "epoch" or "resume"
    "epoch",  # 0-based epoch index, as Keras's callbacks get it
    "step",  # the run's global step (train batches, across resumes)
    "steps",  # batches trained in the record
    "resumed_after",  # epoch records of an epoch a resume began inside: the
    #                   batches of it the interrupted run had trained (not
    #                   counted in `steps`, `seconds`, `examples`); else null
    "time",  # Unix time when the record closed
    "seconds",  # wall time of the record: first batch begin to last batch done
    "examples",  # samples trained on in the record, all replicas and workers
    "examples_per_sec",  # examples / seconds
    "examples_per_sec_per_replica",  # examples_per_sec / replicas
    "step_time_mean",  # seconds / steps
    "step_time_max",  # longest batch-begin to next-batch-begin interval
    "input_wait",  # share of `seconds` train steps spent blocked on input
    "input_bound",  # "no" (<= 5%), "moderately", "highly" (> 20%)
    "learning_rate",  # the optimizer's, schedules evaluated at its iterations
    "loss_scale",  # LossScaleOptimizer's dynamic scale, else null
    "skipped_steps",  # optimizer steps skipped for overflow in the record
    "grad_norm",  # GradientAccumulationModel's last applied gradient norm
    "accum_step",  # GradientAccumulationModel's micro-batches in its window
    "memory",  # {"GPU0": {"current_bytes", "peak_bytes"}}; {} without GPUs
    "workers",  # training worker processes
    "replicas",  # replicas in sync, over all workers
    "worker_step_time",  # {"min", "mean", "max"} of step_time_mean by worker
    "worker_examples_per_sec",  # {"min", "mean", "max"} by worker
    "worker_input_wait",  # {"min", "mean", "max"} of input_wait by worker
    "slowest_worker",  # rank with the largest step_time_mean
    "metrics",  # loss and compiled metrics, global values (val_* at epochs)
    "resume",  # resume records: {"generation", "step", "saved_replicas",
    #            "replicas", "text"}; else null
)

_INSTALL_HINT = 'pip install "keras-mgpu[wandb]"'


class LogDirInUse(RuntimeError):
    """Another `DistributedLogger`'s `fit` is writing the `log_dir`."""


@dataclasses.dataclass
class _Span:
    """A window or an epoch being measured: where it started, what it ran."""

    start: Optional[dict] = None  # counters when its first batch began
    began: Optional[float] = None  # perf_counter at its first batch begin
    steps: int = 0  # batches trained, as predicted at each batch begin
    step_max: float = 0.0  # longest batch interval
    untimed: bool = False  # a batch ran without input timing
    examples: float = 0.0  # samples counted batch by batch (hand loops)

    def add(self, steps: int, start: dict, now: float, timed: bool) -> None:
        if self.began is None:
            self.start, self.began = start, now
        self.steps += steps
        self.untimed = self.untimed or not timed


class DistributedLogger(keras.callbacks.Callback):
    """Logs throughput, timing and training state, written by the chief only.

    Every `update_freq` train batches (a "window") and at every epoch end,
    it measures:
    - loss and compiled metrics, global over replicas and workers (the
      values Keras's own logs give at that batch);
    - examples/s, global and per replica, from the samples actually trained
      on (steps skipped for overflow still count as work);
    - step time: mean (window wall time / steps) and max;
    - input wait: the share of the record's wall time the train steps spent
      blocked fetching their batches, flagged (`input_bound`) above 5%
      ("moderately") and 20% ("highly"), the thresholds of xprof's
      input-pipeline analysis;
    - learning rate (through `LossScaleOptimizer` and schedules), loss scale
      and skipped steps under `mixed_float16`, current and peak memory per
      local GPU (peak reset every record), and `grad_norm` / `accum_step` of
      a `keras_mgpu.GradientAccumulationModel`;
    - across workers: min/mean/max of step time and examples/s, and the rank
      of the slowest worker.

    Only the chief writes: TensorBoard events, one JSON object per record in
    `<log_dir>/metrics.jsonl` (keys: `JSONL_KEYS`), a wandb run and profiler
    traces. Other workers create nothing, but run the same reads at the same
    batches, since reading global metrics and the cross-worker figures are
    collectives that every worker must join.

    TensorBoard gets Keras `TensorBoard`'s layout, so its curves overlay
    and existing dashboards keep working:
    - `<log_dir>/train`: `epoch_loss`, `epoch_<metric>`,
      `epoch_learning_rate` and `epoch_steps_per_second` at step = epoch;
      from each window, `batch_loss`, `batch_<metric>` and
      `batch_steps_per_second` at the global step;
    - `<log_dir>/validation`: `epoch_loss`, `epoch_<metric>` (without
      `val_`) at step = epoch, and `evaluation_<metric>_vs_iterations` at
      the global step;
    - the telemetry, in the `train` run, in groups: `throughput/`, `input/`,
      `distribution/` (more than one worker), `mixed_precision/` (with a
      loss scale), `accumulation/` (`GradientAccumulationModel`) and
      `memory/` (with GPUs), each tag `<group>/epoch_<name>` or
      `<group>/batch_<name>`. A figure the run does not have is not written
      (no loss scale without one), nor are constants (`workers`,
      `replicas`); wandb gets the same tags as `<run>/<tag>`;
    - `tf.summary` calls in the model's train step land in the `train`
      run at the last batch of each window, at its global step (none with
      `update_freq="epoch"`, as in Keras, nor with `jit_compile=True`,
      which cannot compile them; validation's are not recorded). The
      compiled step keeps the writer it was traced with, as with Keras's
      `TensorBoard`: the logger of the model's first fit with one records
      them, in all its fits; another logger records them once the model is
      compiled again;
    - `resume`: text at each resume.

    Cost: nothing is read from the device between records. The callback
    only hooks batch *begin*, so Keras does not convert per-batch logs for
    it and may dispatch other callbacks' batch ends asynchronously. A record
    closes at the next batch's begin (or at validation/epoch end): it reads
    the metrics, which waits for the device, then stamps the time.

    Durability: a local JSONL file gets each record's line as the record
    closes, written and flushed to the operating system by the training
    thread (microseconds, no sync), so a killed process (SIGKILL included)
    keeps every record closed before it died, whatever TensorBoard or wandb
    were doing. TensorBoard and wandb (and a URL's JSONL) are written by a
    background thread, in order: a kill loses what it had not written yet.
    Everything is on disk when `fit` returns. When `fit` raises instead,
    the thread still writes and flushes every record queued before the
    error, then stops; fitting again with the same logger appends to the
    same files, and a torn last line (a process killed mid-write) is
    closed off by the next run.

    One writer per `log_dir`: while a logger's `fit` runs, another logger's
    `fit` on the same `log_dir` raises `LogDirInUse` before training (in
    this process, or in another one on this machine for a local
    `log_dir`), rather than interleave their records. One after the other
    is fine: a resumed run continues the file.

    Records are stamped with the run's global step, kept by the training
    runtime this callback shares with `BackupAndRestore` and
    `LossScaleMonitor` (`keras_mgpu.runtime`): it continues across `fit`
    calls and across a resume, so a resumed run's curves continue the
    interrupted one's instead of overwriting them. Windows are aligned to
    multiples of `update_freq` batches within the epoch; batches a resume
    skips are not logged, and a window with nothing trained is not written.
    Each resume writes a `"resume"` record ("resumed from generation N at
    step S") and the same text to TensorBoard's `resume` tag.

    Examples are counted from Keras's loss tracker, which `fit` feeds with
    each batch's real size (the last short batch included). Where nothing
    feeds it (a custom `train_step` that does not, a `GradientTape` loop),
    a record's `examples` is `null`; give `batch_size` to count them.

    Works in a hand-written loop that drives its callbacks through
    `keras.callbacks.CallbackList`, with or without `compile`: there is no
    compiled step to read, so a window's metrics are the `logs` the loop
    passes to `on_train_batch_end` at the window's last batch (what Keras's
    `TensorBoard` logs), and examples are counted batch by batch, from the
    loss tracker as `train_on_batch` leaves it (what each call added to
    it: Keras 3.15 resets it at every call, older releases do not).

    Input wait is timed inside the train function: `fit` fetches each batch
    in its compiled step, where no host clock can see it, so the runtime
    retraces Keras's own step with the fetch bracketed by `tf.timestamp`
    ops that add its duration to a variable (read with the metrics). The
    training math is unchanged. Without Keras's compiled train function
    (`run_eagerly=True`, or batches another callback stands in for) a
    record's `input_wait` is `null`; so in a hand-written loop. A multi-worker record gives the mean
    over workers, flagged (`input_bound`) from that mean; each worker's is
    in `worker_input_wait`.

    Args:
        log_dir: Directory for all output (created on the chief only): a
            local path, or a URL that `tf.io.gfile` can write (`gs://...`,
            `ram://...`). A URL's JSONL file is flushed as the events
            file is: at most every second, after every epoch record and
            when writing pauses (on object stores a flush uploads the file).
        update_freq: Defaults to 100. Train batches per window record, a
            positive integer, or `"epoch"` for epoch records only. Windows
            restart at every epoch; the last one of an epoch may be shorter.
        batch_size: Defaults to `None`: count samples from the loss tracker.
            A global batch size (all replicas and workers) to count
            `batch_size * steps` instead.
        wandb: Defaults to `None` (no wandb). `True`, or a dict of
            `wandb.init` arguments (e.g. `{"project": "demo"}`), to log every
            record to a wandb run on the chief; `dir` defaults to `log_dir`
            (wandb writes locally: for a URL `log_dir`, to `WANDB_DIR`, else
            the working directory).
            Respects `WANDB_MODE=offline`. Needs `pip install
            "keras-mgpu[wandb]"`.
        profile_steps: Defaults to `None`. `(start, stop)`: capture a
            TensorBoard/xprof profile on the chief from train batch `start`
            to batch `stop`, both included, counted from 1 over the whole
            training, into `<log_dir>/train/plugins/profile/`. Each batch is
            marked as a step, so xprof's overview shows step times.
        console: Defaults to `True`. Print a one-line summary per epoch on
            the chief (after Keras's progress bar has finished its line);
            `True` or `False`. Epochs are counted from 1 there, as Keras's
            progress bar counts them; the records' `epoch` is 0-based, as
            Keras's callbacks and its `TensorBoard` number epochs. An epoch
            a resume began inside says so: "epoch 3 (resumed after batch
            20: 3 batches trained here)", its figures over those batches.

    Example:

    >>> import json, os, tempfile, numpy as np, keras
    >>> from keras_mgpu.callbacks.distributed_logger import (
    ...     DistributedLogger, JSONL_KEYS)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> log_dir = tempfile.mkdtemp()
    >>> _ = model.fit(np.ones((64, 4)), np.ones((64, 1)), batch_size=8,
    ...               verbose=0, callbacks=[DistributedLogger(
    ...                   log_dir, update_freq=4, console=False)])
    >>> with open(os.path.join(log_dir, "metrics.jsonl")) as f:
    ...     records = [json.loads(line) for line in f]
    >>> [(r["kind"], r["steps"], r["examples"]) for r in records]
    [('window', 4, 32.0), ('window', 4, 32.0), ('epoch', 8, 64.0)]
    >>> tuple(records[0]) == JSONL_KEYS
    True
    """

    def __init__(
        self,
        log_dir: Union[str, os.PathLike],
        update_freq: Union[int, str] = 100,
        *,
        batch_size: Optional[int] = None,
        wandb: Union[None, bool, dict] = None,
        profile_steps: Optional[tuple[int, int]] = None,
        console: bool = True,
    ):
        super().__init__()
        _validate(log_dir, update_freq, batch_size, wandb, profile_steps,
                  console)
        self.log_dir = os.fspath(log_dir)
        self.update_freq = update_freq
        self.batch_size = batch_size
        self.wandb_config = None if wandb in (None, False) else (
            {} if wandb is True else dict(wandb)
        )
        self.profile_steps = (
            None if profile_steps is None else tuple(profile_steps)
        )
        self.console = console
        self._runtime = None
        self._sinks = None
        self._sinks_closer = None
        self._reader = None  # (what it reads, the compiled read)
        self._profiling = False
        self._step_trace = None
        self._summary_step = None  # the chief's step for the model's summaries
        self._summary_ops = [False]  # whether a traced step had any
        self._summaries = False
        self._pending_console = None
        self._logged_resumes = set()
        self._hand_loop = False  # driven by a hand-written loop, not `fit`
        self._epoch = 0
        self._last_batch = 0
        self._given = None  # (epoch, batch, logs) of a hand loop's batch end
        self._counting = False  # a hand-loop batch whose samples are unread
        self._seen_before = 0.0
        self._tracker_resets = True

    def __deepcopy__(self, memo):
        # A copy (KerasTuner copies callbacks for every trial) is a new
        # logger with the same arguments: open files and threads stay here.
        return type(self)(
            self.log_dir, self.update_freq, batch_size=self.batch_size,
            wandb=self.wandb_config, profile_steps=self.profile_steps,
            console=self.console)

    @property
    def global_step(self) -> int:
        """The run's global step (train batches, continuing across resumes)."""
        return 0 if self._runtime is None else self._runtime.global_step

    # --- Keras hooks ---------------------------------------------------------

    def on_train_begin(self, logs=None):
        compat.check_summary_support()
        self._runtime = training_runtime(self.model)
        self._runtime.train_begin(self)
        # `fit` reads Keras's compiled step; a hand-written loop (driving a
        # `CallbackList` itself, `train_on_batch` included) gives its values
        # in the logs of each batch end. Once per `fit`: a walk up the stack.
        self._hand_loop = not _inside_fit(sys._getframe(), self.model)
        self._given = None
        self._counting = False
        if self._hand_loop:
            self._tracker_resets = compat.train_on_batch_resets_metrics()
        self._runtime.time_input()
        self._strategy = self.model.distribute_strategy
        multi = strategy_lib.is_multi_worker(self._strategy)
        self._workers = strategy_lib.num_workers() if multi else 1
        self._replicas = strategy_lib.num_replicas(self._strategy)
        self._chief = strategy_lib.is_chief()
        self._in_epoch = False
        self._num_gpus = len(tf.config.list_logical_devices("GPU"))
        self._freq = (
            float("inf") if self.update_freq == "epoch" else self.update_freq
        )
        self._profile = self.profile_steps is not None and self._chief
        # Read at the first trained batch (after any resume). The reader is
        # traced at the first record (the metrics exist by then), and kept
        # for the next `fit` while it would read the same objects.
        self._last = None
        self._reader_checked = False
        _memory(self._num_gpus, reset=True)
        # A `fit` that raised never reached `on_train_end`: its profile is
        # stopped here, and its sinks (whose writer has stopped by itself)
        # take this fit's records after the ones it wrote.
        self._stop_profiler()
        self._leave_summary_scope()
        if self._chief:
            # Before the outputs are opened: opening closes off a torn line,
            # which must not happen under a live writer.
            _claim_log_dir(self)
        if self._chief and self._sinks is None:
            self._sinks = Sinks(self.log_dir, self.wandb_config)
            if self.wandb_config is None:
                # Kept across `fit` calls (files, writers, the compiled event
                # writer): a short fit costs no more than a record. Closed
                # when the logger is dropped, or at exit.
                self._sinks_closer = weakref.finalize(
                    self, _close_when_collected, self._sinks)
        # XLA cannot compile summary ops: a jit-compiled step records none
        # (Keras's `TensorBoard` decides at trace time, and records none).
        if (self._chief and self.update_freq != "epoch"
                and not getattr(self.model, "jit_compile", False)):
            self._enter_summary_scope()

    def on_epoch_begin(self, epoch, logs=None):
        self._runtime.epoch_begin(epoch)
        self._flush_console()
        self._log_resumes()
        self._epoch = epoch
        self._in_epoch = True
        self._epoch_record = None
        self._epoch_span = _Span()
        self._window = _Span()
        self._window_id = None
        self._last_begin = None
        self._epoch_first_step = None  # global step before its first trained

    def on_train_batch_begin(self, batch, logs=None):
        # The hot path: a clock read, comparisons and counters. Everything
        # else waits for the window to close.
        now = time.perf_counter()
        runtime = self._runtime
        runtime.train_batch_begin(batch)
        if not runtime.batch_trains:
            return  # replayed by a resume: nothing trained, nothing logged
        last = self._last_begin
        if last is not None and now - last > self._window.step_max:
            self._window.step_max = now - last
        self._count_hand_batch()
        # Windows are aligned to multiples of `update_freq` batches in the
        # epoch, so a resumed run's records fall where the original's did.
        window_id = batch // self._freq
        if window_id != self._window_id:
            if self._window.steps:
                now = self._close_window(final=False)
            self._window_id = window_id
        if self._last is None:
            self._last = self._snapshot(runtime.counters())
        if self._summaries:
            self._record_summaries(
                (batch + 1) % self._freq == 0
                or batch + 1 == (self.params or {}).get("steps"))
        steps = runtime.global_step - runtime.completed_steps
        timed = runtime.input_timed
        self._last_batch = batch
        self._counting = self._hand_loop
        if self._hand_loop and not self._tracker_resets:
            # The tracker runs on across calls: this batch is what it adds.
            self._seen_before = compat.examples_seen(self.model) or 0.0
        if self._epoch_first_step is None:
            self._epoch_first_step = runtime.completed_steps
        self._window.add(steps, self._last, now, timed)
        self._epoch_span.add(steps, self._last, now, timed)
        if self._profile:
            self._update_profiler()
            if self._profiling:
                now = time.perf_counter()
        self._last_begin = now

    def on_train_batch_end(self, batch, logs=None):
        # In `fit`, nothing: a record reads the compiled step. Keras calls
        # batch ends in order, before the next batch begins (on TensorFlow
        # it never dispatches them to another thread).
        if self._hand_loop:
            self._given = (self._epoch, batch, _floats(logs or {}))

    def on_test_begin(self, logs=None):
        # Validation runs after the epoch's last batch and before
        # `on_epoch_end`: close the training figures before it starts (and
        # before `evaluate` resets the metrics).
        self._count_hand_batch()
        self._runtime.test_begin()
        self._end_step_trace()
        if self._in_epoch and self._epoch_record is None:
            self._finish_epoch()
        self._record_summaries(False)
        if self._in_epoch and self._sinks is not None:
            self._sinks.run_writer("validation")  # on this thread: see there

    def on_epoch_end(self, epoch, logs=None):
        self._count_hand_batch()
        self._runtime.epoch_end(epoch)
        self._end_step_trace()
        self._record_summaries(False)
        if self._epoch_record is None:
            self._finish_epoch()
        self._in_epoch = False
        record = self._epoch_record
        if record is None:
            return
        record["metrics"] = _floats(logs or {})
        if self._chief:
            self._submit(record)
            if self.console:
                self._pending_console = _console_line(record)
            if not _shows_progress_bar(self.params):
                self._flush_console()

    def on_train_end(self, logs=None):
        self._runtime.train_end()
        self._stop_profiler()
        self._leave_summary_scope()
        self._flush_console()
        if self._sinks is None:
            return
        try:
            if self.wandb_config is None:
                try:
                    self._sinks.drain()  # everything on disk when `fit` returns
                except RuntimeError:
                    self._close_sinks()
                    raise
            else:
                # One wandb run per `fit`, finished with it.
                self._close_sinks()
        finally:
            _release_log_dir(self)

    # --- Records -------------------------------------------------------------

    def _submit(self, record: dict) -> None:
        try:
            self._sinks.submit(record)
        except RuntimeError:
            # A write failed: training stops here, so close the outputs now
            # (the wandb run finished, the files closed) rather than leave
            # them open. Only the first failure is raised.
            with contextlib.suppress(Exception):
                self._close_sinks()
            raise

    def _count_hand_batch(self) -> None:
        """Adds the samples of the hand-loop batch just trained to its
        window and epoch: what it added to Keras's loss tracker (which
        `train_on_batch` resets at every call on Keras 3.15, not before).
        Nothing for a step that does not feed it (a `GradientTape` step)."""
        if not self._counting:
            return
        self._counting = False
        seen = compat.examples_seen(self.model)
        if seen and not self._tracker_resets:
            seen -= self._seen_before
        if seen:
            self._window.examples += seen
            self._epoch_span.examples += seen

    def _hand_loop_metrics(self, read: dict, window: _Span) -> dict:
        """A hand-written loop's window metrics: the logs it gave at the
        window's last batch end, as Keras's `TensorBoard` logs them. Without
        them, the model's metrics where its steps fed them
        (`train_on_batch`), else none (a `GradientTape` step leaves them at
        0, which is not a loss)."""
        given = self._given
        if given and given[:2] == (self._epoch, self._last_batch) and given[2]:
            return given[2]
        return read if window.examples else {}

    def _close_sinks(self) -> None:
        sinks, self._sinks = self._sinks, None
        closer, self._sinks_closer = self._sinks_closer, None
        if closer is not None:
            closer.detach()
        sinks.close()

    def _log_resumes(self):
        for event in self._runtime.resumed_here:
            if event in self._logged_resumes:
                continue
            self._logged_resumes.add(event)
            text = event.describe()
            if self._chief:
                self._submit(_record(
                    "resume", event.epoch, event.step, {}, {}, None,
                    resume={**dataclasses.asdict(event), "text": text}))
                if self.console:
                    self._print_console(f"DistributedLogger: {text}.")

    def _finish_epoch(self):
        if self._epoch_span.steps == 0:
            self._epoch_record = None
            return
        self._close_window(final=True)

    def _close_window(self, final: bool) -> float:
        """Reads, aggregates and writes a window; returns when it ended."""
        # Reading the metrics waits for the device, so the time stamped after
        # it includes all the window's work.
        read = self._read()
        counters = read["counters"]
        state = self._snapshot(counters)
        end = time.perf_counter()
        window = self._window
        if self._last_begin is not None:
            window.step_max = max(window.step_max, end - self._last_begin)
            self._last_begin = None
        self._epoch_span.step_max = max(self._epoch_span.step_max,
                                        window.step_max)
        spans = [window] + ([self._epoch_span] if final else [])
        measured = [self._measure(span, state, end) for span in spans]
        rows = [_worker_row(m) for m in measured]
        gathered = self._gather(np.concatenate(rows))
        width = rows[0].size
        for i, m in enumerate(measured):
            m.update(_across_workers(gathered[:, i * width:(i + 1) * width]))
        common = self._shared_fields(read, counters)
        # A window of only the call that found the end of the data trained
        # nothing: no record.
        if (self.update_freq != "epoch" and self._chief
                and measured[0]["steps"]):
            metrics = read["metrics"]
            if self._hand_loop:
                metrics = self._hand_loop_metrics(metrics, window)
            self._submit(_record("window", self._epoch,
                                 counters.global_step, measured[0],
                                 common, metrics))
        if final:
            measured[1]["resumed_after"] = self._resumed_after()
            self._epoch_record = _record("epoch", self._epoch,
                                         counters.global_step, measured[1],
                                         common, {})
        self._last = state
        self._window = _Span()
        return time.perf_counter()

    def _resumed_after(self) -> Optional[int]:
        """The batches of this epoch a resume skipped (the interrupted run
        trained them), or None where the epoch did not resume inside."""
        runtime = self._runtime
        if not any(event.epoch == self._epoch
                   for event in runtime.resumed_here):
            return None
        # Read from the data (trained or skipped) minus trained here, as the
        # runtime counted them (a call that found the data's end trained
        # nothing).
        trained = runtime.completed_steps - self._epoch_first_step
        skipped = runtime.epoch_step - trained
        return skipped if skipped > 0 else None

    @staticmethod
    def _snapshot(counters) -> dict:
        return {
            "step": counters.global_step,
            "samples": counters.samples_seen,
            "skipped": counters.updates_skipped,
            "input_wait": counters.input_wait_seconds,
        }

    def _measure(self, span: _Span, state: dict, end: float) -> dict:
        seconds = max(end - span.began, 1e-9)
        start = span.start
        # What the runtime counted once the span's calls returned: a batch
        # begin predicts a call's batches, and the call that finds the end
        # of data of unknown length trains fewer (none) than predicted.
        steps = state["step"] - start["step"]
        if self.batch_size is not None:
            examples = float(self.batch_size * steps)
        elif self._hand_loop:
            examples = span.examples
        elif state["samples"] is not None:
            examples = state["samples"] - start["samples"]
        else:
            examples = None
        if not examples:
            # Batches trained that Keras's loss tracker never saw (a
            # hand-written loop): unknown, not zero.
            examples = None
        per_sec = None if examples is None else examples / seconds
        loss_scaled = isinstance(getattr(self.model, "optimizer", None),
                                 keras.optimizers.LossScaleOptimizer)
        return {
            "steps": steps,
            "seconds": seconds,
            "examples": examples,
            "examples_per_sec": per_sec,
            "examples_per_sec_per_replica": (
                None if per_sec is None else per_sec / self._replicas
            ),
            "step_time_mean": seconds / steps if steps else None,
            "step_time_max": span.step_max,
            "input_wait": None if span.untimed else min(
                (state["input_wait"] - start["input_wait"]) / seconds, 1.0),
            "skipped_steps": (state["skipped"] - start["skipped"]
                              if loss_scaled else None),
        }

    def _read(self) -> dict:
        """Everything a record reads from the device, in one compiled call.

        Metrics, the runtime's counters, learning rate, loss scale and the
        accumulation state come back from one cached `tf.function` (one
        dispatch, one wait for the device) instead of a dozen eager reads.
        Reading the replica-summed metrics is a collective under
        MultiWorkerMirroredStrategy: every worker calls this at the same
        record boundaries.
        """
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            # A hand-written loop that has not stepped the optimizer yet:
            # read eagerly, its variables may not exist.
            raw = _read_values(self.model, self._runtime)
        else:
            if not self._reader_checked:
                # Once per fit (the key walks the model's metrics). The
                # concrete function holds what it reads, so the ids in the
                # key stay theirs while it lives.
                self._reader_checked = True
                key = _reader_key(self.model, self._runtime)
                if self._reader is None or self._reader[0] != key:
                    self._reader = (key, tf.function(
                        lambda: _read_values(self.model, self._runtime),
                        autograph=False).get_concrete_function())
            raw = self._reader[1]()
        values = {k: None if v is None else np.asarray(v)
                  for k, v in raw["counters"].items()}
        return {
            "metrics": _floats(raw["metrics"]),
            "counters": self._runtime.counters(values),
            "grad_norm": _scalar(raw["grad_norm"], float),
            "learning_rate": _scalar(raw["learning_rate"], float),
            "loss_scale": _scalar(raw["loss_scale"], float),
        }

    def _shared_fields(self, read, counters) -> dict:
        return {
            "learning_rate": read["learning_rate"],
            "loss_scale": read["loss_scale"],
            "grad_norm": read["grad_norm"],
            "accum_step": counters.micro_step,
            "memory": _memory(self._num_gpus, reset=True),
            "workers": self._workers,
            "replicas": self._replicas,
        }

    def _gather(self, row: np.ndarray) -> np.ndarray:
        """One row per worker, from every worker (a collective when > 1)."""
        if self._workers == 1:
            return row[None]
        value = tf.constant(row[None], tf.float32)
        distributed = self._strategy.experimental_distribute_values_from_function(
            lambda _: tf.identity(value)
        )
        gathered = np.asarray(self._strategy.gather(distributed, axis=0))
        # One row per replica, replicas numbered worker by worker.
        return gathered.reshape(self._workers, -1, row.size)[:, 0]

    def _flush_console(self):
        """Prints the pending epoch line.

        Keras's progress bar (`ProgbarLogger`, after this callback in `fit`'s
        list) ends its epoch line in its own `on_epoch_end`, which runs after
        this callback's: with a progress bar (`verbose` 1, 2 or "auto"; the
        default "auto" is 1) the epoch line waits for the next epoch's begin
        or the end of training, where Keras's line is complete, so it never
        lands inside the bar's line nor before Keras's own epoch summary.
        """
        if self._pending_console is not None:
            line, self._pending_console = self._pending_console, None
            self._print_console(line)

    def _print_console(self, text: str) -> None:
        """Prints `text` on a line of its own, where Keras prints its own.

        Only called where no progress-bar line is open: at an epoch's or
        the training's begin or end (after the bar's last line, which ends
        in a newline), or at an epoch's end without a bar.
        """
        _print_msg(text)

    # --- The model's own summaries --------------------------------------------

    def _enter_summary_scope(self):
        """Routes `tf.summary` calls in the model's train step to the
        chief's `train` run, at the last batch of each window, at the
        window record's global step.

        The writer is the default only inside each train step (through the
        runtime, a few attribute writes a step), so nothing other callbacks
        write (a stock `TensorBoard`'s scalars, before, between and after
        steps) meets it or its condition. The step is a variable, not a
        Python number: the train function is compiled once, and a number
        would be frozen into it at trace time.
        """
        if self._summary_step is None:
            self._summary_step = strategy_lib.local_variable(-1, tf.int64)
        step = self._summary_step
        writer = self._sinks.run_writer("train")
        seen = self._summary_ops

        def recording():
            # Called once per summary op while the step is traced (at every
            # write in an eager step): a model without any is never
            # recorded, and its step variable is never assigned. Kept across
            # fits: a later fit reuses the traced step.
            seen[0] = True
            return step >= 0

        self._summaries = True
        self._summary_at = -1
        self._summary_windows = 0
        self._runtime.scope_steps(
            lambda: compat.summary_scope(writer, step, recording))

    def _record_summaries(self, on: bool) -> None:
        if not self._summaries:
            return
        at = self.global_step if on else -1
        if at == self._summary_at:
            return
        if on:
            self._summary_windows += 1
        # The assign waits for the step in flight, which reads the variable:
        # only where the traced step has summary ops, and in a fit's first
        # window (the step may not be traced yet).
        if self._summary_ops[0] or self._summary_windows <= 1:
            self._summary_step.assign(at)
            self._summary_at = at

    def _leave_summary_scope(self):
        """Stops recording the model's summaries (at train end, or at the
        next train begin after a `fit` that raised)."""
        if self._summaries:
            self._record_summaries(False)
            self._runtime.scope_steps(None)
            self._summaries = False

    # --- Profiler ------------------------------------------------------------

    def _update_profiler(self):
        if self.profile_steps is None or not self._chief:
            return
        step = self.global_step
        start, stop = self.profile_steps
        if self._profiling and step > stop:
            self._stop_profiler()
        if not self._profiling and start <= step <= stop:
            try:
                tf.profiler.experimental.start(
                    tf.io.gfile.join(self.log_dir, "train")
                )
                self._profiling = True
                # Nothing of the logger's own in the profile: its background
                # writes (the first traces the event writer) can hide
                # xprof's step markers. JSONL lines are still written.
                self._sinks.hold()
            except tf.errors.AlreadyExistsError:
                warnings.warn(
                    "DistributedLogger: another profiler is running; "
                    f"profile_steps={self.profile_steps} is not captured.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self.profile_steps = None
        self._end_step_trace()
        if self._profiling:
            # A root trace event (`_r=1`) with the step number is xprof's
            # step marker: without it the overview shows no step time.
            # Keras's own batch trace has no `_r` and is not recognised.
            self._step_trace = tf.profiler.experimental.Trace(
                "train", step_num=step, _r=1)
            self._step_trace.__enter__()

    def _end_step_trace(self):
        if self._step_trace is not None:
            trace, self._step_trace = self._step_trace, None
            trace.__exit__(None, None, None)

    def _stop_profiler(self):
        self._end_step_trace()
        if self._profiling:
            tf.profiler.experimental.stop()
            self._profiling = False
        if self._sinks is not None:
            self._sinks.release()


# --- One writer per log_dir ----------------------------------------------------

# The logger whose `fit` writes each log_dir in this process.
_CLAIMS = {}
_CLAIMS_LOCK = threading.Lock()


@dataclasses.dataclass
class _Claim:
    logger: weakref.ref
    thread: int  # the thread running its `fit`
    lock: Optional[object]  # a local metrics.jsonl, open and flock'ed

    def release(self) -> None:
        if self.lock is not None:
            self.lock.close()  # unlocks
            self.lock = None


def _claim_log_dir(logger) -> None:
    """Makes `logger` the one writer of its log_dir while its `fit` runs,
    or raises `LogDirInUse`.

    Two loggers writing one log_dir at once would interleave their records
    in one `metrics.jsonl` and write TensorBoard events at the same steps:
    refused, not separated, since the layout (`metrics.jsonl`, `train/`,
    `validation/`) is what readers and a resumed run rely on. One after the
    other is allowed: a resumed run continues the file. In this process a
    claim ends with its `fit`; a `fit` that raised (no `on_train_end`) ends
    it when its thread starts another `fit` or ends, or when its logger is
    dropped. Across processes, a local log_dir's `metrics.jsonl` is locked
    (`flock`, released by the system when the process dies, SIGKILL too);
    for a URL only this process is checked.
    """
    log_dir = logger.log_dir
    local = not is_url(log_dir)
    key = os.path.realpath(log_dir) if local else log_dir
    here = threading.get_ident()
    with _CLAIMS_LOCK:
        claim = _CLAIMS.get(key)
        if claim is not None:
            holder = claim.logger()
            if holder is logger:
                claim.thread = here
                return
            if (holder is not None and claim.thread != here
                    and any(t.ident == claim.thread
                            for t in threading.enumerate())):
                raise LogDirInUse(
                    f"DistributedLogger: log_dir {log_dir!r} is being "
                    f"written by another DistributedLogger's fit in this "
                    f"process (thread {claim.thread}). {_IN_USE_HINT}")
            claim.release()
            del _CLAIMS[key]
        lock = None
        if local:
            os.makedirs(log_dir, exist_ok=True)
            path = os.path.join(log_dir, "metrics.jsonl")
            lock = open(path, "a")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                raise LogDirInUse(
                    f"DistributedLogger: log_dir {log_dir!r} is being "
                    f"written by another process ({path} is locked; "
                    f"`fuser -v {path}` names it). {_IN_USE_HINT}") from None
        _CLAIMS[key] = _Claim(
            weakref.ref(logger, lambda _, key=key: _drop_claim(key)),
            here, lock)


_IN_USE_HINT = (
    "Two loggers writing one log_dir would interleave their records. Give "
    "this logger another log_dir, or start it once that fit has ended "
    "(continuing a run, e.g. after a resume, in the same log_dir is fine).")


def _drop_claim(key: str) -> None:
    """A claiming logger was dropped (its `fit` raised): unlock."""
    with _CLAIMS_LOCK:
        claim = _CLAIMS.get(key)
        if claim is not None and claim.logger() is None:
            claim.release()
            del _CLAIMS[key]


def _release_log_dir(logger) -> None:
    with _CLAIMS_LOCK:
        for key, claim in list(_CLAIMS.items()):
            if claim.logger() is logger:
                claim.release()
                del _CLAIMS[key]


# --- Helpers -----------------------------------------------------------------


def _validate(log_dir, update_freq, batch_size, wandb, profile_steps,
              console) -> None:
    if not isinstance(console, bool):
        raise TypeError(
            f"console must be True (print a line per epoch) or False, got "
            f"{console!r} (a non-empty string such as 'no' would count as "
            f"True)."
        )
    if not is_nonempty_path(log_dir):
        raise TypeError(
            f"log_dir must be a non-empty path, got {log_dir!r}."
        )
    if update_freq != "epoch" and not is_positive_int(update_freq):
        raise ValueError(
            f"update_freq must be a positive integer (train batches per "
            f"record) or 'epoch', got {update_freq!r}."
        )
    if batch_size is not None and not is_positive_int(batch_size):
        raise ValueError(
            f"batch_size must be a positive integer (the global batch size) "
            f"or None, got {batch_size!r}."
        )
    if wandb is not None and not isinstance(wandb, (bool, dict)):
        raise TypeError(
            f"wandb must be None, a bool or a dict of wandb.init arguments, "
            f"got {wandb!r}."
        )
    if wandb not in (None, False) and importlib.util.find_spec("wandb") is None:
        raise ImportError(
            f"DistributedLogger(wandb={wandb!r}) needs the wandb package, "
            f"which is not installed. Install it with: {_INSTALL_HINT}"
        )
    if profile_steps is not None:
        ok = (
            isinstance(profile_steps, (tuple, list))
            and len(profile_steps) == 2
            and all(
                isinstance(s, int) and not isinstance(s, bool)
                for s in profile_steps
            )
            and 1 <= profile_steps[0] <= profile_steps[1]
        )
        if not ok:
            raise ValueError(
                f"profile_steps must be a pair (start, stop) of batch numbers "
                f"with 1 <= start <= stop, got {profile_steps!r}."
            )


def _floats(values) -> dict:
    out = {}
    for key, value in dict(values).items():
        try:
            out[key] = float(np.asarray(value))
        except (TypeError, ValueError):
            continue
    return out


def _read_values(model, runtime) -> dict:
    """The tensors a record reads (traced into the logger's reader)."""
    optimizer = getattr(model, "optimizer", None)
    loss_scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    window = getattr(model, "window_variables", None) or {}

    def tensor(variable):
        return None if variable is None else tf.identity(
            keras.ops.convert_to_tensor(variable))

    return {
        "metrics": _metrics_result(model),
        "counters": {key: tensor(v)
                     for key, v in runtime.counter_variables().items()},
        "grad_norm": tensor(window.get("grad_norm")),
        "learning_rate": (
            None if optimizer is None else _learning_rate_tensor(optimizer)),
        "loss_scale": (
            tensor(optimizer.dynamic_scale) if loss_scaled else None),
    }


def _close_when_collected(sinks: Sinks) -> None:
    """Closes a dropped logger's outputs. Garbage collection can run this
    while the thread is tracing a function: `init_scope` runs the writers'
    flush and close now, not as ops of that function (where they would run
    later, against writers gone by then)."""
    with tf.init_scope():
        sinks.close()


def _reader_key(model, runtime) -> tuple:
    """What `_read_values` reads, by identity: a recompiled model (new
    optimizer or metrics) or a new runtime variable needs a new reader."""
    window = getattr(model, "window_variables", None) or {}
    return (
        id(model), id(getattr(model, "optimizer", None)),
        tuple(id(m) for m in getattr(model, "metrics", [])),
        tuple(id(v) for v in runtime.counter_variables().values()),
        id(window.get("grad_norm")),
    )


def _metrics_result(model) -> dict:
    """`model.get_metrics_result()` without the metrics nothing has updated
    yet (a hand-written loop), whose `result()` would raise."""
    out = {}
    for metric in getattr(model, "metrics", []):
        if not getattr(metric, "built", True):
            continue
        result = metric.result()
        if isinstance(result, dict):
            out.update(result)
        else:
            out[metric.name] = result
    return out


def _learning_rate_tensor(optimizer):
    try:
        # Through LossScaleOptimizer; a schedule is evaluated at the
        # optimizer's iterations.
        return tf.convert_to_tensor(optimizer.learning_rate)
    except (AttributeError, TypeError, ValueError):
        return None


def _scalar(value, kind):
    return None if value is None else kind(np.asarray(value))


def _memory(num_gpus: int, reset: bool) -> dict:
    """Current and peak bytes per local GPU; `{}` without GPUs."""
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


def _worker_row(measured: dict) -> np.ndarray:
    return np.array(
        [np.nan if measured[key] is None else measured[key]
         for key in ("step_time_mean", "examples_per_sec", "input_wait")],
        dtype=np.float64,
    )


def _input_bound(fraction: Optional[float]) -> Optional[str]:
    # xprof's input-pipeline analysis: "moderately" input-bound above 5% of
    # the step time waiting for input, "highly" above 20%.
    if fraction is None:
        return None
    if fraction > 0.20:
        return "highly"
    return "moderately" if fraction > 0.05 else "no"


def input_wait_summary(fraction: Optional[float]) -> str:
    """A record's `input_wait` as the logger prints it: percent and label.

    The label is the record's `input_bound`: above 5% of the step time
    "moderately", above 20% "highly" input-bound (xprof's thresholds),
    decided from the same number that is printed (over several workers,
    their mean).

    Args:
        fraction: A record's `input_wait` (0 to 1), or `None` where it was
            not measured.

    Example:

    >>> input_wait_summary(0.156)
    '15.6% of step time (moderately input-bound)'
    >>> input_wait_summary(None)
    'n/a'
    """
    if fraction is None:
        return "n/a"
    bound = _input_bound(fraction)
    return (f"{100 * fraction:.1f}% of step time "
            f"({'not' if bound == 'no' else bound} input-bound)")


def _across_workers(rows: np.ndarray) -> dict:
    step_time, per_sec, waited = rows[:, 0], rows[:, 1], rows[:, 2]

    def spread(values):
        if np.isnan(values).any():
            return None
        return {"min": float(values.min()), "mean": float(values.mean()),
                "max": float(values.max())}

    return {
        "worker_step_time": spread(step_time),
        # Every worker's examples/s is the global figure measured over its
        # own clock, divided by the number of workers.
        "worker_examples_per_sec": spread(per_sec / len(rows)),
        "worker_input_wait": spread(waited),
        "input_wait": (
            None if np.isnan(waited).any() else float(waited.mean())
        ),
        # From the mean, the figure reported beside it: one rule for every
        # record. The most input-bound worker is in worker_input_wait.
        "input_bound": (
            None if np.isnan(waited).any() else _input_bound(
                float(waited.mean()))
        ),
        "slowest_worker": int(np.argmax(step_time)),
    }


def _record(kind, epoch, step, measured, common, metrics, resume=None) -> dict:
    values = {**measured, **common, "kind": kind, "epoch": epoch,
              "step": step, "time": time.time(), "metrics": metrics,
              "resume": resume}
    return {key: values.get(key) for key in JSONL_KEYS}


def _shows_progress_bar(params) -> bool:
    """Whether `fit` (or a `CallbackList` with `add_progbar=True`) shows
    Keras's progress bar: `verbose` 1, 2 or "auto" in the callback params."""
    return bool((params or {}).get("verbose", 0))


def _console_line(record: dict) -> str:
    # 1-based, as Keras's progress bar counts epochs ("Epoch 3/12").
    head = f"DistributedLogger epoch {record['epoch'] + 1}"
    if record["resumed_after"]:
        # The interrupted run trained the epoch's first batches: the figures
        # are this run's, over the batches it trained.
        head += (f" (resumed after batch {record['resumed_after']}: "
                 f"{_batches(record['steps'])} trained here)")
    parts = [head + ":"]
    loss = record["metrics"].get("loss")
    if loss is not None:
        parts.append(f"loss {loss:.4g},")
    if record["examples_per_sec"] is not None:
        parts.append(
            f"{record['examples_per_sec']:.0f} examples/s "
            f"({record['examples_per_sec_per_replica']:.0f}/replica),"
        )
    parts.append(
        f"step {1000 * record['step_time_mean']:.1f} ms mean, "
        f"{1000 * record['step_time_max']:.1f} ms max,"
    )
    parts.append(f"input wait {input_wait_summary(record['input_wait'])}")
    if record["workers"] > 1:
        parts.append(f"(slowest worker {record['slowest_worker']})")
    return " ".join(parts)


def _batches(count: int) -> str:
    return f"{count} batch{'' if count == 1 else 'es'}"
