"""The goodput report: `keras_mgpu.goodput.read_job` and `keras-mgpu goodput`.

Each test writes a real `metrics.jsonl` (every key of a `DistributedLogger`
record) and checks the report against figures worked out by hand: the
categories of each attempt, the training a later attempt redid, the time
between attempts, and that they add up to the job's wall time. The command
runs as a user runs it, in a child process, without TensorFlow.
"""

import ast
import json
import os
import subprocess
import sys
import textwrap

import pytest

from keras_mgpu.callbacks.telemetry.records import JSONL_KEYS
from keras_mgpu.goodput import read_job
from keras_mgpu.goodput import report
from keras_mgpu.goodput.ledger import CATEGORIES
from tests.conftest import allow_in_children
from tests.test_cli import console_script
from tests.test_cli import imported_modules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
KEYS = list(JSONL_KEYS)  # as the logger writes them
ORDER = ["productive", "input_wait", "compile", "startup", "restore",
         "checkpoint", "evaluation", "redone", "between_attempts", "other"]


def record(kind, time, step=None, seconds=None, input_wait=None,
           superseded=False, goodput=None, replicas=None):
    values = dict.fromkeys(KEYS, None)
    values.update(kind=kind, time=time, step=step, seconds=seconds,
                  input_wait=input_wait, superseded=superseded,
                  goodput=goodput, replicas=replicas)
    return values


def snapshot(time, started, pid, launch_attempt=None, job_started=None,
             previous_ended=None, **seconds):
    """A ledger snapshot; the seconds given must add up to its span."""
    values = dict.fromkeys(CATEGORIES, 0.0)
    values.update(seconds)
    assert sum(values.values()) == pytest.approx(time - started)
    return {"time": time,
            "attempt": {"started": started, "pid": pid,
                        "launch_attempt": launch_attempt,
                        "job_started": job_started,
                        "previous_ended": previous_ended},
            "seconds": values}


def write(folder, records, tail=""):
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.write(tail)
    return str(folder)


def categories(**seconds):
    values = dict.fromkeys(ORDER, 0.0)
    values.update(seconds)
    return values


def check_sums(job):
    """The categories add up, per attempt, per gap and for the job."""
    assert list(job.seconds) == ORDER
    assert sum(job.seconds.values()) == pytest.approx(job.wall_seconds)
    assert job.wall_seconds == pytest.approx(job.ended - job.started)
    for attempt in job.attempts:
        assert sum(attempt.seconds.values()) == pytest.approx(
            attempt.ended - attempt.started)
    parts = job.attempts + job.gaps
    for key in ORDER:
        assert sum(p.seconds[key] for p in parts) == pytest.approx(
            job.seconds[key])
    assert sum(job.share.values()) == pytest.approx(1.0)


# --- One attempt --------------------------------------------------------------


def one_attempt(folder, tail=""):
    return write(folder, [
        record("window", 1050.0, step=100, seconds=40.0, input_wait=0.05,
               goodput=snapshot(1050.0, 1000.0, 7, startup=5.0, compile=3.0,
                                productive=38.0, input_wait=2.0,
                                other=2.0)),
        record("epoch", 1100.0, step=200, seconds=80.0,
               goodput=snapshot(1100.0, 1000.0, 7, startup=5.0, compile=3.0,
                                productive=76.0, input_wait=4.0,
                                checkpoint=6.0, evaluation=4.0, other=2.0)),
    ], tail)


def test_one_attempt(tmp_path):
    job = read_job(one_attempt(tmp_path))
    assert job.seconds == pytest.approx(categories(
        productive=76.0, input_wait=4.0, compile=3.0, startup=5.0,
        checkpoint=6.0, evaluation=4.0, other=2.0))
    assert job.wall_seconds == pytest.approx(100.0)
    assert job.goodput == pytest.approx(0.76)
    assert job.share["checkpoint"] == pytest.approx(0.06)
    assert (job.started, job.ended) == (1000.0, 1100.0)
    [attempt] = job.attempts
    assert (attempt.index, attempt.pid, attempt.launch_attempt,
            attempt.steps) == (1, 7, None, 200)
    assert (attempt.started, attempt.ended, attempt.wall_seconds) == (
        1000.0, 1100.0, pytest.approx(100.0))
    assert job.gaps == [] and job.warnings == []
    check_sums(job)
    # The file named instead of its folder: the same.
    assert read_job(str(tmp_path / "metrics.jsonl")).seconds == job.seconds


