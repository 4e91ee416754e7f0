"""A job's goodput from its log: where the wall time of all its attempts went.

`DistributedLogger` puts the attempt's time ledger
(`keras_mgpu.goodput.ledger`) into each record of `LOG_DIR/metrics.jsonl`:
cumulative seconds per category since the attempt started. `read_job` reads the last snapshot
of each attempt (a process: a `keras-mgpu launch` attempt, or a rerun) and
adds what no single attempt can see:

- `redone`: training whose steps a later attempt trained again (records
  marked `superseded` after a resume from an older backup), moved out of
  `productive` and, for its input wait, `input_wait`; and the time a
  failed attempt trained after its last record, until `keras-mgpu launch`
  saw it end.
- `between_attempts`: from one attempt's end to the next one's start (the
  launcher's backoff, a scheduler's requeue, a person rerunning the job).
- `startup` before the first attempt: `keras-mgpu launch`'s own start.

The categories add up to the job's wall time: from its start (the
launcher's, else the first attempt's) to its last attempt's last record.

Standard library only (a log dir at a URL, `gs://...`, is read through
TensorFlow, imported then): `keras-mgpu goodput LOG_DIR` prints this
without TensorFlow.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import textwrap
from typing import Any, Iterable, Optional

from keras_mgpu.goodput.ledger import CATEGORIES

__all__ = ["AttemptGoodput", "GapGoodput", "JobGoodput", "read_job"]

METRICS_FILE = "metrics.jsonl"

# The report's categories, in the table's order: the ledger's, with
# `redone` and `between_attempts`, which only the whole log shows.
REPORT_CATEGORIES = ("productive", "input_wait", "compile", "startup",
                     "restore", "checkpoint", "evaluation", "redone",
                     "between_attempts", "other")
# What a snapshot may hold; anything else (a newer ledger's) is `other`.
_LEDGER_KEYS = frozenset(CATEGORIES) & frozenset(REPORT_CATEGORIES)

# Below this, a difference between a snapshot's categories and its time
# span is float rounding, not a writer's mistake worth a warning.
_TOLERANCE = 0.5


@dataclasses.dataclass
class AttemptGoodput:
    """One attempt of a job: its span and where its seconds went.

    `seconds` has every category of `REPORT_CATEGORIES` and adds up to
    `wall_seconds`, `ended - started`; `redone` is its training that a
    later attempt trained again; `between_attempts` is always 0 here
    (`GapGoodput` holds it).
    """

    index: int  # 1, 2, ... in the order the attempts started
    launch_attempt: Optional[int]  # KERAS_MGPU_ATTEMPT under keras-mgpu launch
    pid: int
    started: float  # unix time the attempt's clock started
    ended: float  # unix time of its last ledger snapshot
    wall_seconds: float
    seconds: dict[str, float]
    steps: Optional[int]  # the largest global step of its records
    replicas: Optional[int] = None  # its last record's replica count


@dataclasses.dataclass
class GapGoodput:
    """Wall time outside every attempt: before the first, or between two.

    `seconds` has every category of `REPORT_CATEGORIES`; only `startup`
    (the launcher's own start), `redone` (a failed attempt's training after
    its last record) and `between_attempts` can be non-zero.
    """

    after: Optional[int]  # the attempt before the gap; None: the job's start
    before: int  # the attempt after it
    started: float
    ended: float
    seconds: dict[str, float]


@dataclasses.dataclass
class JobGoodput:
    """A job's wall time by category, over all its attempts (`read_job`).

    `seconds` adds up to `wall_seconds`, `ended - started` (unless
    `warnings` says why not: attempts that overlap); `share` is each
    category's part of it, and `goodput` the `productive` one.
    """

    log_dir: str
    started: float  # the launcher's start, else the first attempt's
    ended: float  # the last attempt's last snapshot
    wall_seconds: float
    goodput: float  # productive / wall_seconds
    seconds: dict[str, float]  # in `REPORT_CATEGORIES`' order
    share: dict[str, float]  # seconds / wall_seconds
    attempts: list[AttemptGoodput]  # in the order they started
    gaps: list[GapGoodput]  # in time order
    warnings: list[str]  # what the log got wrong, and how it was counted

    def to_dict(self) -> dict[str, Any]:
        """The report as plain values (what `--json` writes).

        Returns:
            `{"log_dir", "started", "ended", "wall_seconds", "goodput",
            "seconds", "share", "attempts", "gaps", "warnings"}`, each
            attempt and gap a dict of its fields; durations rounded to the
            millisecond, shares to 6 digits (unix times as read).
        """
        payload = dataclasses.asdict(self)
        for part in [payload] + payload["attempts"] + payload["gaps"]:
            part["seconds"] = {key: round(value, 3)
                               for key, value in part["seconds"].items()}
            if "wall_seconds" in part:
                part["wall_seconds"] = round(part["wall_seconds"], 3)
        payload["share"] = {key: round(value, 6)
                            for key, value in self.share.items()}
        payload["goodput"] = round(self.goodput, 6)
        return payload

    def to_json(self, indent: Optional[int] = 2) -> str:
        """`to_dict()` as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    def table(self) -> str:
        """The report as text of at most 80 columns: the categories, the
        goodput, a line per attempt and gap, the warnings."""
        return _table(self)


