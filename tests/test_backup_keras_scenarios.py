"""Keras's own `BackupAndRestore` test scenarios, run with both classes.

The scenarios of Keras 3's `keras/src/callbacks/backup_and_restore_test.py`
(the same model: an `Input((3,))`, a layer counting its training calls in a
non-trainable weight, a `Dense(1)`; 10 samples in batches of 4, so 3 batches
an epoch; a crash is a callback raising at a chosen batch or epoch end),
each run with `keras.callbacks.BackupAndRestore` and with
`keras_mgpu.callbacks.BackupAndRestore`. Unlike Keras's test, the resumed
`fit` uses a new model and a new callback, as a rerun in a new process
would (Keras's test resumes the model still in memory, so a restore that
did nothing would pass it), checks behaviour only (no private attributes),
and feeds batches in a fixed order (`shuffle=False`), so a resume can be
compared with an uninterrupted run.

Where the classes must agree the test asserts one expectation for both;
where they differ by design (keras-mgpu resumes at the saved batch, Keras
at the start of the saved epoch; keras-mgpu verifies checksums; argument
checks) it asserts each class's own numbers.
"""

import functools
import inspect
import os
import signal
import warnings

import keras
import numpy as np
import pytest

from keras_mgpu.callbacks import RESTART_EXIT_CODE
from keras_mgpu.callbacks import BackupAndRestore as Ours
from tests import workers

KERAS = keras.callbacks.BackupAndRestore
BOTH = pytest.mark.parametrize("cls", [KERAS, Ours],
                               ids=["keras", "keras_mgpu"])

_rng = np.random.default_rng(0)
X = _rng.random((10, 3)).astype("float32")
Y = _rng.random((10, 1)).astype("float32")
STEPS = 3  # batches of 4: 4 + 4 + 2 samples


class InterruptingCallback(keras.callbacks.Callback):
    """Raises after the `steps_int`-th batch or the `epoch_int`-th epoch end
    of its fit, or when epoch `epoch_begin` begins (as Keras's test and
    docstring example do)."""

    def __init__(self, steps_int=None, epoch_int=None, epoch_begin=None):
        super().__init__()
        self.batch_count = 0
        self.epoch_count = 0
        self.steps_int = steps_int
        self.epoch_int = epoch_int
        self.epoch_begin = epoch_begin

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch_begin:
            raise RuntimeError("EpochBeginInterruption")

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_count += 1
        if self.epoch_count == self.epoch_int:
            raise RuntimeError("EpochInterruption")

    def on_train_batch_end(self, batch, logs=None):
        self.batch_count += 1
        if self.batch_count == self.steps_int:
            raise RuntimeError("StepsInterruption")


class CanaryLayer(keras.layers.Layer):
    """Counts the batches the model trained on, in a saved weight."""

    def __init__(self):
        super().__init__()
        self.counter = self.add_weight(shape=(), initializer="zeros",
                                       dtype="float32", trainable=False)

    def call(self, x):
        self.counter.assign_add(1.0)
        return x


def make_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), CanaryLayer(),
                              keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1),
                  metrics=["mse"])
    return model


def fit(model, epochs, callbacks):
    return model.fit(X, Y, batch_size=4, epochs=epochs, shuffle=False,
                     verbose=0, callbacks=callbacks)


def crash(model, epochs, backup, interrupt, match="Interruption"):
    with pytest.raises(RuntimeError, match=match):
        fit(model, epochs, [backup, interrupt])
    workers.finish_backup_writes()  # ours writes in the background


def counter(model):
    return int(model.layers[0].counter.numpy())


def iterations(model):
    return int(model.optimizer.iterations.numpy())


def max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


@functools.lru_cache(maxsize=None)
def _uninterrupted(epochs):
    model = make_model()
    fit(model, epochs, [])
    return tuple(model.get_weights())


def assert_uninterrupted(model, epochs):
    """The weights of an uninterrupted run of `epochs` epochs."""
    assert max_diff(model.get_weights(), _uninterrupted(epochs)) <= 1e-6


def newest_weights_file(cls, backup_dir):
    """The weights file a restore tries first, by each class's layout."""
    if cls is KERAS:
        return os.path.join(backup_dir, "latest.weights.h5")
    newest = max(n for n in os.listdir(backup_dir) if n.startswith("gen-"))
    return os.path.join(backup_dir, newest, "weights.weights.h5")