# --- Two attempts --------------------------------------------------------------


def two_attempts(folder):
    """Attempt 1 (pid 1) from 1000 to 1090, whose second window (30 s, 20%
    of it input wait) attempt 2 (pid 2, 1100 to 1200) trained again."""
    return write(folder, [
        record("window", 1040.0, step=100, seconds=30.0, input_wait=0.1,
               goodput=snapshot(1040.0, 1000.0, 1, startup=10.0,
                                compile=5.0, productive=22.0,
                                input_wait=3.0)),
        record("window", 1080.0, step=200, seconds=30.0, input_wait=0.2,
               superseded=True,
               goodput=snapshot(1080.0, 1000.0, 1, startup=10.0,
                                compile=5.0, productive=46.0,
                                input_wait=9.0, checkpoint=4.0,
                                other=6.0)),
        # Its epoch's seconds are its windows': not counted again.
        record("epoch", 1090.0, step=200, seconds=60.0, superseded=True,
               goodput=snapshot(1090.0, 1000.0, 1, startup=10.0,
                                compile=5.0, productive=60.0,
                                input_wait=6.0, checkpoint=4.0,
                                other=5.0)),
        record("resume", 1108.0, step=100,
               goodput=snapshot(1108.0, 1100.0, 2, startup=5.0,
                                restore=3.0)),
        record("window", 1200.0, step=300, seconds=80.0, input_wait=0.05,
               goodput=snapshot(1200.0, 1100.0, 2, startup=8.0,
                                compile=4.0, restore=3.0, productive=70.0,
                                input_wait=5.0, other=10.0)),
    ])


def test_two_attempts_redone_and_between(tmp_path):
    job = read_job(two_attempts(tmp_path))
    first, second = job.attempts
    # 30 s redone: its 6 s input wait (20%) and 24 s of productive.
    assert first.seconds == pytest.approx(categories(
        productive=36.0, input_wait=0.0, compile=5.0, startup=10.0,
        checkpoint=4.0, redone=30.0, other=5.0))
    assert first.steps == 200 and first.wall_seconds == pytest.approx(90.0)
    assert second.seconds == pytest.approx(categories(
        productive=70.0, input_wait=5.0, compile=4.0, startup=8.0,
        restore=3.0, other=10.0))
    assert (second.index, second.pid, second.steps) == (2, 2, 300)
    [gap] = job.gaps
    assert (gap.after, gap.before, gap.started, gap.ended) == (
        1, 2, 1090.0, 1100.0)
    assert gap.seconds == pytest.approx(categories(between_attempts=10.0))
    assert job.seconds == pytest.approx(categories(
        productive=106.0, input_wait=5.0, compile=9.0, startup=18.0,
        restore=3.0, checkpoint=4.0, redone=30.0, between_attempts=10.0,
        other=15.0))
    assert job.wall_seconds == pytest.approx(200.0)
    assert job.goodput == pytest.approx(0.53)
    assert job.warnings == []
    check_sums(job)


def test_the_attempts_are_sorted_by_their_start(tmp_path):
    # The same records, the second attempt's first in the file.
    path = two_attempts(tmp_path)
    with open(os.path.join(path, "metrics.jsonl")) as f:
        lines = f.readlines()
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(lines[3:] + lines[:3])
    job = read_job(path)
    assert [a.pid for a in job.attempts] == [1, 2]
    assert job.seconds["redone"] == pytest.approx(30.0)
    assert job.seconds["between_attempts"] == pytest.approx(10.0)