def read_job(log_dir: str) -> JobGoodput:
    """Reads a job's goodput: its wall time by category over all attempts.

    Each attempt's last ledger snapshot in `LOG_DIR/metrics.jsonl` gives
    its categories; training that a later attempt redid (its `superseded`
    records) is moved from `productive` (their input wait from
    `input_wait`) to `redone`; the time between
    attempts is `between_attempts`, less the failed attempt's training
    after its last record where `keras-mgpu launch` saw it end (`redone`).
    A last line cut short (a process killed while writing it) is skipped.

    Args:
        log_dir: The `DistributedLogger`'s `log_dir`: a local folder (or
            its `metrics.jsonl`) or a `tf.io.gfile` URL (`gs://...`, read
            through TensorFlow).

    Returns:
        A `JobGoodput`.

    Raises:
        FileNotFoundError: no such folder, or no `metrics.jsonl` in it.
        OSError: the file could not be read.
        ValueError: the file holds no goodput records (written by an older
            keras-mgpu, or not by `DistributedLogger`).

    Example:

    >>> import json, os, shutil, tempfile
    >>> log_dir = tempfile.mkdtemp()
    >>> seconds = dict.fromkeys(CATEGORIES, 0.0)
    >>> seconds.update(startup=10.0, compile=5.0, productive=80.0,
    ...                other=5.0)
    >>> attempt = {"started": 1000.0, "pid": 42, "launch_attempt": None,
    ...            "job_started": None, "previous_ended": None}
    >>> record = {"kind": "epoch", "time": 1100.0, "step": 500,
    ...           "seconds": 85.0, "superseded": False,
    ...           "goodput": {"time": 1100.0, "attempt": attempt,
    ...                       "seconds": seconds}}
    >>> with open(os.path.join(log_dir, "metrics.jsonl"), "w") as f:
    ...     print(json.dumps(record), file=f)
    >>> job = read_job(log_dir)
    >>> job.wall_seconds, job.goodput, job.attempts[0].steps
    (100.0, 0.8, 500)
    >>> shutil.rmtree(log_dir)
    """
    path, lines = _read_lines(log_dir)
    warnings: list = []
    records = _parse(lines, path, warnings)
    attempts = _attempts(records, path, warnings)
    if not attempts:
        raise ValueError(
            f"no goodput records in {path}: it was written by a keras-mgpu "
            "older than its goodput ledger, or not by DistributedLogger. "
            "Train with a current keras-mgpu and "
            "keras_mgpu.DistributedLogger(log_dir=...), then read that "
            "log_dir.")
    return _job(log_dir, attempts, warnings)


# --- Reading ---------------------------------------------------------------


def _read_lines(log_dir: str) -> tuple:
    """`(path, lines)` of `log_dir`'s metrics file."""
    if "://" in log_dir:
        return _read_url(log_dir)
    path = os.path.join(log_dir, METRICS_FILE)
    if os.path.isfile(log_dir) and os.path.basename(log_dir) == METRICS_FILE:
        # The file itself, as a user may well name it.
        path = log_dir
    elif not os.path.isdir(log_dir):
        raise _not_a_folder(log_dir, os.path.exists(log_dir))
    if not os.path.exists(path):
        raise _no_metrics(log_dir)
    with open(path, "rb") as f:
        return path, f.read().split(b"\n")


def _not_a_folder(log_dir: str, exists: bool) -> FileNotFoundError:
    return FileNotFoundError(
        f"{log_dir} is not a folder" + ("" if exists else " (no such path)")
        + ": give the log_dir of the job's DistributedLogger.")


def _no_metrics(log_dir: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"no {METRICS_FILE} in {log_dir}: give the log_dir of the job's "
        "keras_mgpu.DistributedLogger(log_dir=...), which writes it.")


