"""The goodput ledger against ground truth: a job with injected faults
(SIGKILLs at chosen steps, slow input, slow saves, the launcher's restart
delay) run by `keras-mgpu launch`, timing itself apart from the ledger
(tests/goodput_job.py). Every category of `keras-mgpu goodput`'s table
must be within 2% of the job's wall time of what the job timed."""

import json
import os
import subprocess
import sys

import pytest

from keras_mgpu.goodput import read_job
from tests import goodput_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKOFF = 2  # seconds before the first restart; the launcher doubles it


def measured(job, events: list) -> dict:
    """Each report category's seconds over the job, from the job's own
    timings: per attempt (from when the launcher started it)

    - `restore`, `evaluation`, `checkpoint`: the spans timed around them;
    - `startup`: to the first train batch, less the restore;
    - `compile`: the first batch that trained (its train function's first
      call);
    - `input_wait`: the train batches' loads inside later batches (a
      load that ran ahead, between batches, was not waited for);
    - `redone`: a killed attempt's training (and its input wait) after the
      step the next attempt resumed from, until its kill;
      `between_attempts`: from the kill to the next attempt's start;
    - `productive`: the rest of the training loop (batches a resume
      skipped included); `other`: after it.
    """
    seconds = dict.fromkeys(job.seconds, 0.0)
    seconds["startup"] = job.attempts[0].started - job.started
    for i, attempt in enumerate(job.attempts):
        mine = [e for e in events if e["attempt"] == attempt.launch_attempt]

        def spans(event, **match):
            return [e for e in mine if e["event"] == event and all(
                e[k] == v for k, v in match.items())]

        batches = spans("batch")
        compiled = spans("batch", trained=True)[0]
        restore = sum(e["end"] - e["start"] for e in spans("restore"))
        seconds["restore"] += restore
        seconds["startup"] += batches[0]["start"] - attempt.started - restore
        seconds["compile"] += compiled["end"] - compiled["start"]
        killed = spans("killed")
        if killed:
            # Trained again from this step by the next attempt.
            resumed = [e for e in events if e["event"] == "batch"
                       and e["attempt"] == job.attempts[i + 1].launch_attempt
                       and e["trained"]][0]["step"] - 1
            redo_from = next(b["end"] for b in batches
                             if b["step"] == resumed)
            loop_end = killed[0]["t"]
            seconds["between_attempts"] += (job.attempts[i + 1].started
                                            - loop_end)
        else:
            loop_end = redo_from = spans("train_end")[0]["t"]
            seconds["other"] += attempt.ended - loop_end

        def inside(found, start, end):
            return sum(max(0.0, min(e["end"], end) - max(e["start"], start))
                       for e in found)

        # The loop after the compiling batch: before `redo_from`, and the
        # part the next attempt redid.
        for start, end, training in (
                (compiled["end"], redo_from, "productive"),
                (redo_from, loop_end, "redone")):
            loop = {"evaluation": inside(spans("test"), start, end),
                    "checkpoint": inside(spans("save"), start, end)}
            # A load waited for is one inside a batch (a call of the
            # train function): one between batches ran ahead.
            waited = sum(inside(spans("load", kind="train"),
                                max(start, batch["start"]),
                                min(end, batch["end"]))
                         for batch in batches)
            for name, value in loop.items():
                seconds[name] += value
            if training == "productive":
                seconds["input_wait"] += waited
                seconds["productive"] += (end - start - waited
                                          - sum(loop.values()))
            else:
                # The report's `redone`: training and its input wait.
                seconds["redone"] += end - start - sum(loop.values())
        seconds["productive"] += compiled["start"] - batches[0]["start"]
    return seconds


def test_the_ledger_matches_a_job_with_injected_faults(tmp_path):
    out = tmp_path / "job"
    out.mkdir()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="-1")
    proc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "keras-mgpu"),
         "launch", "--workers", "1", "--max-restarts", "2", "--backoff",
         str(BACKOFF), "--", sys.executable, "tests/goodput_job.py",
         str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "all 1 workers finished after 2 restarts" in proc.stderr
    job = read_job(str(out / "logs"))
    with open(out / "truth.jsonl") as f:
        events = [json.loads(line) for line in f]
    assert [a.launch_attempt for a in job.attempts] == [1, 2, 3]
    truth = measured(job, events)
    # The faults are there to be found: the job timed them as injected.
    assert truth["checkpoint"] >= 2 * goodput_job.SAVE_PAUSE
    assert truth["between_attempts"] >= BACKOFF + 2 * BACKOFF
    assert truth["redone"] > 0 and truth["input_wait"] > 0
    assert sum(truth.values()) == pytest.approx(job.wall_seconds, abs=1e-6)
    table = "\n".join(
        f"{name:17} ledger {job.seconds[name]:8.3f} s, measured "
        f"{truth[name]:8.3f} s" for name in job.seconds)
    for name in job.seconds:
        assert abs(job.seconds[name] - truth[name]) <= (
            0.02 * job.wall_seconds), f"{name} differs:\n{table}"