def test_two_attempts_under_launch(tmp_path):
    # The launcher started at 990 and saw attempt 1 end at 1110, 10 s
    # after its last record; attempt 2 started at 1130.
    path = write(tmp_path, [
        record("window", 1100.0, step=50, seconds=80.0,
               goodput=snapshot(1100.0, 1000.0, 11, launch_attempt=1,
                                job_started=990.0, startup=10.0,
                                compile=5.0, productive=80.0, other=5.0)),
        record("window", 1230.0, step=120, seconds=90.0,
               goodput=snapshot(1230.0, 1130.0, 12, launch_attempt=2,
                                job_started=990.0, previous_ended=1110.0,
                                startup=6.0, restore=4.0,
                                productive=90.0)),
    ])
    job = read_job(path)
    assert [(g.after, g.before) for g in job.gaps] == [(None, 1), (1, 2)]
    launcher, restart = job.gaps
    assert (launcher.started, launcher.ended) == (990.0, 1000.0)
    assert launcher.seconds == pytest.approx(categories(startup=10.0))
    assert restart.seconds == pytest.approx(categories(
        redone=10.0, between_attempts=20.0))
    assert [a.launch_attempt for a in job.attempts] == [1, 2]
    assert job.seconds == pytest.approx(categories(
        productive=170.0, compile=5.0, startup=26.0, restore=4.0,
        redone=10.0, between_attempts=20.0, other=5.0))
    assert (job.started, job.ended) == (990.0, 1230.0)
    assert job.wall_seconds == pytest.approx(240.0)
    assert job.goodput == pytest.approx(170.0 / 240.0)
    assert job.warnings == []
    check_sums(job)


def test_an_attempt_on_fewer_replicas_is_a_scale_event(tmp_path):
    # Attempt 2 of a launch went on with 2 workers of 3.
    path = write(tmp_path, [
        record("window", 1100.0, step=50, seconds=80.0, replicas=3,
               goodput=snapshot(1100.0, 1000.0, 11, launch_attempt=1,
                                startup=10.0, compile=5.0, productive=80.0,
                                other=5.0)),
        record("window", 1230.0, step=120, seconds=90.0, replicas=2,
               goodput=snapshot(1230.0, 1130.0, 12, launch_attempt=2,
                                startup=6.0, restore=4.0,
                                productive=90.0)),
    ])
    job = read_job(path)
    assert [a.replicas for a in job.attempts] == [3, 2]
    lines = job.table().splitlines()
    first = next(i for i, line in enumerate(lines)
                 if line.split()[:2] == ["1", "1"])
    assert lines[first + 2].split() == [
        "from", "attempt", "2:", "2", "replicas", "(3", "before)"]
    assert lines[first + 3].split()[:2] == ["2", "2"]
    check_sums(job)


def test_a_new_launch_of_the_job_starts_in_the_gap(tmp_path):
    # Rerun by hand with a new `keras-mgpu launch` at 1150: its start is
    # startup, the rest of the gap between attempts.
    path = write(tmp_path, [
        record("window", 1100.0, step=50, seconds=90.0,
               goodput=snapshot(1100.0, 1000.0, 11, launch_attempt=1,
                                job_started=1000.0, productive=100.0)),
        record("window", 1260.0, step=100, seconds=90.0,
               goodput=snapshot(1260.0, 1160.0, 31, launch_attempt=1,
                                job_started=1150.0, productive=100.0)),
    ])
    job = read_job(path)
    assert [g.after for g in job.gaps] == [1]  # none before attempt 1
    assert job.gaps[0].seconds == pytest.approx(categories(
        startup=10.0, between_attempts=50.0))
    assert job.wall_seconds == pytest.approx(260.0)
    check_sums(job)


def test_an_attempt_with_epoch_records_only(tmp_path):
    # update_freq="epoch": the superseded epoch is what was redone.
    path = write(tmp_path, [
        record("epoch", 1050.0, step=10, seconds=40.0,
               goodput=snapshot(1050.0, 1000.0, 1, startup=10.0,
                                productive=40.0)),
        record("epoch", 1090.0, step=20, seconds=35.0, superseded=True,
               goodput=snapshot(1090.0, 1000.0, 1, startup=10.0,
                                productive=80.0)),
        record("goodput", 1100.0, step=20,
               goodput=snapshot(1100.0, 1000.0, 1, startup=10.0,
                                productive=80.0, other=10.0)),
        record("epoch", 1150.0, step=30, seconds=50.0,
               goodput=snapshot(1150.0, 1100.0, 2, productive=50.0)),
    ])
    job = read_job(path)
    first, second = job.attempts
    assert first.ended == 1100.0  # its latest snapshot
    assert first.seconds == pytest.approx(categories(
        startup=10.0, productive=45.0, redone=35.0, other=10.0))
    assert job.gaps[0].seconds == pytest.approx(categories())
    assert job.seconds == pytest.approx(categories(
        productive=95.0, startup=10.0, redone=35.0, other=10.0))
    assert job.wall_seconds == pytest.approx(150.0)
    check_sums(job)