def _read_url(log_dir: str) -> tuple:
    # TensorFlow's file systems, only for a URL: 3-8 s to import.
    from keras_mgpu import _fs

    path = _fs.join(log_dir, METRICS_FILE)
    try:
        if not _fs.isdir(log_dir):
            raise _not_a_folder(log_dir, exists=False)
        if not _fs.exists(path):
            raise _no_metrics(log_dir)
        return path, _fs.read_bytes(path).split(b"\n")
    except _fs.ERRORS as e:
        if isinstance(e, OSError):
            raise
        raise OSError(f"cannot read {path}: {e}") from None


def _parse(lines: list, path: str, warnings: list) -> list:
    """The records (dicts) of the file's lines."""
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    records = []
    for i, (number, line) in enumerate(numbered):
        try:
            record = json.loads(line)
        except ValueError:
            # A process killed while writing leaves its last line torn.
            if i < len(numbered) - 1:
                warnings.append(f"line {number} of {path} is not JSON: "
                                "skipped.")
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            warnings.append(f"line {number} of {path} is not a record: "
                            "skipped.")
    return records


def _number(value: Any) -> Optional[float]:
    """`value` as a finite float; None for anything else (bools too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


@dataclasses.dataclass
class _Attempt:
    started: float
    pid: int
    ended: float
    info: dict  # the snapshot's "attempt"
    seconds: dict  # the ledger's categories at `ended`
    records: list = dataclasses.field(default_factory=list)


def _snapshot(record: dict) -> Optional[tuple]:
    """`(key, time, attempt, seconds)` of a record's goodput snapshot;
    None if it has none; ValueError if it is malformed."""
    snapshot = record.get("goodput")
    if snapshot is None:
        return None
    if not isinstance(snapshot, dict):
        raise ValueError("its goodput is not an object")
    attempt, seconds = snapshot.get("attempt"), snapshot.get("seconds")
    time = _number(snapshot.get("time"))
    if not isinstance(attempt, dict) or not isinstance(seconds, dict):
        raise ValueError("its goodput has no attempt or seconds")
    started = _number(attempt.get("started"))
    pid = attempt.get("pid")
    if time is None or started is None or not isinstance(pid, int):
        raise ValueError("its goodput has no time, attempt.started or "
                         "attempt.pid")
    values = {}
    for key, value in seconds.items():
        number = _number(value)
        if number is None:
            raise ValueError(f"its goodput seconds[{key!r}] is not a number")
        values[key] = number
    return (started, pid), time, attempt, values


def _attempts(records: list, path: str, warnings: list) -> list:
    """The attempts, in the order they started, each with its records."""
    by_key: dict = {}
    keys: list = []
    unknown: set = set()
    for record in records:
        try:
            found = _snapshot(record)
        except ValueError as e:
            warnings.append(f"a record of {path} at time "
                            f"{record.get('time')} is skipped: {e}.")
            keys.append(None)
            continue
        if found is None:
            keys.append(None)
            continue
        key, time, info, seconds = found
        keys.append(key)
        unknown.update(set(seconds) - _LEDGER_KEYS)
        current = by_key.get(key)
        # The attempt's end: its latest snapshot, wherever in the file.
        if current is None or time >= current.ended:
            by_key[key] = _Attempt(key[0], key[1], time, info, seconds)
    if unknown:
        warnings.append(f"categories unknown to this keras-mgpu "
                        f"({', '.join(sorted(unknown))}) are counted as "
                        "other: read the log with the keras-mgpu that "
                        "wrote it.")
    attempts = sorted(by_key.values(), key=lambda a: (a.started, a.pid))
    for record, key in zip(records, keys):
        if key is not None:
            by_key[key].records.append(record)
            continue
        # A record without a snapshot belongs to the attempt running then.
        time = _number(record.get("time"))
        for attempt in attempts:
            if time is not None and attempt.started <= time <= attempt.ended:
                attempt.records.append(record)
                break
    return attempts


# --- Computing ---------------------------------------------------------------


def _zero() -> dict:
    return dict.fromkeys(REPORT_CATEGORIES, 0.0)


def _ledger_seconds(attempt: _Attempt, index: int, warnings: list) -> dict:
    """The attempt's snapshot as report categories adding up to its span
    (a difference counted as `other`)."""
    seconds = _zero()
    for key, value in attempt.seconds.items():
        seconds[key if key in _LEDGER_KEYS else "other"] += max(value, 0.0)
    wall = attempt.ended - attempt.started
    difference = wall - sum(seconds.values())
    if abs(difference) > _TOLERANCE:
        warnings.append(
            f"attempt {index}: its categories add up to "
            f"{sum(seconds.values()):.1f} s, not the {wall:.1f} s from its "
            f"start to its last record; the difference is counted as "
            "other.")
    seconds["other"] = max(seconds["other"] + difference, 0.0)
    return seconds


def _redone_records(records: list) -> list:
    """The superseded records whose seconds were trained again: the
    windows (an epoch's seconds are its windows' too), else the epochs
    (`update_freq="epoch"` writes no windows)."""
    windows = [r for r in records if r.get("kind") == "window"]
    chosen = windows or [r for r in records if r.get("kind") == "epoch"]
    return [r for r in chosen if r.get("superseded") is True]


def _move_redone(seconds: dict, records: list, index: int,
                 warnings: list) -> None:
    """Moves the seconds of redone steps to `redone`, so the attempt's
    total stays: their input wait (each record's `input_wait` share) from
    `input_wait`, the rest from `productive`; what those hold too little
    of from what is left of either, then from `other`."""
    total = wait = 0.0
    for record in records:
        spent = _number(record.get("seconds"))
        if spent is None or spent <= 0:
            continue
        share = _number(record.get("input_wait")) or 0.0
        total += spent
        wait += spent * min(max(share, 0.0), 1.0)

    def move(source: str, wanted: float) -> float:
        taken = min(wanted, seconds[source])
        seconds[source] -= taken
        seconds["redone"] += taken
        return wanted - taken

    missing = move("input_wait", wait) + move("productive", total - wait)
    for source in ("productive", "input_wait", "other"):
        missing = move(source, missing)
    if missing > _TOLERANCE:
        warnings.append(
            f"attempt {index}: its superseded records span {total:.1f} s, "
            f"{missing:.1f} s more than its training and other time: "
            "redone counts what there was.")


def _integers(records: list, key: str) -> list:
    """The records' integer values of `key`, in their order."""
    values = [r.get(key) for r in records]
    return [v for v in values if isinstance(v, int) and not isinstance(
        v, bool)]


def _replicas(records: list) -> Optional[int]:
    found = _integers(records, "replicas")
    return found[-1] if found else None


def _steps(records: list) -> Optional[int]:
    found = _integers(records, "step")
    return max(found) if found else None


def _gap(previous: Optional[_Attempt], attempt: _Attempt, after: int,
         warnings: list) -> Optional[GapGoodput]:
    """The wall time between `previous` (None: the job's start) and
    `attempt`, attempt `after + 1`."""
    info = attempt.info
    job_started = _number(info.get("job_started"))
    seconds = _zero()
    if previous is None:
        if job_started is None or job_started == attempt.started:
            return None
        if job_started > attempt.started:
            warnings.append(
                f"attempt 1 started {job_started - attempt.started:.1f} s "
                "before its launcher did (clock skew?): the launcher's "
                "start counts as 0.")
            return None
        seconds["startup"] = attempt.started - job_started
        return GapGoodput(None, 1, job_started, attempt.started, seconds)
    start, end = previous.ended, attempt.started
    gap = end - start
    if gap < 0:
        warnings.append(
            f"attempt {after + 1} started {-gap:.1f} s before attempt "
            f"{after}'s last record (clock skew, or two runs writing one "
            "log dir?): the gap between them counts as 0, so the wall "
            "time adds up the attempts rather than spanning them.")
        return GapGoodput(after, after + 1, start, start, seconds)
    previous_ended = _number(info.get("previous_ended"))
    tail = 0.0
    if previous_ended is not None:
        if not start <= previous_ended <= end:
            warnings.append(
                f"the launcher saw attempt {after} end at "
                f"{_iso(previous_ended)}, outside the time from its last "
                f"record to attempt {after + 1}'s start (clock skew?): "
                "clamped to it.")
        # Trained after its last record until the launcher saw it end.
        tail = min(max(previous_ended - start, 0.0), gap)
    elif (job_started is not None and start < job_started <= end
          and job_started != _number(previous.info.get("job_started"))):
        # A new `keras-mgpu launch` of the same job: its own start.
        seconds["startup"] = end - job_started
    seconds["redone"] = tail
    seconds["between_attempts"] = gap - tail - seconds["startup"]
    return GapGoodput(after, after + 1, start, end, seconds)


def _job(log_dir: str, found: list, warnings: list) -> JobGoodput:
    attempts, gaps = [], []
    previous = None
    for index, attempt in enumerate(found, 1):
        gap = _gap(previous, attempt, index - 1, warnings)
        if gap is not None:
            gaps.append(gap)
        seconds = _ledger_seconds(attempt, index, warnings)
        _move_redone(seconds, _redone_records(attempt.records), index,
                     warnings)
        launch_attempt = attempt.info.get("launch_attempt")
        attempts.append(AttemptGoodput(
            index=index,
            launch_attempt=(launch_attempt if isinstance(launch_attempt, int)
                            else None),
            pid=attempt.pid, started=attempt.started, ended=attempt.ended,
            wall_seconds=sum(seconds.values()), seconds=seconds,
            steps=_steps(attempt.records),
            replicas=_replicas(attempt.records)))
        previous = attempt
    totals = _categories(attempts + gaps)
    wall = sum(totals.values())
    started = gaps[0].started if gaps and gaps[0].after is None else (
        attempts[0].started)
    if wall <= 0:
        warnings.append("the log spans no time (one snapshot at the "
                        "attempt's start): no shares.")
    share = {key: value / wall if wall > 0 else 0.0
             for key, value in totals.items()}
    return JobGoodput(
        log_dir=log_dir, started=started,
        ended=max(a.ended for a in attempts),
        wall_seconds=wall, goodput=share["productive"], seconds=totals,
        share=share, attempts=attempts, gaps=gaps, warnings=warnings)


# --- The table ------------------------------------------------------------


def _iso(t: float) -> str:
    """A unix time as UTC ISO 8601, to the second."""
    moment = datetime.datetime.fromtimestamp(t, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _duration(seconds: float) -> str:
    """`seconds` for a reader: `12.3 s`, `4m 05s`, `2h 03m`."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def _wrap(text: str, width: int = 80, indent: str = "  ") -> list:
    return textwrap.wrap(text, width, subsequent_indent=indent)


def _table(job: JobGoodput) -> str:
    restarts = len(job.attempts) - 1
    out = [f"keras-mgpu goodput: {job.log_dir}",
           f"{len(job.attempts)} attempt{'s' if restarts else ''}, "
           f"{_iso(job.started)} to {_iso(job.ended)}", ""]
    header = f"{'category':<18}{'seconds':>12}{'share':>9}  {'time':>8}"
    out += [header, "-" * len(header)]

    def row(name: str, seconds: float, share: float) -> str:
        return (f"{name:<18}{seconds:>12,.1f}{share:>9.1%}  "
                f"{_duration(seconds):>8}")

    for key in REPORT_CATEGORIES:
        out.append(row(key.replace("_", " "), job.seconds[key],
                       job.share[key]))
    out += ["-" * len(header),
            row("wall", job.wall_seconds, 1.0 if job.wall_seconds else 0.0),
            "", f"goodput: {job.goodput:.1%} of the wall time was "
                "productive training", ""]
    out.append(f"{'attempt':>7} {'launch':>6}  {'started (UTC)':<20}  "
               f"{'wall s':>10} {'productive s':>12} {'redone s':>9} "
               f"{'steps':>7}")
    gaps = {g.before: g for g in job.gaps}
    replicas = None
    for attempt in job.attempts:
        gap = gaps.get(attempt.index)
        if gap is not None:
            out += _gap_line(gap)
        if None not in (replicas, attempt.replicas) and (
                attempt.replicas != replicas):
            # A scale event: `keras-mgpu launch --min-workers` went on
            # with fewer workers, or the job was rerun on another count.
            out += _wrap(f"{'':>7} from attempt {attempt.index}: "
                         f"{attempt.replicas} replicas ({replicas} before)",
                         indent=" " * 10)
        replicas = attempt.replicas if attempt.replicas is not None else (
            replicas)
        launch = ("-" if attempt.launch_attempt is None
                  else str(attempt.launch_attempt))
        steps = "-" if attempt.steps is None else str(attempt.steps)
        out.append(f"{attempt.index:>7} {launch:>6}  "
                   f"{_iso(attempt.started):<20}  "
                   f"{attempt.wall_seconds:>10,.1f} "
                   f"{attempt.seconds['productive']:>12,.1f} "
                   f"{attempt.seconds['redone']:>9,.1f} {steps:>7}")
    for warning in job.warnings:
        out += _wrap(f"WARNING: {warning}")
    return "\n".join(out)


def _gap_line(gap: GapGoodput) -> list:
    parts = [f"{gap.seconds[key]:,.1f} s {text}" for key, text in (
        ("startup", "launcher start"),
        ("redone", "redone"),
        ("between_attempts", "between attempts")) if gap.seconds[key] > 0]
    where = ("before attempt 1" if gap.after is None
             else f"after attempt {gap.after}")
    return _wrap(f"{'':>7} {where}: " + (", ".join(parts) or "none"),
                 indent=" " * 10)


def _categories(parts: Iterable[Any]) -> dict:
    totals = _zero()
    for part in parts:
        for key, value in part.seconds.items():
            totals[key] += value
    return totals
