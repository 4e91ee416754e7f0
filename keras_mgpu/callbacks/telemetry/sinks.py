"""The chief's outputs of `DistributedLogger`: a local JSONL file written by
the caller, TensorBoard and wandb (and a URL's JSONL) written in order by one
background thread."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import threading
import time
import weakref
from typing import Any, Optional

import tensorflow as tf

from keras_mgpu import _fs
from keras_mgpu import compat
from keras_mgpu.callbacks.telemetry.tensorboard import tensorboard_scalars

# The writer thread flushes every output and exits once nothing has been
# queued for this long; the next record starts a new one. So a `fit` that
# raises (Keras then never calls `on_train_end`) still has every record it
# queued written and flushed, and leaves no thread behind.
IDLE_SECONDS = 0.5

_CLOSE = object()  # queued by `close`: write what precedes, then stop


class _Drain:
    """Queued by `drain`: set once everything before it is written."""

    def __init__(self):
        self.done = threading.Event()


@dataclasses.dataclass
class _Supersede:
    """Queued by `begin_at` for a URL's JSONL: marks its records past
    `step`."""

    step: int


class Sinks:
    """The chief's outputs: the JSONL file, TensorBoard and wandb.

    A local JSONL file is written by `submit` itself: the record's line is
    written and flushed to the operating system before `submit` returns (a
    few microseconds, no sync), so a killed process keeps every record
    submitted before it died, whatever TensorBoard or wandb were doing.
    Everything else is queued for one background thread, which takes every
    record waiting and writes them together: a URL's JSONL lines in one
    write, TensorBoard events in one compiled call, then wandb. A failed
    write is raised on the training thread at once (local JSONL), or at the
    next `submit` or at `close`.

    The thread runs while there is work: idle for `IDLE_SECONDS`, it
    flushes the outputs and exits, and `submit` starts another. It is not
    a daemon, so records queued when the program ends still land.

    A local `log_dir` is written with `open()`; a URL (`gs://...`,
    `ram://...`) through `tf.io.gfile`, wandb's files excepted (wandb
    writes locally: to `WANDB_DIR`, else the working directory, then).
    """

    def __init__(self, log_dir: str, wandb_config: Optional[dict]):
        _fs.makedirs(log_dir)
        # A flush syncs the file (fsync). By default the writer syncs every
        # 10 events: with a record's ~20 scalars, two fsyncs per window.
        # Sync at most every second, after every epoch record and when the
        # writer thread goes idle instead.
        self._log_dir = log_dir
        # run name: (writer, its compiled event writer)
        self._writers: dict[str, tuple[Any, Any]] = {}
        # Runs are created by the logger on the training thread, and read
        # by the writer thread.
        self._writers_lock = threading.Lock()
        self.run_writer("train")
        self._jsonl = _fs.open_append(_fs.join(log_dir, "metrics.jsonl"))
        self._jsonl_local = not _fs.is_url(log_dir)
        # `submit` may be called from Keras's callback thread (a hand-written
        # loop's batch ends): one record at a time, in order.
        self._submit_lock = threading.Lock()
        # records whose background writes wait (`hold`)
        self._held: Optional[list[dict]] = None
        self._jsonl_flushed = time.monotonic()
        self._wandb_run = None
        if wandb_config is not None:
            import wandb

            config = dict(wandb_config)
            # wandb writes locally. For a URL log_dir, its documented default
            # (WANDB_DIR, else the working directory), read now: wandb's own
            # is fixed at the process's first `wandb.init`.
            config.setdefault("dir", (
                os.environ.get("WANDB_DIR") or os.getcwd()
            ) if _fs.is_url(log_dir) else log_dir)
            # Absolute: wandb-core writes some files (files/output.log)
            # itself, resolving a relative dir against its own working
            # directory, and a child process reuses its parent's wandb-core
            # (WANDB_SERVICE): the files would land under the parent's.
            config["dir"] = os.path.abspath(config["dir"])
            os.makedirs(config["dir"], exist_ok=True)
            self._wandb_run = wandb.init(**config)
        self._queue: queue.Queue[Any] = queue.Queue()
        self._error: Optional[Exception] = None
        # `_running` and the queue are checked together under the lock, by
        # `submit` and by a thread deciding to exit: a record is never left
        # queued with no thread to write it.
        self._lock = threading.Lock()
        self._running = False
        self._thread: Optional[threading.Thread] = None  # the latest writer
        # `close_with`'s finalizer
        self._closer: Optional[weakref.finalize] = None
        self.begun = False  # `begin_at` was called

    def begin_at(self, step: int) -> None:
        """Training in this process continues from global step `step`: what
        an earlier attempt recorded past it is superseded. Its window and
        epoch records are marked in the JSONL (`"superseded": true`, set in
        place: the file stays the one `claims` locked), and each TensorBoard
        run gets its restart marker at `step + 1` (TensorBoard then shows
        this attempt's values of those steps). Called once, before this
        process records its first step; wandb keeps what it was sent."""
        self.begun = True
        with self._submit_lock:
            self._raise_error()
            if self._jsonl_local:
                self._jsonl.flush()
                _supersede_in_place(_fs.join(self._log_dir, "metrics.jsonl"),
                                    step)
            else:
                # In order with the writer thread's writes of that file.
                self._queue_or_hold(_Supersede(step))
        # Now, before the train step's own summaries of `step + 1` on.
        for run in ("train", "validation"):
            if _fs.isdir(_fs.join(self._log_dir, run)):
                compat.write_restart_marker(self.run_writer(run), step + 1)

    def submit(self, record: dict) -> None:
        """Writes the record's local JSONL line now; queues the rest."""
        with self._submit_lock:
            self._raise_error()
            if self._jsonl_local:
                try:
                    self._jsonl.write(json.dumps(record) + "\n")
                    self._jsonl.flush()
                except Exception as error:
                    self._error = error
                    self._raise_error()
            self._queue_or_hold(record)

    def _queue_or_hold(self, item) -> None:
        if self._held is not None:
            self._held.append(item)
        else:
            self._put(item)

    def hold(self) -> None:
        """Keeps the background writes of the next records (not their local
        JSONL lines) until `release`: nothing of the logger's own runs
        while a profile is captured."""
        with self._submit_lock:
            if self._held is None:
                self._held = []

    def release(self) -> None:
        """Queues the background writes `hold` kept."""
        with self._submit_lock:
            held, self._held = self._held, None
            for record in held or ():
                self._put(record)

    def drain(self) -> None:
        """Returns once every queued record is written and flushed; the
        outputs stay open for the next `fit`."""
        self.release()
        marker = _Drain()
        self._put(marker)
        thread = self._thread
        assert thread is not None  # `_put` made one
        # The thread sets the marker whatever its writes did; a thread gone
        # without setting it (a bug) must not hang training.
        while not marker.done.wait(1.0):
            if not thread.is_alive():
                break
        self._raise_error()

    def close_with(self, owner) -> None:
        """Closes the outputs when `owner` is garbage collected, or at exit,
        unless `close` came first."""
        self._closer = weakref.finalize(owner, _close_when_collected, self)

    def close(self) -> None:
        """Writes every queued record, then closes the outputs."""
        closer, self._closer = self._closer, None
        if closer is not None:
            closer.detach()
        self.release()
        with self._lock:
            self._queue.put(_CLOSE)
            thread = self._thread if self._running else None
            if thread is None or thread.ident is None:
                # No writer, or a Ctrl-C interrupted its `start` (this close
                # then runs at exit, where Python 3.12+ starts no thread):
                # this thread writes. That writer, should it start after
                # all, finds it is no longer the writer and returns.
                self._thread = threading.current_thread()
                self._running = True
                thread = None
        if thread is None:
            self._serve()
        else:
            thread.join()
        for writer in self.run_writers():
            writer.close()
        self._jsonl.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
        self._raise_error()

    def _put(self, item) -> None:
        with self._lock:
            self._queue.put(item)
            if not self._running:
                # Not a daemon: records queued when the program ends still
                # land. Named before it is marked running: a Ctrl-C between
                # the two leaves no running writer without a thread.
                self._thread = threading.Thread(
                    target=self._run, name="DistributedLogger")
                self._running = True
                self._thread.start()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            # The cause in the message too: Keras's traceback filtering
            # drops the chained exception.
            raise RuntimeError(
                f"DistributedLogger could not write its records: "
                f"{type(error).__name__}: {error}"
            ) from error

    def _run(self) -> None:
        with self._lock:
            if threading.current_thread() is not self._thread:
                return  # replaced by `close`, its start interrupted
        self._serve()

    def _serve(self) -> None:
        """Writes queued records until `_CLOSE`, or until idle."""
        while True:
            try:
                records = [self._queue.get(timeout=IDLE_SECONDS)]
            except queue.Empty:
                self._flush()
                with self._lock:
                    if self._queue.empty():
                        self._running = False
                        return
                continue
            while not self._queue.empty():
                records.append(self._queue.get())
            closing = any(r is _CLOSE for r in records)
            drains = [r for r in records if isinstance(r, _Drain)]
            records = [r for r in records
                       if r is not _CLOSE and not isinstance(r, _Drain)]
            if records and self._error is None:
                try:
                    self._write(records)
                except Exception as error:  # raised on the training thread
                    self._error = error
            if drains:
                self._flush()
                for marker in drains:
                    marker.done.set()
            if closing:
                self._flush()
                with self._lock:
                    self._running = False
                return

    def _flush(self) -> None:
        try:
            if not self._jsonl_local:  # a local one is flushed by `submit`
                self._jsonl.flush()
            for writer in self.run_writers():
                writer.flush()
        except Exception as error:  # raised on the training thread
            if self._error is None:
                self._error = error

    def _supersede_url(self, step: int) -> None:
        """`begin_at`'s marking of a URL's JSONL: the file rewritten (an
        object store cannot write in place), then open to append again."""
        path = _fs.join(self._log_dir, "metrics.jsonl")
        self._jsonl.flush()
        content = bytearray(_fs.read_bytes(path))
        offsets = _superseded_flags(bytes(content), step)
        if offsets:
            for offset in offsets:
                content[offset:offset + len(_SUPERSEDED)] = _SUPERSEDED
            self._jsonl.close()
            self._jsonl = _fs.replace_to_append(path, bytes(content))

    def run_writer(self, run: str):
        """The summary writer of a TensorBoard run (`train`, `validation`),
        created on first use, as Keras's `TensorBoard` does: a run without
        validation has no `validation` folder.

        Its event writer is traced here, on the caller's thread (the logger
        creates its runs on the training thread, `validation` at the first
        validation), so the writer thread only runs compiled code.
        """
        with self._writers_lock:
            if run in self._writers:
                return self._writers[run][0]
        writer = tf.summary.create_file_writer(
            _fs.join(self._log_dir, run),
            max_queue=10_000, flush_millis=1_000,
        )
        write = _event_writer(writer).get_concrete_function()
        with self._writers_lock:
            return self._writers.setdefault(run, (writer, write))[0]

    def run_writers(self) -> list:
        """The runs' summary writers created so far."""
        with self._writers_lock:
            return [writer for writer, _ in self._writers.values()]

    def _write(self, items: list) -> None:
        records = [r for r in items if not isinstance(r, _Supersede)]
        if not self._jsonl_local:
            lines: list[str] = []
            for item in items:
                if isinstance(item, _Supersede):
                    self._jsonl.write("".join(lines))
                    lines = []
                    self._supersede_url(item.step)
                else:
                    lines.append(json.dumps(item) + "\n")
            self._jsonl.write("".join(lines))
        series = [tensorboard_scalars(r) for r in records]
        by_run: dict[str, tuple[list, list]] = {}
        for entries in series:
            for run, step, values in entries:
                protos, steps = by_run.setdefault(run, ([], []))
                protos.append(_summary_proto(values))
                steps.append(step)
        for run, (protos, steps) in by_run.items():
            self.run_writer(run)  # created already, by the logger
            self._writers[run][1](tf.constant(protos),
                                  tf.constant(steps, tf.int64))
        epoch = any(r["kind"] == "epoch" for r in records)
        # A URL's flush uploads the whole file on object stores: flushed as
        # the events file is (a SIGKILL loses its last second, as it does
        # the events file's).
        now = time.monotonic()
        if not self._jsonl_local and (
                epoch or now - self._jsonl_flushed >= 1.0):
            self._jsonl.flush()
            self._jsonl_flushed = now
        if epoch:
            for writer in self.run_writers():
                writer.flush()
        if self._wandb_run is not None:
            for record, entries in zip(records, series):
                self._wandb_run.log(
                    {f"{run}/{tag}": v for run, _, values in entries
                     for tag, v in values.items() if v is not None},
                    step=record["step"],
                )


# A JSONL record ends with its `superseded` flag (`records.JSONL_KEYS`);
# `true ` takes the place of `false`, so the line keeps its length.
_LIVE_END = b'"superseded": false}'
_SUPERSEDED = b"true "


def _supersede_in_place(path: str, step: int) -> None:
    """Marks a local JSONL file's records past `step`, each flag written
    where it is: a crash leaves every line whole."""
    with open(path, "rb") as f:
        offsets = _superseded_flags(f.read(), step)
    if offsets:
        with open(path, "r+b") as f:
            for offset in offsets:
                f.seek(offset)
                f.write(_SUPERSEDED)


def _superseded_flags(content: bytes, step: int) -> list:
    """The offsets in a JSONL file's `content` of the `false` flags of the
    window and epoch records past `step` not marked yet."""
    offsets: list[int] = []
    start = 0
    while True:
        end = content.find(b"\n", start)
        if end < 0:
            return offsets  # a torn last line is no record
        line = content[start:end]
        if line.endswith(_LIVE_END):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if (isinstance(record, dict)
                    and record.get("kind") in ("window", "epoch")
                    and isinstance(record.get("step"), int)
                    and record["step"] > step):
                offsets.append(end - len(b"false}"))
        start = end + 1


def _close_when_collected(sinks: Sinks) -> None:
    """Closes a dropped logger's outputs. Garbage collection can run this
    while the thread is tracing a function: `init_scope` runs the writers'
    flush and close now, not as ops of that function (where they would run
    later, against writers gone by then)."""
    with tf.init_scope():
        sinks.close()


def _event_writer(writer):
    """One compiled call writes a batch of serialized `Summary` protos, each
    at its own step: one dispatch for any number of records. Always
    recording, whatever `record_if` the thread tracing it is under (the
    logger's own gates the model's summaries)."""

    @tf.function(input_signature=(
        tf.TensorSpec([None], tf.string),
        tf.TensorSpec([None], tf.int64),
    ))
    def write(serialized, steps):
        with writer.as_default(), tf.summary.record_if(True):
            for i in tf.range(tf.size(steps)):
                tf.summary.experimental.write_raw_pb(
                    serialized[i], step=steps[i])

    return write


def _summary_proto(values: dict) -> bytes:
    """A serialized `Summary` of one run's values of a record, as
    `tf.summary.scalar` (and, for a resume marker, `tf.summary.text`) write
    them: a string value is text."""
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.scalar import metadata as scalar_metadata
    from tensorboard.plugins.text import metadata as text_metadata

    summary = summary_pb2.Summary()
    scalar = scalar_metadata.create_summary_metadata(
        display_name=None, description=None)
    text = text_metadata.create_summary_metadata(
        display_name=None, description=None)
    for tag, value in values.items():
        entry = summary.value.add(tag=tag)
        if isinstance(value, str):
            entry.metadata.CopyFrom(text)
            entry.tensor.dtype = 7  # DT_STRING
            entry.tensor.string_val.append(value.encode())
        else:
            entry.metadata.CopyFrom(scalar)
            entry.tensor.dtype = 1  # DT_FLOAT
            entry.tensor.float_val.append(value)
    return summary.SerializeToString()