def test_redone_beyond_productive_comes_from_input_wait_then_other(
        tmp_path):
    path = write(tmp_path, [
        record("window", 1040.0, step=10, seconds=25.0, input_wait=0.0,
               superseded=True,
               goodput=snapshot(1040.0, 1000.0, 1, startup=5.0,
                                productive=10.0, input_wait=5.0,
                                other=20.0)),
    ])
    job = read_job(path)
    assert job.attempts[0].seconds == pytest.approx(categories(
        startup=5.0, redone=25.0, other=10.0))
    assert job.goodput == 0.0
    check_sums(job)


# --- What the file may hold ------------------------------------------------------


def test_a_torn_last_line_is_skipped(tmp_path):
    path = one_attempt(tmp_path, tail='{"kind": "window", "time": 11')
    job = read_job(path)
    assert job.wall_seconds == pytest.approx(100.0)
    assert job.goodput == pytest.approx(0.76)
    assert job.warnings == []


def test_a_torn_line_inside_the_file_is_a_warning(tmp_path):
    path = one_attempt(tmp_path)
    with open(os.path.join(path, "metrics.jsonl")) as f:
        lines = f.readlines()
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines([lines[0], '{"kind": "wind\n', lines[1]])
    job = read_job(path)
    assert job.goodput == pytest.approx(0.76)
    assert job.warnings == [
        f"line 2 of {path}/metrics.jsonl is not JSON: skipped."]


def test_lines_without_goodput_are_read_for_steps_and_redone(tmp_path):
    # An older keras-mgpu's records before the job, and a record whose
    # snapshot is null inside the attempt: its superseded window is redone.
    old = record("window", 500.0, step=5000, seconds=10.0)
    del old["goodput"]
    path = write(tmp_path, [
        old,
        record("window", 1040.0, step=40, seconds=30.0, superseded=True),
        record("window", 1100.0, step=80, seconds=50.0,
               goodput=snapshot(1100.0, 1000.0, 3, startup=10.0,
                                productive=85.0, other=5.0)),
    ])
    job = read_job(path)
    [attempt] = job.attempts
    assert attempt.steps == 80
    assert attempt.seconds == pytest.approx(categories(
        startup=10.0, productive=55.0, redone=30.0, other=5.0))
    assert (job.started, job.wall_seconds) == (1000.0, pytest.approx(100.0))


def test_no_goodput_records_is_an_error_naming_the_file(tmp_path):
    write(tmp_path, [record("window", 1040.0, step=40, seconds=30.0),
                     record("epoch", 1050.0, step=40, seconds=40.0)])
    with pytest.raises(ValueError) as e:
        read_job(str(tmp_path))
    message = str(e.value)
    assert message.startswith(
        f"no goodput records in {tmp_path}/metrics.jsonl: it was written "
        "by a keras-mgpu older than its goodput ledger, or not by "
        "DistributedLogger.")
    assert "keras_mgpu.DistributedLogger(log_dir=...)" in message


def test_a_missing_log_dir_or_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=(
            f"^{tmp_path}/nowhere is not a folder \\(no such path\\)")):
        read_job(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=(
            f"^no metrics.jsonl in {tmp_path}: give the log_dir")):
        read_job(str(tmp_path))


