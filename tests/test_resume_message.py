"""BackupAndRestore's "resumed from backup generation N" comes only once the
resume is accepted, and its messages count epochs and steps as Keras's
progress bar does (issue #44)."""

import logging
import re

import keras
import pytest
import tensorflow as tf

from keras_mgpu.callbacks import BackupAndRestore, DistributedLogger
from tests import workers


class _CrashAt13(keras.callbacks.Callback):
    """Raises after the 13th optimizer step: step 5 of epoch 2 in batches
    of 16."""

    def on_train_batch_end(self, batch, logs=None):
        if self.model.optimizer.iterations.numpy() == 13:
            raise RuntimeError("crash")


class _Table(keras.callbacks.Callback):
    """A user's stateful callback; `refuse` makes its `set_state` refuse
    what the backup saved, as a callback checking its state would."""

    def __init__(self, refuse=False):
        super().__init__()
        self.rows = [1, 2]
        self.refuse = refuse

    def get_state(self):
        return {"rows": self.rows}

    def set_state(self, state):
        if self.refuse:
            raise ValueError("the saved table has other columns")
        self.rows = state["rows"]


def _fit(callbacks, batch_size=16, samples=128, epochs=3, verbose=0):
    """`epochs` of a small regression in batches of `batch_size`, in this
    process (128 samples: 8 batches of 16 an epoch)."""
    x, y = workers.regression_data(128)
    dataset = tf.data.Dataset.from_tensor_slices(
        (x[:samples], y[:samples])).batch(batch_size)
    model = workers.build_mlp()
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(dataset, epochs=epochs, verbose=verbose, callbacks=callbacks)
    return model


def _interrupted(backup_dir, save_freq):
    """A run that saved with `save_freq` and crashed at step 13."""
    with pytest.raises(RuntimeError, match="crash"):
        _fit([_Table(), BackupAndRestore(backup_dir, save_freq=save_freq),
              _CrashAt13()])
    workers.finish_backup_writes()


def _said(capsys, caplog) -> list:
    """The lines printed (stdout, stderr) or logged (Keras's print_msg logs
    through absl when interactive logging is off) that speak of resuming."""
    out, err = capsys.readouterr()
    lines = (out + err).splitlines() + [r.getMessage() for r in caplog.records]
    return [line for line in lines if re.search(r"\bresumed\b", line)]


@pytest.mark.parametrize("rerun, refuse, error", [
    # Saved after 64 samples of epoch 2; batches of 24 cannot end there.
    ({"batch_size": 24}, False, r"this run's batches hold 24, and no whole "
     r"number of them is 64 samples"),
    # The saved epoch had read 4 batches; this run's epochs hold 3.
    ({"samples": 48}, False, r"this run's data is shorter than the saved "
     r"run's"),
    # A callback refuses the state it was saved with.
    ({}, True, r"the saved table has other columns"),
], ids=["batch-size", "shorter-data", "callback-state"])
def test_a_refused_resume_never_says_it_resumed(tmp_path, capsys, caplog,
                                                rerun, refuse, error):
    caplog.set_level(logging.INFO)
    backup_dir = str(tmp_path / "backup")
    _interrupted(backup_dir, save_freq=4)
    assert _said(capsys, caplog) == []
    log_dir = tmp_path / "logs"
    with pytest.raises(ValueError, match=error):
        _fit([_Table(refuse=refuse),
              BackupAndRestore(backup_dir, save_freq=4),
              DistributedLogger(str(log_dir), console=True)], **rerun)
    assert _said(capsys, caplog) == []
    # Nor does the logger record one.
    records = (log_dir / "metrics.jsonl").read_text().splitlines()
    assert not [r for r in records if '"kind": "resume"' in r], records


@pytest.mark.parametrize("save_freq, batch_size, verbose, where", [
    # Saved at steps 4, 8 and 12: the last after 4 batches of epoch 2.
    (4, 16, 0, "at epoch 2, step 4"),
    # The same samples in batches of 32 (with a warning): the saved
    # position is still the one the interrupted run's bar showed.
    (4, 32, 0, "at epoch 2, step 4"),
    # Said within epoch 2, once its skipped batches are read: on a line of
    # its own, not at the end of the progress bar's.
    (4, 16, 1, "at epoch 2, step 4"),
    # Saved at epoch 1's end: epoch 2 begins anew (not "step 0").
    ("epoch", 16, 0, "at the start of epoch 2"),
])
def test_an_accepted_resume_says_so_once(tmp_path, capsys, caplog, recwarn,
                                         save_freq, batch_size, verbose,
                                         where):
    caplog.set_level(logging.INFO)
    backup_dir = str(tmp_path / "backup")
    _interrupted(backup_dir, save_freq)
    table = _Table()
    table.rows = []
    model = _fit([table, BackupAndRestore(backup_dir, save_freq=save_freq),
                  DistributedLogger(str(tmp_path / "logs"), console=True)],
                 batch_size=batch_size, verbose=verbose)
    said = _said(capsys, caplog)
    assert [line for line in said if "BackupAndRestore" in line] == [
        f"BackupAndRestore: resumed from backup generation "
        f"{3 if save_freq == 4 else 1} {where} ({backup_dir})"]
    assert len([line for line in said
                if line.startswith("DistributedLogger: resumed")]) == 1
    assert table.rows == [1, 2]
    # 24 steps in batches of 16; the rest of epoch 2 and epoch 3 in 32s.
    assert int(model.optimizer.iterations.numpy()) == (
        24 if batch_size == 16 else 12 + 2 + 4)


def test_a_backup_past_the_last_epoch_is_placed_as_the_bar_counts(
        tmp_path, capsys, caplog):
    """Saved at the end of epoch 2 (the bar's "Epoch 2/2" done): a rerun of
    fit(epochs=2) trains nothing and says where the backup is, counted from
    1, as its resume line does."""
    caplog.set_level(logging.INFO)
    backup_dir = str(tmp_path / "backup")
    _fit([BackupAndRestore(backup_dir, delete_checkpoint=False)], epochs=2)
    with pytest.warns(UserWarning, match=(
            r"\(generation 2\) is at the start of epoch 3, but "
            r"fit\(epochs=2\) ends with epoch 2: nothing is trained")):
        model = _fit([BackupAndRestore(backup_dir)], epochs=2)
    assert int(model.optimizer.iterations.numpy()) == 16
    assert _said(capsys, caplog) == [
        f"BackupAndRestore: resumed from backup generation 2 at the start of "
        f"epoch 3 ({backup_dir})"]
