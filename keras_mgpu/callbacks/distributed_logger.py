"""`DistributedLogger`: chief-only training telemetry for distributed `fit`."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import queue
import threading
import time
import warnings
from typing import Optional, Union

import keras
import numpy as np
import tensorflow as tf

from keras_mgpu._checks import is_nonempty_path, is_positive_int
from keras_mgpu import compat
from keras_mgpu import strategy as strategy_lib
from keras_mgpu import mixed_precision

# Every JSONL line has exactly these keys, in this order; a value that cannot
# be measured in this run is `null`.
JSONL_KEYS = (
    "kind",  # "window" (every `update_freq` steps) or "epoch"
    "epoch",  # 0-based epoch index
    "step",  # train batches seen by this callback when the record closed
    "steps",  # batches in the record
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
)

_INSTALL_HINT = 'pip install "keras-mgpu[wandb]"'


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

    Only the chief writes: TensorBoard scalars (`<log_dir>/train`), one JSON
    object per record in `<log_dir>/metrics.jsonl` (keys: `JSONL_KEYS`), a
    wandb run and profiler traces. Other workers create nothing, but run the
    same reads at the same batches, since reading global metrics and the
    cross-worker figures are collectives that every worker must join.

    Cost: nothing is read from the device between records. The callback
    only hooks batch *begin*, so Keras does not convert per-batch logs for
    it and may dispatch other callbacks' batch ends asynchronously. A record
    closes at the next batch's begin (or at validation/epoch end): it reads
    the metrics, which waits for the device, then stamps the time. Writing
    (JSONL, TensorBoard, wandb) happens on a background thread, in order;
    everything is on disk when `fit` returns.

    Examples are counted from Keras's loss tracker, which `fit` feeds with
    each batch's real size (the last short batch included). A model whose
    custom `train_step` does not feed it needs `batch_size`.

    Input wait is timed inside the train function: `fit` fetches each batch
    in its compiled step, where no host clock can see it, so the callback
    retraces Keras's own step with the fetch bracketed by `tf.timestamp`
    ops that add its duration to a variable (read with the metrics). The
    training math is unchanged. Without Keras's compiled train function
    (`run_eagerly=True`, or batches another callback stands in for) a
    record's `input_wait` is `null`. A multi-worker record gives the mean
    over workers and flags `input_bound` from the most input-bound one.

    Args:
        log_dir: Directory for all output (created on the chief only).
        update_freq: Defaults to 100. Train batches per window record, a
            positive integer, or `"epoch"` for epoch records only. Windows
            restart at every epoch; the last one of an epoch may be shorter.
        batch_size: Defaults to `None`: count samples from the loss tracker.
            A global batch size (all replicas and workers) to count
            `batch_size * steps` instead.
        wandb: Defaults to `None` (no wandb). `True`, or a dict of
            `wandb.init` arguments (e.g. `{"project": "demo"}`), to log every
            record to a wandb run on the chief; `dir` defaults to `log_dir`.
            Respects `WANDB_MODE=offline`. Needs `pip install
            "keras-mgpu[wandb]"`.
        profile_steps: Defaults to `None`. `(start, stop)`: capture a
            TensorBoard/xprof profile on the chief from train batch `start`
            to batch `stop`, both included, counted from 1 over the whole
            training, into `<log_dir>/train/plugins/profile/`.
        console: Defaults to `True`. Print a one-line summary per epoch on
            the chief (after Keras's progress bar has finished its line).

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
        _validate(log_dir, update_freq, batch_size, wandb, profile_steps)
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
        self.global_step = 0
        self._sinks = None
        self._profiling = False
        self._pending_console = None
        self._reader = None
        self._seconds_waited = None
        self._timed_functions = {}
        self._timed_function = None

    # --- Keras hooks ---------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._strategy = self.model.distribute_strategy
        multi = strategy_lib.is_multi_worker(self._strategy)
        self._workers = strategy_lib.num_workers() if multi else 1
        self._replicas = strategy_lib.num_replicas(self._strategy)
        self._chief = strategy_lib.is_chief()
        self._steps_per_call = int(getattr(self.model, "steps_per_execution", 1))
        self._in_epoch = False
        self._num_gpus = len(tf.config.list_logical_devices("GPU"))
        self._freq = (
            float("inf") if self.update_freq == "epoch" else self.update_freq
        )
        self._profile = self.profile_steps is not None and self._chief
        # Traced at the first window close of this fit: the model's metrics
        # and the optimizer exist by then.
        self._reader = None
        self._fit_model = self.model
        if self._seconds_waited is None:
            self._seconds_waited = _local_variable()
        _memory(self._num_gpus, reset=True)
        if self._chief:
            if self._sinks is None:
                self._sinks = _Sinks(self.log_dir, self.wandb_config)

    def on_epoch_begin(self, epoch, logs=None):
        self._flush_console()
        self._epoch = epoch
        self._in_epoch = True
        self._epoch_record = None
        # Keras reset the metrics just before this hook: the sample count
        # starts at 0.
        self._epoch_state = self._window_state = self._read_state(0.0)
        self._epoch_start = self._window_start = None
        self._epoch_first_step = self.global_step
        self._window_steps = 0
        self._epoch_step_max = self._window_step_max = 0.0
        self._last_begin = None
        self._epoch_untimed = self._window_untimed = False

    def on_train_batch_begin(self, batch, logs=None):
        # The hot path: a clock read, a comparison and counters. Everything
        # else waits for the window to close.
        now = time.perf_counter()
        last = self._last_begin
        if last is not None:
            if now - last > self._window_step_max:
                self._window_step_max = now - last
            if self._window_steps >= self._freq:
                now = self._close_window(final=False)
        elif self._epoch_start is None:
            self._epoch_start = now
        if self._window_start is None:
            self._window_start = now
        if self._fit_model.train_function is not self._timed_function:
            self._time_input()
        self.global_step += self._steps_per_call
        self._window_steps += self._steps_per_call
        if self._profile:
            self._update_profiler()
            if self._profiling:
                now = time.perf_counter()
        self._last_begin = now

    @property
    def _epoch_steps(self) -> int:
        return self.global_step - self._epoch_first_step

    def on_test_begin(self, logs=None):
        # Validation runs after the epoch's last batch and before
        # `on_epoch_end`: close the training figures before it starts (and
        # before `evaluate` resets the metrics).
        if self._in_epoch and self._epoch_record is None:
            self._finish_epoch()

    def on_epoch_end(self, epoch, logs=None):
        if self._epoch_record is None:
            self._finish_epoch()
        self._in_epoch = False
        record = self._epoch_record
        if record is None:
            return
        record["metrics"] = _floats(logs or {})
        if self._chief:
            self._sinks.submit(record)
            if self.console:
                self._pending_console = _console_line(record)
            if self.params.get("verbose") != 1:
                self._flush_console()

    def on_train_end(self, logs=None):
        if self._fit_model.train_function is self._timed_function:
            self._fit_model.train_function = self._timed_function.keras_train_function
        self._timed_function = None
        # Keep the twin of the function a next `fit` will call, not those of
        # functions Keras has dropped (a recompile makes a new one).
        current = self._fit_model.train_function
        self._timed_functions = {
            key: entry for key, entry in self._timed_functions.items()
            if entry[0] is current
        }
        self._stop_profiler()
        self._flush_console()
        if self._sinks is not None:
            sinks, self._sinks = self._sinks, None
            sinks.close()

    def _time_input(self):
        """Puts the input-timing twin of `model.train_function` in its place.

        Twins are cached by the function they stand for: a callback that
        swaps the train function out and back (BackupAndRestore skipping
        batches) gets the same twin back, with no retrace.
        """
        function = self._fit_model.train_function
        cached = self._timed_functions.get(id(function))
        if cached is None or cached[0] is not function:
            cached = (function, compat.timed_train_function(
                function, self._seconds_waited))
            self._timed_functions[id(function)] = cached
        if cached[1] is None:
            # This batch's wait cannot be timed: its records report none.
            self._window_untimed = self._epoch_untimed = True
            return
        self._fit_model.train_function = self._timed_function = cached[1]

    # --- Records -------------------------------------------------------------

    def _finish_epoch(self):
        if self._epoch_steps == 0:
            self._epoch_record = None
            return
        self._close_window(final=True)

    def _close_window(self, final: bool) -> float:
        """Reads, aggregates and writes a window; returns when it ended."""
        # Reading the metrics waits for the device, so the time stamped after
        # it includes all the window's work.
        read = self._read_window()
        metrics = read["metrics"]
        state = {
            "examples": read["examples"],
            "iterations": read["iterations"],
            "micro_step": read["micro_step"],
            "input_wait": read["input_wait"],
        }
        end = time.perf_counter()
        if self._last_begin is not None:
            self._window_step_max = max(self._window_step_max,
                                        end - self._last_begin)
            self._last_begin = None
        self._epoch_step_max = max(self._epoch_step_max,
                                   self._window_step_max)
        window = self._measure(
            self._window_state, state, self._window_start, end,
            self._window_steps, self._window_step_max, final,
            self._window_untimed,
        )
        rows = [_worker_row(window)]
        if final:
            epoch = self._measure(
                self._epoch_state, state, self._epoch_start, end,
                self._epoch_steps, self._epoch_step_max, final,
                self._epoch_untimed,
            )
            rows.append(_worker_row(epoch))
        gathered = self._gather(np.concatenate(rows))
        width = rows[0].size
        window.update(_across_workers(gathered[:, :width]))
        common = self._shared_fields(read)
        if self.update_freq != "epoch":
            record = _record("window", self._epoch, self.global_step, window,
                             common, metrics)
            if self._chief:
                self._sinks.submit(record)
        if final:
            epoch.update(_across_workers(gathered[:, width:]))
            self._epoch_record = _record("epoch", self._epoch,
                                         self.global_step, epoch, common, {})
        self._window_state = state
        self._window_start = None
        self._window_steps = 0
        self._window_step_max = 0.0
        self._window_untimed = False
        return time.perf_counter()

    def _read_state(self, examples) -> dict:
        optimizer = self.model.optimizer
        # Iterations only matter for counting skipped steps.
        loss_scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        return {
            "examples": examples,
            "iterations": (
                int(optimizer.iterations.numpy()) if loss_scaled else None
            ),
            "micro_step": _accumulation(self.model)[0],
            "input_wait": float(self._seconds_waited.numpy()),
        }

    def _measure(self, start, state, t0, t1, steps, step_max, final,
                 untimed) -> dict:
        seconds = max(t1 - t0, 1e-9)
        if self.batch_size is not None:
            examples = float(self.batch_size * steps)
        elif state["examples"] is not None:
            examples = state["examples"] - start["examples"]
        else:
            examples = None
        per_sec = None if examples is None else examples / seconds
        skipped = None
        if isinstance(self.model.optimizer, keras.optimizers.LossScaleOptimizer):
            expected = _expected_updates(
                self.model, steps, start["micro_step"], state["micro_step"],
                final,
            )
            skipped = max(
                expected - (state["iterations"] - start["iterations"]), 0
            )
        return {
            "steps": steps,
            "seconds": seconds,
            "examples": examples,
            "examples_per_sec": per_sec,
            "examples_per_sec_per_replica": (
                None if per_sec is None else per_sec / self._replicas
            ),
            "step_time_mean": seconds / steps,
            "step_time_max": step_max,
            "input_wait": None if untimed else min(
                (state["input_wait"] - start["input_wait"]) / seconds, 1.0),
            "skipped_steps": skipped,
        }

    def _read_window(self) -> dict:
        """Everything a window reads from the device, in one compiled call.

        Metrics, sample count, iterations, learning rate, loss scale and the
        accumulation state come back from one cached `tf.function` (one
        dispatch, one wait for the device) instead of a dozen eager reads.
        Reading the replica-summed metrics is a collective under
        MultiWorkerMirroredStrategy: every worker calls this at the same
        window boundaries.
        """
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            # Nothing trained yet (e.g. every batch skipped by a resume):
            # read eagerly, the variables may not exist.
            return self._read_eagerly()
        if self._reader is None:
            self._reader = _make_reader(self.model, self._seconds_waited)
        raw = self._reader()
        return {
            "metrics": _floats(raw["metrics"]),
            "examples": _scalar(raw["examples"], float),
            "iterations": _scalar(raw["iterations"], int),
            "micro_step": _scalar(raw["micro_step"], int),
            "grad_norm": _scalar(raw["grad_norm"], float),
            "learning_rate": _scalar(raw["learning_rate"], float),
            "loss_scale": _scalar(raw["loss_scale"], float),
            "input_wait": _scalar(raw["input_wait"], float),
        }

    def _read_eagerly(self) -> dict:
        optimizer = self.model.optimizer
        state = self._read_state(compat.examples_seen(self.model))
        return {
            "metrics": _floats(self.model.get_metrics_result()),
            **state,
            "grad_norm": _accumulation(self.model)[1],
            "learning_rate": _learning_rate(optimizer),
            "loss_scale": mixed_precision.loss_scale(optimizer),
        }

    def _shared_fields(self, read) -> dict:
        return {
            "learning_rate": read["learning_rate"],
            "loss_scale": read["loss_scale"],
            "grad_norm": read["grad_norm"],
            "accum_step": read["micro_step"],
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
        if self._pending_console is not None:
            print(self._pending_console, flush=True)
            self._pending_console = None

    # --- Profiler ------------------------------------------------------------

    def _update_profiler(self):
        if self.profile_steps is None or not self._chief:
            return
        start, stop = self.profile_steps
        if self._profiling and self.global_step > stop:
            self._stop_profiler()
        if not self._profiling and start <= self.global_step <= stop:
            try:
                tf.profiler.experimental.start(
                    os.path.join(self.log_dir, "train")
                )
                self._profiling = True
            except tf.errors.AlreadyExistsError:
                warnings.warn(
                    "DistributedLogger: another profiler is running; "
                    f"profile_steps={self.profile_steps} is not captured.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self.profile_steps = None

    def _stop_profiler(self):
        if self._profiling:
            tf.profiler.experimental.stop()
            self._profiling = False


# --- Helpers -----------------------------------------------------------------


class _Sinks:
    """The chief's outputs, written in order by one background thread.

    Training only queues records. The thread takes every record waiting
    and writes them together: JSONL lines in one write, TensorBoard events
    in one compiled call, then wandb. A failed write is raised on the
    training thread at the next `submit` or at `close`.
    """

    def __init__(self, log_dir: str, wandb_config: Optional[dict]):
        os.makedirs(log_dir, exist_ok=True)
        # The writer syncs its file every `max_queue` events (default 10):
        # with a record's ~20 scalars that was two fsyncs per window. Sync
        # every 10 s and after every epoch record instead.
        self._writer = tf.summary.create_file_writer(
            os.path.join(log_dir, "train"),
            max_queue=10_000, flush_millis=10_000,
        )
        self._write_events = _event_writer(self._writer)
        self._jsonl = open(os.path.join(log_dir, "metrics.jsonl"), "a")
        self._wandb_run = None
        if wandb_config is not None:
            import wandb

            config = dict(wandb_config)
            config.setdefault("dir", log_dir)
            os.makedirs(config["dir"], exist_ok=True)
            self._wandb_run = wandb.init(**config)
        self._queue = queue.Queue()
        self._error = None
        # Not a daemon: records queued when the program ends still land.
        self._thread = threading.Thread(
            target=self._run, name="DistributedLogger")
        self._thread.start()

    def submit(self, record: dict) -> None:
        self._raise_error()
        self._queue.put(record)

    def close(self) -> None:
        """Writes every queued record, then closes the outputs."""
        self._queue.put(None)
        self._thread.join()
        self._writer.close()
        self._jsonl.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(
                "DistributedLogger could not write its records"
            ) from error

    def _run(self) -> None:
        done = False
        while not done:
            try:
                records = [self._queue.get(timeout=0.5)]
            except queue.Empty:
                if threading.main_thread().is_alive():
                    continue
                # `fit` died without `on_train_end` and the program is
                # exiting: write what is queued, then let it exit.
                records = [None]
            while not self._queue.empty():
                records.append(self._queue.get())
            done = None in records
            records = [r for r in records if r is not None]
            if records and self._error is None:
                try:
                    self._write(records)
                except Exception as error:  # raised on the training thread
                    self._error = error
        self._jsonl.flush()
        self._writer.flush()

    def _write(self, records: list) -> None:
        self._jsonl.write("".join(json.dumps(r) + "\n" for r in records))
        scalars = [_scalars(r) for r in records]
        # Epoch scalars are stepped by epoch, as Keras's TensorBoard does.
        self._write_events(
            tf.constant([_summary_proto(r["kind"], s)
                         for r, s in zip(records, scalars)]),
            tf.constant([r["epoch"] if r["kind"] == "epoch" else r["step"]
                         for r in records], tf.int64),
        )
        if any(r["kind"] == "epoch" for r in records):
            self._jsonl.flush()
            self._writer.flush()
        if self._wandb_run is not None:
            for record, values in zip(records, scalars):
                self._wandb_run.log(
                    {f"{record['kind']}/{tag}": v
                     for tag, v in values.items()},
                    step=record["step"],
                )


def _event_writer(writer):
    """One compiled call writes a batch of serialized `Summary` protos, each
    at its own step: one dispatch for any number of records."""

    @tf.function(input_signature=(
        tf.TensorSpec([None], tf.string),
        tf.TensorSpec([None], tf.int64),
    ))
    def write(serialized, steps):
        with writer.as_default():
            for i in tf.range(tf.size(steps)):
                tf.summary.experimental.write_raw_pb(
                    serialized[i], step=steps[i])

    return write


def _validate(log_dir, update_freq, batch_size, wandb, profile_steps) -> None:
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


def _local_variable() -> tf.Variable:
    """A float64 zero that is this process's own, even inside a strategy
    scope: scopes are per thread, so it is created on a fresh one. (A
    mirrored copy would need a collective to create under
    MultiWorkerMirroredStrategy, and each worker times its own input.)"""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(
            tf.Variable, 0.0, dtype=tf.float64, trainable=False
        ).result()


def _make_reader(model, seconds_waited):
    """A `tf.function` returning every value a window record reads."""
    optimizer = model.optimizer
    loss_scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    count = compat.examples_count(model)
    micro = getattr(model, "_micro_step", None)
    norm = getattr(model, "_grad_norm", None)
    if getattr(model, "micro_step", None) is None:
        micro = norm = None

    def learning_rate():
        try:
            # Through LossScaleOptimizer; a schedule is evaluated at the
            # optimizer's iterations.
            return tf.convert_to_tensor(optimizer.learning_rate)
        except (AttributeError, TypeError, ValueError):
            return None

    def tensor(variable):
        return None if variable is None else tf.identity(
            keras.ops.convert_to_tensor(variable))

    @tf.function(autograph=False)
    def read():
        return {
            "metrics": model.get_metrics_result(),
            "examples": tensor(count),
            "iterations": tensor(optimizer.iterations) if loss_scaled else None,
            "micro_step": tensor(micro),
            "grad_norm": tensor(norm),
            "learning_rate": learning_rate() if optimizer is not None else None,
            "loss_scale": (
                tensor(optimizer.dynamic_scale) if loss_scaled else None
            ),
            "input_wait": tf.identity(seconds_waited),
        }

    # The concrete function skips tf.function's per-call signature matching.
    return read.get_concrete_function()


def _summary_proto(kind: str, scalars: dict) -> bytes:
    """A serialized `Summary` holding TensorBoard scalars, as `tf.summary.scalar`
    writes them (float32 tensors tagged for the scalars plugin)."""
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.scalar import metadata as scalar_metadata

    metadata = scalar_metadata.create_summary_metadata(
        display_name=None, description=None)
    summary = summary_pb2.Summary()
    for tag, value in scalars.items():
        entry = summary.value.add(tag=f"{kind}/{tag}")
        entry.metadata.CopyFrom(metadata)
        entry.tensor.dtype = 1  # DT_FLOAT
        entry.tensor.float_val.append(value)
    return summary.SerializeToString()


def _scalar(value, kind):
    return None if value is None else kind(np.asarray(value))


def _accumulation(model) -> tuple[Optional[int], Optional[float]]:
    """(`micro_step`, `grad_norm`) of a GradientAccumulationModel, else Nones."""
    micro = getattr(model, "micro_step", None)
    if micro is None:
        return None, None
    return int(micro), model.grad_norm


def _expected_updates(model, steps, micro_start, micro_end, final) -> int:
    """Optimizer updates the batches of a record should have made."""
    if micro_start is None:
        return steps
    done, rest = divmod(micro_start + steps - micro_end, model.accum_steps)
    # At epoch end the partial window is applied (counted), dropped or
    # carried (then `micro_end` already holds it).
    if final and rest and model.partial_window == "apply":
        done += 1
    return done


def _learning_rate(optimizer) -> Optional[float]:
    try:
        # The property goes through LossScaleOptimizer and evaluates a
        # schedule at the optimizer's iterations.
        return float(np.asarray(optimizer.learning_rate))
    except (AttributeError, TypeError, ValueError):
        return None


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
        "input_bound": (
            None if np.isnan(waited).any() else _input_bound(
                float(waited.max()))
        ),
        "slowest_worker": int(np.argmax(step_time)),
    }


def _record(kind, epoch, step, measured, common, metrics) -> dict:
    values = {**measured, **common, "kind": kind, "epoch": epoch,
              "step": step, "time": time.time(), "metrics": metrics}
    return {key: values.get(key) for key in JSONL_KEYS}


def _scalars(record: dict, prefix: str = "") -> dict:
    """The numeric leaves of a record, keyed by their path."""
    out = {}
    for key, value in record.items():
        if key in ("kind", "epoch", "step", "time"):
            continue
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_scalars(value, f"{tag}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[tag] = float(value)
    return out


def _console_line(record: dict) -> str:
    parts = [f"DistributedLogger epoch {record['epoch'] + 1}:"]
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
    if record["input_wait"] is None:
        parts.append("input wait n/a")
    else:
        parts.append(f"input wait {100 * record['input_wait']:.0f}%")
        if record["input_bound"] != "no":
            parts.append(f"({record['input_bound']} input-bound)")
    if record["workers"] > 1:
        parts.append(f"(slowest worker {record['slowest_worker']})")
    return " ".join(parts)