def test_overlapping_attempts_are_a_warning(tmp_path):
    # Attempt 2 starts 5 s before attempt 1's last record.
    path = write(tmp_path, [
        record("window", 1100.0, step=10, seconds=90.0,
               goodput=snapshot(1100.0, 1000.0, 1, productive=100.0)),
        record("window", 1195.0, step=20, seconds=90.0,
               goodput=snapshot(1195.0, 1095.0, 2, productive=100.0)),
    ])
    job = read_job(path)
    assert job.gaps[0].seconds == pytest.approx(categories())
    # The attempts' sum: their 5 s overlap is counted twice.
    assert job.wall_seconds == pytest.approx(200.0)
    assert job.goodput == pytest.approx(1.0)
    [warning] = job.warnings
    assert warning.startswith(
        "attempt 2 started 5.0 s before attempt 1's last record")
    assert "WARNING: attempt 2 started 5.0 s" in job.table()


def test_a_launcher_end_outside_the_gap_is_clamped(tmp_path):
    # previous_ended after attempt 2's start (clock skew): all the gap is
    # the failed attempt's tail.
    path = write(tmp_path, [
        record("window", 1100.0, step=10, seconds=90.0,
               goodput=snapshot(1100.0, 1000.0, 1, productive=100.0)),
        record("window", 1220.0, step=20, seconds=90.0,
               goodput=snapshot(1220.0, 1120.0, 2, previous_ended=1125.0,
                                productive=100.0)),
    ])
    job = read_job(path)
    assert job.gaps[0].seconds == pytest.approx(categories(redone=20.0))
    assert job.wall_seconds == pytest.approx(220.0)
    assert len(job.warnings) == 1
    assert job.warnings[0].startswith("the launcher saw attempt 1 end at ")


def test_a_snapshot_that_does_not_add_up_is_evened_out_in_other(tmp_path):
    # 90 s of categories over a 100 s span, one of them a category this
    # reader does not know (a newer ledger's): both counted as other.
    good = snapshot(1100.0, 1000.0, 1, productive=80.0, other=20.0)
    good["seconds"].update(other=0.0, tuning=10.0)
    path = write(tmp_path, [record("window", 1100.0, step=5, seconds=80.0,
                                   goodput=good)])
    job = read_job(path)
    assert job.seconds == pytest.approx(categories(productive=80.0,
                                                   other=20.0))
    assert job.warnings == [
        "categories unknown to this keras-mgpu (tuning) are counted as "
        "other: read the log with the keras-mgpu that wrote it.",
        "attempt 1: its categories add up to 90.0 s, not the 100.0 s from "
        "its start to its last record; the difference is counted as "
        "other."]
    check_sums(job)


# --- The table, the JSON and the chart ------------------------------------------


def test_the_table(tmp_path):
    job = read_job(two_attempts(tmp_path))
    text = job.table()
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    assert lines[0] == f"keras-mgpu goodput: {tmp_path}"
    assert lines[1] == ("2 attempts, 1970-01-01T00:16:40Z to "
                        "1970-01-01T00:20:00Z")
    assert lines[3].split() == ["category", "seconds", "share", "time"]
    rows = {line[:18].strip(): line[18:].split()
            for line in lines[5:15] + lines[16:17]}
    assert list(rows) == [k.replace("_", " ") for k in ORDER] + ["wall"]
    assert rows["productive"][:2] == ["106.0", "53.0%"]
    assert rows["redone"][:2] == ["30.0", "15.0%"]
    assert rows["between attempts"][:2] == ["10.0", "5.0%"]
    assert rows["wall"] == ["200.0", "100.0%", "3m", "20s"]
    assert ("goodput: 53.0% of the wall time was productive training"
            in lines)
    header = lines.index(
        "attempt launch  started (UTC)             wall s productive s  "
        "redone s   steps")
    assert [line.split() for line in lines[header + 1:]] == [
        ["1", "-", "1970-01-01T00:16:40Z", "90.0", "36.0", "30.0", "200"],
        ["after", "attempt", "1:", "10.0", "s", "between", "attempts"],
        ["2", "-", "1970-01-01T00:18:20Z", "100.0", "70.0", "0.0", "300"]]


