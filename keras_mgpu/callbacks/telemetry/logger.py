"""`DistributedLogger`: chief-only training telemetry for distributed `fit`.

The callback decides when a window or an epoch closes: what a record holds
is `records`, what it reads `reader`, where it goes `sinks`."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any, Optional, Union

import keras

from keras_mgpu import compat
from keras_mgpu import strategy as strategy_lib
from keras_mgpu.callbacks.telemetry import claims
from keras_mgpu.callbacks._console import print_msg
from keras_mgpu.callbacks.telemetry.console import _EpochLines
from keras_mgpu.callbacks.telemetry.hand_loop import _HandLoop
from keras_mgpu.callbacks.telemetry.options import _validate
from keras_mgpu.callbacks.telemetry.profiler import _Profiler
from keras_mgpu.callbacks.telemetry.reader import _read
from keras_mgpu.callbacks.telemetry.records import (
    _Span, _floats, _measure, _record, _snapshot)
from keras_mgpu.callbacks.telemetry.sinks import Sinks
from keras_mgpu.callbacks.telemetry.state import _Fit, _Progress
from keras_mgpu.callbacks.telemetry.summaries import _ModelSummaries
from keras_mgpu.callbacks.telemetry.workers import _spread_over_workers
from keras_mgpu.goodput.ledger import ledger
from keras_mgpu.runtime import RuntimeCallback


class DistributedLogger(RuntimeCallback):
    """Logs throughput, timing and training state, written by the chief only.

    Every `update_freq` train batches (a "window") and at every epoch end,
    it measures:
    - loss and compiled metrics, global over replicas and workers (the
      values Keras's own logs give at that batch);
    - examples/s, global and per replica, from the samples actually trained
      on (steps skipped for overflow still count as work);
    - step time: mean (window wall time / steps) and max;
    - input wait: the share of the record's wall time the train steps spent
      blocked fetching their batches, flagged (`input_bound`) where it
      exceeds what fetching the same batches costs when each is already
      there by 5% ("moderately") or 20% ("highly"), the thresholds of
      xprof's input-pipeline analysis. That fixed cost is measured as a
      `fit` begins, once per strategy (`keras-mgpu bench` measures it in
      a whole `fit`): on a step of a few milliseconds it alone is a large
      share, with in-memory arrays too, and says the step is short, not
      that the pipeline is slow;
    - learning rate (through `LossScaleOptimizer` and schedules), loss scale
      and skipped steps under `mixed_float16`, current and peak memory per
      local GPU (peak reset every record; on JAX, JAX's allocator's
      figures, whose peak is the process's: JAX cannot reset it), and
      `grad_norm` / `accum_step` of a `keras_mgpu.GradientAccumulationModel`;
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

    Cost: nothing is read from the device between records. A record
    closes at the next batch's begin (or at validation/epoch end): it reads
    the metrics, which waits for the device, then stamps the time. Inside
    `fit` its batch end only closes the runtime's count of the batch, in
    any order and on any thread, so it declares `async_safe`: on JAX, Keras
    then keeps dispatching batch ends asynchronously (the host does not
    wait for each step) unless another callback needs them in order. In a
    hand-written loop it is not `async_safe`: there its batch end takes
    the loop's logs, which a record needs in order.

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

    One writer per `log_dir`: while a logger's run writes a `log_dir` (its
    `fit`, or a hand-written loop from `on_train_begin` to `on_train_end`),
    any other logger's run there raises `LogDirInUse` before training,
    naming the run that writes it: another logger in the same callbacks, a
    `fit` started from a callback of that run (a tuner), another thread,
    or another process on this machine (for a local `log_dir`, however it
    is spelled: relative, through a link, as a `file://` URL). So does the
    same logger in a second `fit` while its first runs. One after the
    other is fine: a resumed run continues the file. A `fit` that raised
    frees its `log_dir` as it unwinds; a hand-written loop that raised
    holds it until its logger is dropped, so end it in a `finally`. Other
    workers than the chief write nothing and claim nothing.

    Records are stamped with the run's global step, kept by the training
    runtime this callback shares with `BackupAndRestore` and
    `LossScaleMonitor` (`keras_mgpu.runtime`): it continues across `fit`
    calls and across a resume, so a resumed run's curves continue the
    interrupted one's instead of overwriting them. Windows are aligned to
    multiples of `update_freq` batches within the epoch; batches a resume
    skips are not logged, and a window with nothing trained is not written.
    Each resume writes a `"resume"` record ("resumed from generation N at
    step S") and the same text to TensorBoard's `resume` tag. What a failed
    attempt recorded past S (after its last backup) is superseded: its
    JSONL records get `"superseded": true`, and TensorBoard shows the
    values trained again (docs/telemetry.md).

    Every record carries the process's time ledger (`goodput`: the seconds
    since the attempt began, by category), and one of kind `"goodput"`
    carries it alone as training begins; `keras-mgpu goodput LOG_DIR` adds
    up a job's attempts (docs/goodput.md).

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
    record's `input_wait` is `null`; so in a hand-written loop. On Keras's
    JAX backend `fit` fetches each batch on the host (and puts it on the
    devices) before it dispatches the step, so each fetch is timed with a
    host clock instead, `run_eagerly=True` included; JAX dispatches
    asynchronously, so the devices may still be busy with the previous
    step meanwhile, and Keras's iterator prepares the next batch inside
    each fetch: on JAX only the timing's own cost is a ready fetch's. A
    multi-worker record gives the mean over workers, flagged
    (`input_bound`) from that mean less the workers' mean ready-fetch
    cost; each worker's is in `worker_input_wait`.

    On JAX, Keras keeps the train state out of the model's variables
    during an epoch; the logger puts it back (`model.jax_state_sync()`)
    only to read a record, not at every batch.

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
    >>> from keras_mgpu.callbacks import (
    ...     DistributedLogger, JSONL_KEYS)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> log_dir = tempfile.mkdtemp()
    >>> _ = model.fit(np.ones((64, 4)), np.ones((64, 1)), batch_size=8,
    ...               verbose=0, callbacks=[DistributedLogger(
    ...                   log_dir, update_freq=4, console=False)])
    >>> with open(os.path.join(log_dir, "metrics.jsonl")) as f:
    ...     records = [json.loads(line) for line in f]
    >>> [(r["kind"], r["steps"], r["examples"]) for r in records[1:]]
    [('window', 4, 32.0), ('window', 4, 32.0), ('epoch', 8, 64.0)]
    >>> records[0]["kind"]  # the time ledger as training began
    'goodput'
    >>> tuple(records[0]) == JSONL_KEYS
    True
    >>> sorted(records[-1]["goodput"])  # the time ledger (docs/goodput.md)
    ['attempt', 'seconds', 'time']
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
        # `_validate` let through None, a bool or a dict.
        self.wandb_config: Optional[dict] = (
            None if wandb is None or wandb is False
            else {} if wandb is True else dict(wandb)
        )
        self.console = console
        self._profiler = _Profiler(
            None if profile_steps is None else tuple(profile_steps),
            self.log_dir)
        self._fit: Optional[_Fit] = None  # the `fit` running (or the last one)
        self._sinks: Optional[Sinks] = None
        # (what it reads, the compiled read)
        self._reader: Optional[tuple[Any, Any]] = None
        self._summaries = _ModelSummaries()
        self._lines = _EpochLines()
        self._progress = _Progress()
        self._hand_loop = _HandLoop()
        # (model, params) of the run writing, on the chief
        self._run: Optional[tuple[Any, Any]] = None
        # Where this log's time ledger starts (`TimeLedger.baseline`), once
        # its first `fit` began.
        self._ledger_since: Optional[dict] = None
        self._ledger_claimed = False

    def __deepcopy__(self, memo):
        # A copy (KerasTuner copies callbacks for every trial) is a new
        # logger with the same arguments: open files and threads stay here.
        return type(self)(
            self.log_dir, self.update_freq, batch_size=self.batch_size,
            wandb=self.wandb_config, profile_steps=self.profile_steps,
            console=self.console)

    @property
    def profile_steps(self) -> Optional[tuple]:
        """The profiled batches, `(start, stop)`; None when not profiled (or
        another profiler was running when the profile was to start)."""
        return self._profiler.steps

    @property
    def global_step(self) -> int:
        """The run's global step (train batches, continuing across resumes)."""
        return 0 if self._fit is None else self._fit.runtime.global_step

    # --- Keras hooks ---------------------------------------------------------

    def on_train_begin(self, logs=None):
        compat.check_summary_support()
        if strategy_lib.is_chief():
            # First: a refused logger changes nothing, not even the runtime
            # it shares with the run that holds the log_dir. Before the
            # outputs are opened: opening closes off a torn line, which must
            # not happen under a live writer.
            try:
                claims._claim_log_dir(
                    self, compat.running_fit(self._trained_model))
            except claims.LogDirInUse:
                if self._run is not None and claims._writing(self):
                    # This logger's own run goes on (it is in two fits at
                    # once): Keras gave it the refused fit's model and
                    # params as that fit made its callback list.
                    model, params = self._run
                    self.set_model(model)
                    self.set_params(params)
                raise
            self._run = (self._trained_model, self.params)
            if not self._ledger_claimed:
                self._ledger_claimed = True
                self._ledger_since = ledger().baseline()
        super().on_train_begin(logs)
        runtime = self.runtime
        # `fit` reads Keras's compiled step; a hand-written loop (driving a
        # `CallbackList` itself, `train_on_batch` included) gives its values
        # in the logs of each batch end.
        self._hand_loop.begin(self.model)
        runtime.time_input()
        strategy = strategy_lib.of_model(self.model)
        multi = strategy_lib.is_multi_worker(strategy)
        # Read at the first trained batch (after any resume). The reader is
        # traced at the first record (the metrics exist by then), and kept
        # for the next `fit` while it would read the same objects.
        self._fit = fit = _Fit(
            runtime=runtime, strategy=strategy,
            workers=strategy_lib.num_workers() if multi else 1,
            replicas=strategy_lib.num_replicas(strategy),
            chief=strategy_lib.is_chief(),
            num_gpus=runtime.local_gpus(),
            # `_validate` let through "epoch" or a positive integer.
            freq=(float("inf") if isinstance(self.update_freq, str)
                  else self.update_freq),
            # Before the first batch: outside every record's time.
            ready_fetch=(None if self._hand_loop.active
                         else runtime.ready_fetch_seconds()))
        self._progress.in_epoch = False
        self._progress.last = None
        runtime.gpu_memory(fit.num_gpus, reset=True)
        # A `fit` that raised never reached `on_train_end`: its profile is
        # stopped here, and its sinks (whose writer has stopped by itself)
        # take this fit's records after the ones it wrote.
        self._profiler.stop()
        self._summaries.leave()
        if fit.chief and self._sinks is None:
            self._sinks = Sinks(self.log_dir, self.wandb_config)
            if self.wandb_config is None:
                # Kept across `fit` calls (files, writers, the compiled event
                # writer): a short fit costs no more than a record. Closed
                # when the logger is dropped, or at exit.
                self._sinks.close_with(self)
        # XLA cannot compile summary ops: a jit-compiled step records none
        # (Keras's `TensorBoard` decides at trace time, and records none).
        if (fit.chief and self.update_freq != "epoch"
                and not getattr(self.model, "jit_compile", False)):
            assert self._sinks is not None  # the chief's, opened above
            self._summaries.enter(runtime, self._sinks.run_writer("train"))

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        self._lines.flush()
        assert self._fit is not None  # set by on_train_begin
        if not self._fit.runtime.skipping:
            self._log_resumes()
        self._progress.begin_epoch(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        # The hot path: a clock read, comparisons and counters. Everything
        # else waits for the window to close.
        now = time.perf_counter()
        fit, progress = self._fit, self._progress
        assert fit is not None  # set by on_train_begin
        runtime = fit.runtime
        super().on_train_batch_begin(batch, logs)
        if not runtime.batch_trains:
            return  # replayed by a resume: nothing trained, nothing logged
        self._begin_attempt()
        if len(progress.logged_resumes) < len(runtime.resumed_here):
            # The first batch after a resume mid-epoch: the skipping that
            # could refuse it is done.
            self._log_resumes(mid_epoch=True)
        last = progress.last_begin
        if last is not None and now - last > progress.window.step_max:
            progress.window.step_max = now - last
        self._hand_loop.count(self._trained_model, progress.window,
                              progress.epoch_span)
        # Windows are aligned to multiples of `update_freq` batches in the
        # epoch, so a resumed run's records fall where the original's did.
        window_id = batch // fit.freq
        if window_id != progress.window_id:
            if progress.window.steps:
                now = self._close_window(final=False)
            progress.window_id = window_id
        if progress.last is None:
            progress.last = _snapshot(runtime.counters())
        if self._summaries.recording:
            self._summaries.record(
                (batch + 1) % fit.freq == 0
                or batch + 1 == (self.params or {}).get("steps"))
        steps = runtime.global_step - runtime.completed_steps
        timed = runtime.input_timed
        progress.last_batch = batch
        self._hand_loop.batch_begin(self._trained_model)
        if progress.epoch_first_step is None:
            progress.epoch_first_step = runtime.completed_steps
        progress.window.add(steps, progress.last, now, timed)
        progress.epoch_span.add(steps, progress.last, now, timed)
        if fit.chief and self.profile_steps is not None:
            self._profiler.update(self.global_step, self._sinks)
            if self._profiler.profiling:
                now = time.perf_counter()
        progress.last_begin = now

    @property
    def async_safe(self) -> bool:
        """Whether Keras may run this callback's batch ends on another
        thread, late (JAX's asynchronous dispatch): inside `fit`, yes."""
        return compat.given_to_running_fit(self)

    def on_train_batch_end(self, batch, logs=None):
        # In `fit`, nothing but the runtime's end of the call (which
        # tolerates a late end on another thread): a record reads the
        # compiled step. A hand-written loop's logs are taken in order.
        super().on_train_batch_end(batch, logs)
        self._hand_loop.batch_end(self._progress.epoch, batch, logs)

    def on_test_begin(self, logs=None):
        # Validation runs after the epoch's last batch and before
        # `on_epoch_end`: close the training figures before it starts (and
        # before `evaluate` resets the metrics).
        progress = self._progress
        self._hand_loop.count(self.model, progress.window,
                              progress.epoch_span)
        super().on_test_begin(logs)
        self._profiler.end_step()
        if progress.in_epoch and progress.epoch_record is None:
            self._finish_epoch()
        self._summaries.record(False)
        if progress.in_epoch and self._sinks is not None:
            self._sinks.run_writer("validation")  # on this thread: see there

    def on_epoch_end(self, epoch, logs=None):
        progress = self._progress
        self._hand_loop.count(self.model, progress.window,
                              progress.epoch_span)
        super().on_epoch_end(epoch, logs)
        self._profiler.end_step()
        self._summaries.record(False)
        if progress.epoch_record is None:
            self._finish_epoch()
        progress.in_epoch = False
        record = progress.epoch_record
        if record is None:
            return
        record["metrics"] = _floats(logs or {})
        assert self._fit is not None  # set by on_train_begin
        if self._fit.chief:
            self._submit(record)
            if self.console:
                self._lines.epoch_end(record, self.params)

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        self._profiler.stop()
        self._summaries.leave()
        self._lines.flush()
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
            claims._release_log_dir(self)
            self._run = None

    # --- Records -------------------------------------------------------------

    def _submit(self, record: dict) -> None:
        # Records are written on the chief, which has its sinks.
        assert self._sinks is not None
        record["goodput"] = ledger().snapshot(self._ledger_since)
        try:
            self._sinks.submit(record)
        except RuntimeError:
            # A write failed: training stops here, so close the outputs now
            # (the wandb run finished, the files closed) rather than leave
            # them open. Only the first failure is raised.
            with contextlib.suppress(Exception):
                self._close_sinks()
            raise

    def _close_sinks(self) -> None:
        sinks, self._sinks = self._sinks, None
        assert sinks is not None  # only called while they are open
        sinks.close()

    def _log_resumes(self, mid_epoch: bool = False):
        """Records each resume made here, once it is accepted (the runtime
        has skipped what the interrupted run trained): a refused resume is
        not recorded."""
        logged = self._progress.logged_resumes
        assert self._fit is not None  # set by on_train_begin
        self._begin_attempt()
        for event in self._fit.runtime.resumed_here:
            if event in logged:
                continue
            logged.add(event)
            text = event.describe()
            if self._fit.chief:
                self._submit(_record(
                    "resume", event.epoch, event.step, {}, {}, None,
                    resume={**dataclasses.asdict(event), "text": text}))
                if self.console:
                    # Mid-epoch, off the progress bar's unfinished line.
                    bar = mid_epoch and (self.params or {}).get(
                        "verbose") in (1, "auto")
                    print_msg(("\n" if bar else "")
                              + f"DistributedLogger: {text}.")

    def _begin_attempt(self):
        """On the chief, before this process's first record (the step a
        resume continues from is known by then): what an earlier attempt
        recorded past it is superseded."""
        sinks = self._sinks
        if sinks is not None and not sinks.begun:
            assert self._fit is not None  # set by on_train_begin
            sinks.begin_at(self._fit.runtime.completed_steps)
            # The time ledger as training begins (start-up and restore
            # known): an attempt killed before its first window has one.
            self._submit(_record("goodput", self._progress.epoch,
                                 self._fit.runtime.completed_steps, {}, {},
                                 {}))

    def _finish_epoch(self):
        if self._progress.epoch_span.steps == 0:
            self._progress.epoch_record = None
            return
        self._close_window(final=True)

    def _close_window(self, final: bool) -> float:
        """Reads, aggregates and writes a window; returns when it ended."""
        fit, progress = self._fit, self._progress
        assert fit is not None  # set by on_train_begin
        # Reading the metrics waits for the device, so the time stamped after
        # it includes all the window's work.
        self._reader, checked, read = _read(
            self.model, fit.runtime, self._reader,
            check=not fit.reader_checked)
        fit.reader_checked = fit.reader_checked or checked
        counters = read["counters"]
        state = _snapshot(counters)
        end = time.perf_counter()
        if (state["input_wait"] is not None and progress.last is not None
                and progress.last["input_wait"] is not None):
            # Measured inside the steps, which the ledger counted whole.
            ledger().move("productive", "input_wait",
                          state["input_wait"] - progress.last["input_wait"])
        window = progress.window
        if progress.last_begin is not None:
            window.step_max = max(window.step_max, end - progress.last_begin)
            progress.last_begin = None
        progress.epoch_span.step_max = max(progress.epoch_span.step_max,
                                           window.step_max)
        spans = [window] + ([progress.epoch_span] if final else [])
        loss_scaled = isinstance(getattr(self.model, "optimizer", None),
                                 keras.optimizers.LossScaleOptimizer)
        measured = [_measure(span, state, end, batch_size=self.batch_size,
                             hand_loop=self._hand_loop.active,
                             replicas=fit.replicas, loss_scaled=loss_scaled,
                             ready_fetch=fit.ready_fetch)
                    for span in spans]
        _spread_over_workers(fit.strategy, fit.workers, measured)
        common = {
            "learning_rate": read["learning_rate"],
            "loss_scale": read["loss_scale"],
            "grad_norm": read["grad_norm"],
            "accum_step": counters.micro_step,
            "memory": fit.runtime.gpu_memory(fit.num_gpus, reset=True),
            "workers": fit.workers,
            "replicas": fit.replicas,
        }
        # A window of only the call that found the end of the data trained
        # nothing: no record.
        if (self.update_freq != "epoch" and fit.chief
                and measured[0]["steps"]):
            metrics = read["metrics"]
            if self._hand_loop.active:
                metrics = self._hand_loop.metrics(
                    metrics, window, progress.epoch, progress.last_batch)
            self._submit(_record("window", progress.epoch,
                                 counters.global_step, measured[0],
                                 common, metrics))
        if final:
            measured[1]["resumed_after"] = self._resumed_after()
            progress.epoch_record = _record(
                "epoch", progress.epoch, counters.global_step, measured[1],
                common, {})
        progress.last = state
        progress.window = _Span()
        return time.perf_counter()

    def _resumed_after(self) -> Optional[int]:
        """The batches of this epoch a resume skipped (the interrupted run
        trained them), or None where the epoch did not resume inside."""
        assert self._fit is not None  # set by on_train_begin
        runtime, progress = self._fit.runtime, self._progress
        if not any(event.epoch == progress.epoch
                   for event in runtime.resumed_here):
            return None
        # Read from the data (trained or skipped) minus trained here, as the
        # runtime counted them (a call that found the data's end trained
        # nothing).
        # Set as the epoch's first batch began: the epoch has trained some.
        assert progress.epoch_first_step is not None
        trained = runtime.completed_steps - progress.epoch_first_step
        skipped = runtime.epoch_step - trained
        return skipped if skipped > 0 else None
