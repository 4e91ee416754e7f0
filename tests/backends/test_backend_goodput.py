"""The goodput time ledger on the active Keras backend: a `fit` with slow
input, slow validation and backup saves, its ledger read back from the
logger's records; a second `fit` in the same process, logged elsewhere,
accounted from its own start. Each runs in a process of its own
(tests/goodput_workers.py), whose first `fit` it is."""

from keras_mgpu.goodput.ledger import CATEGORIES
from tests import goodput_workers
from tests.goodput_workers import PAUSE


def in_a_process(run_workers, target, **kwargs):
    return run_workers(target, 1, kwargs=kwargs)[0].result


def test_every_second_of_a_fit_is_in_one_category(run_workers, tmp_path):
    epochs, train_batches, val_batches = 2, 6, 3
    result = in_a_process(
        run_workers, goodput_workers.fit_once,
        log_dir=str(tmp_path / "logs"), backup_dir=str(tmp_path / "backup"),
        epochs=epochs, train_batches=train_batches, val_batches=val_batches)
    written = result["records"]
    # Training begins, then windows every 2 steps and epochs.
    assert [r["kind"] for r in written] == (
        ["goodput"] + (["window"] * 3 + ["epoch"]) * 2)
    assert [r["step"] for r in written] == [0, 2, 4, 6, 6, 8, 10, 12, 12]
    ledgers = [r["goodput"] for r in written]
    attempt = ledgers[0]["attempt"]
    assert attempt["pid"] == result["pid"]
    assert attempt["launch_attempt"] is None  # not under keras-mgpu launch
    previous = dict.fromkeys(CATEGORIES, 0.0)
    for ledger in ledgers:
        assert ledger["attempt"] == attempt
        seconds = ledger["seconds"]
        assert list(seconds) == list(CATEGORIES)
        # Every second since the attempt began, once.
        assert abs(sum(seconds.values())
                   - (ledger["time"] - attempt["started"])) < 1e-6
        # Each category only grows.
        assert all(seconds[c] >= previous[c] for c in CATEGORIES), (
            seconds, previous)
        previous = seconds
    first, end = ledgers[0]["seconds"], ledgers[-1]["seconds"]
    # As training begins: the process's start-up (imports, the model) and
    # the restore (nothing to restore) only.
    assert first["startup"] > 0
    assert {c for c in CATEGORIES if first[c]} <= {"startup", "restore"}
    # Then: the first call compiles; each training batch waits PAUSE for
    # its input (measured inside the steps: at least half of it is not
    # hidden behind the step); validation loads its batches for PAUSE each;
    # the backup saves every 2 steps.
    assert end["startup"] == ledgers[1]["seconds"]["startup"]
    assert end["compile"] > 0
    assert end["input_wait"] >= 0.5 * PAUSE * epochs * train_batches
    assert end["evaluation"] >= PAUSE * epochs * val_batches
    assert end["checkpoint"] > 0
    assert end["productive"] > 0
    # Nothing outside a training loop happened after its start.
    assert all(r["goodput"]["seconds"]["other"] == 0 for r in written
               if r["kind"] == "window")


def test_a_later_fit_is_accounted_from_its_own_start(run_workers, tmp_path):
    result = in_a_process(run_workers, goodput_workers.fit_twice,
                          first_dir=str(tmp_path / "first"),
                          second_dir=str(tmp_path / "second"))
    first, second = result["first"], result["second"]
    assert first[0]["goodput"]["seconds"]["startup"] > 0
    started = {r["goodput"]["attempt"]["started"] for r in second}
    assert len(started) == 1
    started, = started
    assert started >= result["between"] > first[-1]["goodput"]["time"]
    for record in second:
        seconds = record["goodput"]["seconds"]
        # The process's start-up is the first log's.
        assert seconds["startup"] == 0
        assert abs(sum(seconds.values())
                   - (record["goodput"]["time"] - started)) < 1e-6
    assert second[-1]["goodput"]["seconds"]["compile"] > 0  # a new model