def test_to_json_is_the_dataclass(tmp_path):
    job = read_job(two_attempts(tmp_path))
    payload = json.loads(job.to_json())
    assert list(payload) == ["log_dir", "started", "ended", "wall_seconds",
                             "goodput", "seconds", "share", "attempts",
                             "gaps", "warnings"]
    assert list(payload["attempts"][0]) == [
        "index", "launch_attempt", "pid", "started", "ended",
        "wall_seconds", "seconds", "steps", "replicas"]
    assert payload["attempts"][1]["seconds"]["productive"] == 70.0
    assert payload["gaps"] == [{
        "after": 1, "before": 2, "started": 1090.0, "ended": 1100.0,
        "seconds": categories(between_attempts=10.0)}]


def test_the_chart_puts_each_attempt_on_the_jobs_time(tmp_path):
    import matplotlib.pyplot as plt

    from keras_mgpu.goodput import plot

    path = write(tmp_path, [
        record("window", 1100.0, step=50, seconds=80.0,
               goodput=snapshot(1100.0, 1000.0, 11, launch_attempt=1,
                                job_started=990.0, startup=20.0,
                                productive=80.0)),
        record("window", 1230.0, step=120, seconds=90.0,
               goodput=snapshot(1230.0, 1130.0, 12, launch_attempt=2,
                                job_started=990.0, previous_ended=1110.0,
                                startup=10.0, productive=90.0)),
    ])
    fig = plot.figure(read_job(path))
    try:
        [ax] = fig.axes
        assert [t.get_text() for t in ax.get_yticklabels()] == [
            "job", "attempt 1 (launch 1)", "attempt 2 (launch 2)"]
        # 240 s: in minutes.
        assert ax.get_xlabel() == "minutes since the job started"
        bars = {}
        for patch in ax.patches:
            row = round(patch.get_y() + patch.get_height() / 2)
            bars.setdefault(row, []).append(
                (round(60 * patch.get_x()), round(60 * patch.get_width())))
        # Seconds from the launcher's start at 990.
        assert sorted(bars[0]) == [(0, 170), (170, 40), (210, 10),
                                   (220, 20)]
        assert sorted(bars[1]) == [(0, 10), (10, 80), (90, 20), (110, 10)]
        assert sorted(bars[2]) == [(120, 20), (140, 90), (230, 10)]
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [
            "productive", "startup", "redone", "between attempts"]
    finally:
        plt.close(fig)


def test_a_plot_path_matplotlib_cannot_write_is_refused():
    from keras_mgpu.goodput import plot

    with pytest.raises(ValueError, match="^--plot: 'chart.json' does not "
                                         "end in an image format"):
        plot.check_plot_format("chart.json")


# --- The command --------------------------------------------------------------


def goodput(*argv, env=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "keras_mgpu", "goodput", *argv],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env=env)