# --- arguments ----------------------------------------------------------------


def test_the_first_four_parameters_are_keras_s():
    ours = list(inspect.signature(Ours).parameters.values())[:4]
    theirs = list(inspect.signature(KERAS).parameters.values())
    assert [(p.name, p.default, p.kind) for p in ours] == [
        (p.name, p.default, p.kind) for p in theirs] == [
        ("backup_dir", inspect.Parameter.empty,
         inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("save_freq", "epoch", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("double_checkpoint", False, inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("delete_checkpoint", True, inspect.Parameter.POSITIONAL_OR_KEYWORD)]


@BOTH
@pytest.mark.parametrize("args, kwargs", [
    ((), {}),
    (("epoch", False, False), {}),
    ((3, True), {}),
    ((), {"double_checkpoint": True}),
    ((), {"delete_checkpoint": False}),
    ((), {"save_freq": 2, "double_checkpoint": True,
          "delete_checkpoint": False}),
])
def test_keras_calls_construct_the_same_callback(cls, tmp_path, args, kwargs):
    backup_dir = str(tmp_path / "b")
    callback = cls(backup_dir, *args, **kwargs)
    expected = dict(zip(["save_freq", "double_checkpoint",
                         "delete_checkpoint"], args))
    expected = {"save_freq": "epoch", "double_checkpoint": False,
                "delete_checkpoint": True, **expected, **kwargs}
    assert {name: getattr(callback, name) for name in expected} == expected
    assert callback.backup_dir == backup_dir


def test_double_checkpoint_sets_how_many_generations_ours_keeps(tmp_path):
    assert Ours(str(tmp_path)).keep == 1
    assert Ours(str(tmp_path), double_checkpoint=True).keep == 2
    assert Ours(str(tmp_path), keep=3).double_checkpoint is True
    with pytest.raises(ValueError, match=r"double_checkpoint=True keeps the "
                       "previous generation as a fallback, which needs keep "
                       ">= 2, got keep=1"):
        Ours(str(tmp_path), double_checkpoint=True, keep=1)


@BOTH
@pytest.mark.parametrize("save_freq", ["batch", 0.15])
def test_save_freq_unknown_error(cls, save_freq):
    with pytest.raises(ValueError, match="Invalid value"):
        cls(backup_dir="backup_dir", save_freq=save_freq)


@BOTH
@pytest.mark.parametrize("backup_dir", ["", None])
def test_backup_dir_empty_or_none_error(cls, backup_dir):
    message = {KERAS: "Empty `backup_dir` argument passed",
               Ours: f"backup_dir must be a non-empty path, got "
                     f"{backup_dir!r}"}[cls]
    with pytest.raises(ValueError, match=message):
        cls(backup_dir=backup_dir, save_freq="epoch")


@BOTH
@pytest.mark.parametrize("save_freq", [0, -1, True, False])
def test_save_freq_keras_reads_as_every_batch(cls, tmp_path, save_freq):
    """Keras 3.15 takes 0, negative numbers, True and False (documented for
    preemption checkpointing only) and saves after every batch; keras-mgpu
    refuses them, naming save_freq=1 (or, for False, save_on_sigterm)."""
    backup_dir = str(tmp_path / "b")
    if cls is Ours:
        message = ("save_freq=False makes no periodic saves" if save_freq
                   is False else f"Invalid value for save_freq: {save_freq}"
                   ".*that is save_freq=1")
        with pytest.raises(ValueError, match=message):
            cls(backup_dir, save_freq=save_freq)
        return
    crash(make_model(), 2, cls(backup_dir, save_freq=save_freq),
          InterruptingCallback(steps_int=1))
    model = make_model()
    history = fit(model, 1, [cls(backup_dir, save_freq=save_freq)])
    # Restored the save after the first batch, then reran epoch 0.
    assert history.epoch == [0]
    assert counter(model) == iterations(model) == 1 + STEPS


def test_ours_save_freq_false_saves_only_on_sigterm(tmp_path):
    """Keras's documented meaning of save_freq=False (preemption
    checkpointing), which keras-mgpu spells save_on_sigterm=True."""
    backup_dir = str(tmp_path / "b")

    def backup():
        return Ours(backup_dir, save_freq=False, save_on_sigterm=True)

    crash(make_model(), 2, backup(), InterruptingCallback(steps_int=4))
    model = make_model()
    fit(model, 2, [backup()])
    assert counter(model) == 2 * STEPS  # nothing had been saved

    class Sigterm(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if iterations(self.model) == 4:
                os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as exit_:
            fit(make_model(), 2, [Sigterm(), backup()])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exit_.value.code == RESTART_EXIT_CODE
    model = make_model()
    history = fit(model, 2, [backup()])
    assert history.epoch == [1]
    assert counter(model) == iterations(model) == 2 * STEPS
    assert_uninterrupted(model, 2)
    assert not os.path.exists(backup_dir)


# --- resuming -----------------------------------------------------------------


@BOTH
def test_best_case_step(cls, tmp_path):
    """save_freq=1, a crash after the second batch; rerun with epochs=5."""
    backup_dir = str(tmp_path / "subdir")
    model = make_model()
    crash(model, 2, cls(backup_dir, save_freq=1),
          InterruptingCallback(steps_int=2))
    assert os.path.exists(backup_dir)
    assert counter(model) == 2

    resumed = make_model()
    history = fit(resumed, 5, [cls(backup_dir, save_freq=1)])
    assert history.epoch == [0, 1, 2, 3, 4]
    assert not os.path.exists(backup_dir)
    if cls is KERAS:
        # Back at batch 0 of epoch 0: its first two batches train twice.
        assert counter(resumed) == iterations(resumed) == 2 + 5 * STEPS
        assert max_diff(resumed.get_weights(), _uninterrupted(5)) > 1e-3
    else:
        # At batch 2 of epoch 0: every batch trains once.
        assert counter(resumed) == iterations(resumed) == 5 * STEPS
        assert_uninterrupted(resumed, 5)


@BOTH
def test_save_freq_mid_epoch(cls, tmp_path):
    """save_freq=2, a crash after batch 1 of epoch 1 (the fifth); the last
    save was after the fourth batch (batch 0 of epoch 1)."""
    backup_dir = str(tmp_path / "b")
    crash(make_model(), 3, cls(backup_dir, save_freq=2),
          InterruptingCallback(steps_int=5))
    resumed = make_model()
    history = fit(resumed, 3, [cls(backup_dir, save_freq=2)])
    assert history.epoch == [1, 2]
    if cls is KERAS:
        # Restored after batch 4, epoch 1 rerun from its first batch.
        assert counter(resumed) == iterations(resumed) == 4 + 2 * STEPS
    else:
        assert counter(resumed) == iterations(resumed) == 3 * STEPS
        assert_uninterrupted(resumed, 3)


@BOTH
def test_best_case_epoch(cls, tmp_path):
    """save_freq="epoch", a crash at the second epoch's end (in a callback
    after the backup's own on_epoch_end); rerun with epochs=5."""
    backup_dir = str(tmp_path / "subdir")
    model = make_model()
    crash(model, 6, cls(backup_dir, save_freq="epoch"),
          InterruptingCallback(epoch_int=2))
    assert os.path.exists(backup_dir)
    assert counter(model) == 2 * STEPS

    resumed = make_model()
    history = fit(resumed, 5, [cls(backup_dir=backup_dir, save_freq="epoch")])
    assert history.epoch == [2, 3, 4]
    assert counter(resumed) == iterations(resumed) == 5 * STEPS
    assert_uninterrupted(resumed, 5)


@BOTH
@pytest.mark.parametrize("stopper_first", [False, True],
                         ids=["stopper_after", "stopper_before"])
def test_epoch_end_crash_with_early_stopping_in_the_list(cls, tmp_path,
                                                         stopper_first):
    """keras-mgpu saves EarlyStopping's state with each generation: listed
    after the backup, the epoch's end is saved when the next epoch begins,
    so a crash at the epoch's end reruns that epoch."""
    backup_dir = str(tmp_path / "b")
    stopper = keras.callbacks.EarlyStopping("loss", patience=100)
    backup = cls(backup_dir)
    listed = [stopper, backup] if stopper_first else [backup, stopper]
    with pytest.raises(RuntimeError, match="EpochInterruption"):
        fit(make_model(), 6, [*listed, InterruptingCallback(epoch_int=2)])
    stopper = keras.callbacks.EarlyStopping("loss", patience=100)
    backup = cls(backup_dir)
    resumed = make_model()
    history = fit(resumed, 5,
                  [stopper, backup] if stopper_first else [backup, stopper])
    if cls is Ours and not stopper_first:
        assert history.epoch == [1, 2, 3, 4]
    else:
        assert history.epoch == [2, 3, 4]
    assert counter(resumed) == iterations(resumed) == 5 * STEPS
    assert_uninterrupted(resumed, 5)


# val_loss of make_model() on these, 9 training samples in batches of 3 and
# 3 validating (validation_split=0.25): lowest after epoch 3, higher after
# each of epochs 4 to 6, so EarlyStopping(patience=3) stops after epoch 6.
_es_rng = np.random.default_rng(55)
ES_X = _es_rng.random((12, 3)).astype("float32")
ES_Y = _es_rng.random((12, 1)).astype("float32")


def _fit_early_stopping(callbacks):
    model = make_model()
    stopper = keras.callbacks.EarlyStopping(
        "val_loss", patience=3, restore_best_weights=True)
    model.fit(ES_X, ES_Y, batch_size=3, epochs=10, validation_split=0.25,
              shuffle=False, verbose=0, callbacks=[*callbacks, stopper])
    return model, stopper


@functools.lru_cache(maxsize=None)
def _early_stopping_uninterrupted():
    model, stopper = _fit_early_stopping([])
    return (tuple(model.get_weights()), stopper.best_epoch,
            stopper.stopped_epoch)


@BOTH
def test_early_stopping_restores_the_best_weights_after_a_resume(cls,
                                                                 tmp_path):
    """EarlyStopping(restore_best_weights=True) ends with the weights of
    its best epoch (3) although the run was interrupted mid-epoch 5: the
    best weights are saved with each generation (callbacks.npz).

    Interrupted in-process, as Keras's scenarios are: the generation on
    disk is what a SIGKILL would leave (the writes are waited for), the
    rerun uses a new model and callbacks, and the point is the callback's
    state, not the crash."""
    expected, best_epoch, stopped_epoch = _early_stopping_uninterrupted()
    assert (best_epoch, stopped_epoch) == (3, 6)
    backup_dir = str(tmp_path / "b")
    with pytest.raises(RuntimeError, match="StepsInterruption"):
        # After the second of epoch 5's three batches, saved after each.
        _fit_early_stopping([cls(backup_dir, save_freq=1),
                             InterruptingCallback(steps_int=5 * 3 + 2)])
    workers.finish_backup_writes()
    resumed, stopper = _fit_early_stopping([cls(backup_dir, save_freq=1)])
    if cls is KERAS:
        # Keras saves no callback state: the rerun's EarlyStopping starts
        # afresh at epoch 5 and keeps other weights.
        assert stopper.best_epoch != 3
        assert max_diff(resumed.get_weights(), expected) > 1e-2
    else:
        assert (stopper.best_epoch, stopper.stopped_epoch) == (3, 6)
        assert max_diff(resumed.get_weights(), expected) <= 1e-6


@BOTH
def test_interrupt_at_epoch_begin(cls, tmp_path):
    """The Keras docstring example: a crash as epoch 4 begins."""
    backup_dir = str(tmp_path / "b")
    crash(make_model(), 6, cls(backup_dir),
          InterruptingCallback(epoch_begin=4))
    resumed = make_model()
    history = fit(resumed, 6, [cls(backup_dir)])
    assert len(history.history["loss"]) == 2
    assert counter(resumed) == iterations(resumed) == 6 * STEPS
    assert_uninterrupted(resumed, 6)


# --- damaged backups ----------------------------------------------------------


def _crash_with_two_saves(cls, backup_dir, **kwargs):
    """Saves at the ends of epochs 0 and 1, then a crash."""
    model = make_model()
    crash(model, 6, cls(backup_dir, **kwargs),
          InterruptingCallback(epoch_int=2))
    return model


@BOTH
def test_backup_corrupted(cls, tmp_path):
    """double_checkpoint=True and the newest weights file overwritten: both
    fall back to the end of epoch 0 (keras-mgpu with a warning)."""
    backup_dir = str(tmp_path / "subdir")
    _crash_with_two_saves(cls, backup_dir, double_checkpoint=True)
    with open(newest_weights_file(cls, backup_dir), "w") as f:
        f.write("0")
    resumed = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = fit(resumed, 5, [cls(backup_dir, double_checkpoint=True)])
    fallback = [w for w in caught if "falling back" in str(w.message)]
    assert len(fallback) == (1 if cls is Ours else 0)
    assert history.epoch == [1, 2, 3, 4]
    assert counter(resumed) == iterations(resumed) == 5 * STEPS
    assert_uninterrupted(resumed, 5)


@BOTH
def test_backup_corrupted_without_double_checkpoint(cls, tmp_path):
    """One checkpoint (the default) and it is damaged: both refuse to go on
    (Keras with h5py's OSError, keras-mgpu naming the generation)."""
    backup_dir = str(tmp_path / "b")
    _crash_with_two_saves(cls, backup_dir)
    with open(newest_weights_file(cls, backup_dir), "w") as f:
        f.write("0")
    resumed = make_model()
    if cls is KERAS:
        with pytest.raises(OSError):
            fit(resumed, 5, [cls(backup_dir)])
    else:
        with pytest.raises(RuntimeError, match=r"Every backup generation in "
                           r".* is unusable: generation 2 .*"
                           "restart_if_unusable=True"):
            fit(resumed, 5, [cls(backup_dir)])
    assert iterations(resumed) == 0


@BOTH
def test_silently_changed_weights(cls, tmp_path):
    """One float of the newest saved kernel changed in place (the file stays
    a valid HDF5 file): Keras loads it and trains on from it; keras-mgpu's
    checksum rejects it and falls back to the previous generation."""
    backup_dir = str(tmp_path / "b")
    model = _crash_with_two_saves(cls, backup_dir, double_checkpoint=True)
    kernel = model.layers[-1].kernel.numpy()  # as saved at epoch 1's end
    path = newest_weights_file(cls, backup_dir)
    data = open(path, "rb").read()
    assert data.count(kernel.tobytes()) == 1
    changed = kernel.copy()
    changed[0, 0] = 100.0
    open(path, "wb").write(data.replace(kernel.tobytes(), changed.tobytes()))
    resumed = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = fit(resumed, 5, [cls(backup_dir, double_checkpoint=True)])
    assert counter(resumed) == iterations(resumed) == 5 * STEPS
    if cls is KERAS:
        assert history.epoch == [2, 3, 4]
        assert max_diff(resumed.get_weights(), _uninterrupted(5)) > 1.0
    else:
        assert history.epoch == [1, 2, 3, 4]
        assert_uninterrupted(resumed, 5)


# --- deleting -----------------------------------------------------------------


@BOTH
def test_model_deleted_case_epoch(cls, tmp_path):
    backup_dir = str(tmp_path / "subdir")
    fit(make_model(), 2, [cls(backup_dir, save_freq="epoch")])
    assert not os.path.exists(backup_dir)


@BOTH
def test_delete_checkpoint_false_keeps_it_for_a_longer_rerun(cls, tmp_path):
    backup_dir = str(tmp_path / "b")
    fit(make_model(), 2, [cls(backup_dir, delete_checkpoint=False)])
    assert os.path.exists(backup_dir)
    resumed = make_model()
    history = fit(resumed, 4, [cls(backup_dir, delete_checkpoint=False)])
    assert history.epoch == [2, 3]
    assert counter(resumed) == iterations(resumed) == 4 * STEPS
    assert_uninterrupted(resumed, 4)
    assert os.path.exists(backup_dir)


@BOTH
def test_a_rerun_with_the_same_epochs_after_delete_checkpoint_false(
        cls, tmp_path):
    """Nothing is left to train: Keras deletes the only record of the run,
    keras-mgpu keeps it and warns."""
    backup_dir = str(tmp_path / "b")
    fit(make_model(), 2, [cls(backup_dir, delete_checkpoint=False)])
    rerun = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = fit(rerun, 2, [cls(backup_dir)])
    assert history.epoch == []
    assert counter(rerun) == iterations(rerun) == 2 * STEPS  # restored
    kept = [w for w in caught if "the backups are kept" in str(w.message)]
    assert len(kept) == (1 if cls is Ours else 0)
    assert os.path.exists(backup_dir) == (cls is Ours)
