"""The chief's outputs of `DistributedLogger`: JSONL, TensorBoard and wandb,
written in order by one background thread."""

from __future__ import annotations

import json
import os
import queue
import threading
from typing import Optional

import tensorflow as tf


class Sinks:
    """The chief's outputs, written in order by one background thread.

    Training only queues records. The thread takes every record waiting
    and writes them together: JSONL lines in one write, TensorBoard events
    in one compiled call, then wandb. A failed write is raised on the
    training thread at the next `submit` or at `close`.
    """

    def __init__(self, log_dir: str, wandb_config: Optional[dict]):
        os.makedirs(log_dir, exist_ok=True)
        # A flush syncs the file (fsync). By default the writer syncs every
        # 10 events: with a record's ~20 scalars, two fsyncs per window.
        # Sync at most every second and after every epoch record instead.
        self._writer = tf.summary.create_file_writer(
            os.path.join(log_dir, "train"),
            max_queue=10_000, flush_millis=1_000,
        )
        self._write_events = _event_writer(self._writer)
        self._jsonl = _open_jsonl(os.path.join(log_dir, "metrics.jsonl"))
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
            # The cause in the message too: Keras's traceback filtering
            # drops the chained exception.
            raise RuntimeError(
                f"DistributedLogger could not write its records: "
                f"{type(error).__name__}: {error}"
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
            tf.constant([_summary_proto(r, s)
                         for r, s in zip(records, scalars)]),
            tf.constant([r["epoch"] if r["kind"] == "epoch" else r["step"]
                         for r in records], tf.int64),
        )
        # JSONL lines reach the file before the next records are taken (no
        # sync: cheap), so a SIGKILL loses only records still queued; the
        # events file, at most its last second.
        self._jsonl.flush()
        if any(r["kind"] == "epoch" for r in records):
            self._writer.flush()
        if self._wandb_run is not None:
            for record, values in zip(records, scalars):
                self._wandb_run.log(
                    {f"{record['kind']}/{tag}": v
                     for tag, v in values.items()},
                    step=record["step"],
                )


def _open_jsonl(path: str):
    """Opens the JSONL file for appending, after a newline if a killed run
    left a torn last line (so only that line is unreadable)."""
    jsonl = open(path, "a+b")
    if jsonl.tell():
        jsonl.seek(-1, os.SEEK_END)
        if jsonl.read(1) != b"\n":
            jsonl.write(b"\n")
    jsonl.close()
    return open(path, "a")


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


def _summary_proto(record: dict, scalars: dict) -> bytes:
    """A serialized `Summary` of a record, as `tf.summary.scalar` (and, for a
    resume marker, `tf.summary.text`) write them."""
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.scalar import metadata as scalar_metadata
    from tensorboard.plugins.text import metadata as text_metadata

    summary = summary_pb2.Summary()
    if record["kind"] == "resume":
        entry = summary.value.add(tag="resume")
        entry.metadata.CopyFrom(text_metadata.create_summary_metadata(
            display_name=None, description=None))
        entry.tensor.dtype = 7  # DT_STRING
        entry.tensor.string_val.append(record["resume"]["text"].encode())
        return summary.SerializeToString()
    metadata = scalar_metadata.create_summary_metadata(
        display_name=None, description=None)
    for tag, value in scalars.items():
        entry = summary.value.add(tag=f"{record['kind']}/{tag}")
        entry.metadata.CopyFrom(metadata)
        entry.tensor.dtype = 1  # DT_FLOAT
        entry.tensor.float_val.append(value)
    return summary.SerializeToString()


def _scalars(record: dict, prefix: str = "") -> dict:
    """The numeric leaves of a record, keyed by their path."""
    out = {}
    for key, value in record.items():
        if key in ("kind", "epoch", "step", "time", "resume"):
            continue
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_scalars(value, f"{tag}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[tag] = float(value)
    return out