def test_the_command_prints_the_table(tmp_path):
    done = goodput(two_attempts(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout == read_job(str(tmp_path)).table() + "\n"
    assert "goodput: 53.0% of the wall time" in done.stdout
    assert done.stderr == ""


def test_the_command_writes_json_to_stdout(tmp_path):
    done = goodput(two_attempts(tmp_path), "--json", "-")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert payload["log_dir"] == str(tmp_path)
    assert payload["wall_seconds"] == pytest.approx(200.0)
    assert payload["goodput"] == pytest.approx(0.53)
    assert payload["seconds"] == pytest.approx(categories(
        productive=106.0, input_wait=5.0, compile=9.0, startup=18.0,
        restore=3.0, checkpoint=4.0, redone=30.0, between_attempts=10.0,
        other=15.0))
    assert payload["share"]["redone"] == pytest.approx(0.15)
    assert [a["steps"] for a in payload["attempts"]] == [200, 300]
    assert payload["warnings"] == []


def test_the_command_writes_json_and_a_chart(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    out, png = tmp_path / "goodput.json", tmp_path / "goodput.png"
    env = allow_in_children(dict(os.environ), "matplotlib")
    done = goodput(two_attempts(logs), "--json", str(out), "--plot",
                   str(png), env=env)
    assert done.returncode == 0, done.stderr
    assert f"Wrote {out}\nWrote {png}\n" in done.stdout
    assert json.loads(out.read_text())["goodput"] == pytest.approx(0.53)
    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000


@pytest.mark.parametrize("argv, named", [
    (["{tmp}/nowhere"], "keras-mgpu goodput: error: {tmp}/nowhere is not "
                        "a folder (no such path)"),
    (["{tmp}"], "keras-mgpu goodput: error: no metrics.jsonl in {tmp}: "),
    (["{tmp}/empty"], "keras-mgpu goodput: error: no goodput records in "
                      "{tmp}/empty/metrics.jsonl: "),
    (["{tmp}", "--json", "{tmp}/no/dir/out.json"],
     "--json: cannot write '{tmp}/no/dir/out.json': the directory"),
    (["{tmp}", "--plot", "{tmp}"], "--plot: '{tmp}' is a directory; give a "
                                   "file path in it, e.g. '{tmp}/goodput."
                                   "png'"),
])
def test_the_command_refuses_with_exit_code_2(tmp_path, argv, named):
    (tmp_path / "empty").mkdir()
    write(tmp_path / "empty", [record("window", 1.0, step=1, seconds=1.0)])
    done = goodput(*[a.format(tmp=tmp_path) for a in argv])
    assert done.returncode == 2, done.stderr
    assert named.format(tmp=tmp_path) in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


# Writing a file and refusing a path; the other forms read and print the
# same way (`make test-all`).
@pytest.mark.parametrize("argv", [
    pytest.param(["--help"], marks=pytest.mark.exhaustive),
    pytest.param(["LOG"], marks=pytest.mark.exhaustive),
    pytest.param(["LOG", "--json", "-"], marks=pytest.mark.exhaustive),
    ["LOG", "--json", "OUT"], ["missing"]])
def test_the_command_imports_no_tensorflow(tmp_path, argv):
    log_dir = two_attempts(tmp_path)
    argv = [{"LOG": log_dir, "OUT": str(tmp_path / "o.json"),
             "missing": str(tmp_path / "missing")}.get(a, a) for a in argv]
    env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1")
    done = subprocess.run([console_script(), "goodput", *argv],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == (2 if "missing" in argv[0] else 0), (
        done.stderr[-3000:])
    modules = imported_modules(done.stderr)
    assert "keras_mgpu" in modules  # the import log is read right
    assert not {"tensorflow", "keras", "jax"} & modules


@pytest.mark.parametrize("name", ["__init__.py", "report.py", "plot.py"])
def test_the_reader_imports_the_standard_library_alone(name):
    # `keras-mgpu goodput` starts at Python's speed: TensorFlow only for a
    # URL (lazily, through keras_mgpu._fs), matplotlib only for a chart.
    # (The ledger, which the training side writes with, has its own rule.)
    allowed_lazily = ("keras_mgpu._fs", "matplotlib")
    # The charts' shared checks, standard library only at import.
    allowed = ("keras_mgpu._plotting",)
    with open(os.path.join(ROOT, "keras_mgpu", "goodput", name)) as f:
        tree = ast.parse(f.read())
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found += [(f"{node.module}.{a.name}" if node.module
                       == "keras_mgpu" else node.module, node)
                      for a in node.names]
    assert found
    for module, node in found:
        first = module.split(".")[0]
        if (first in sys.stdlib_module_names or first == "__future__"
                or module.startswith("keras_mgpu.goodput.")
                or module in allowed):
            continue
        assert module.startswith(allowed_lazily), (name, module)
        assert id(node) not in top, (name, module, "imported at load")


def test_reading_a_local_log_imports_no_tensorflow(tmp_path):
    log_dir = two_attempts(tmp_path)
    code = textwrap.dedent(f"""
        import sys
        import keras_mgpu.goodput
        import keras_mgpu.goodput.plot
        job = keras_mgpu.goodput.read_job({log_dir!r})
        job.table()
        print(round(job.goodput, 2), sorted(
            m for m in ("tensorflow", "keras", "jax", "matplotlib")
            if m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "0.53 []\n"


def test_the_report_categories_are_the_ledgers_and_two_more():
    assert list(report.REPORT_CATEGORIES) == ORDER
    assert set(ORDER) - set(CATEGORIES) == {"redone", "between_attempts"}
