"""Callback state saved with each backup generation: the protocol
(`get_state`/`set_state`, `register_callback_state`) and Keras's adapters."""

import json
import os

import keras
import numpy as np
import pytest

from keras_mgpu.callbacks import BackupAndRestore, register_callback_state
from keras_mgpu.callbacks.backup import state as callback_state
from tests import workers
from tests.test_backup_keras_scenarios import (InterruptingCallback, X, Y,
                                               make_model, max_diff)


class KernelLog(keras.callbacks.Callback):
    """A user's callback with the protocol: the epochs it saw, and the
    Dense kernel after each (an array that grows)."""

    def __init__(self):
        super().__init__()
        self.epochs = []
        self.kernels = np.zeros((0, 3, 1), "float32")

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(epoch)
        kernel = self.model.layers[-1].kernel.numpy()
        self.kernels = np.concatenate([self.kernels, kernel[None]])

    def get_state(self):
        return {"epochs": self.epochs, "kernels": self.kernels}

    def set_state(self, state):
        self.epochs = state["epochs"]
        self.kernels = state["kernels"]


def _fit(callbacks, epochs=3):
    model = make_model()
    model.fit(X, Y, batch_size=4, epochs=epochs, shuffle=False, verbose=0,
              callbacks=callbacks)
    return model


def test_a_users_callback_state_is_saved_and_restored(tmp_path):
    """Saved mid-epoch 1 (after the fourth of 9 batches), restored into the
    rerun's new callback (listed before the backup, then after it): it
    ends as in the uninterrupted run, its array read back from the
    generation's callbacks.npz."""
    expected = KernelLog()
    _fit([expected])
    backup_dir = str(tmp_path / "b")
    with pytest.raises(RuntimeError, match="StepsInterruption"):
        _fit([KernelLog(), BackupAndRestore(backup_dir, save_freq=2),
              InterruptingCallback(steps_int=5)])
    workers.finish_backup_writes()
    newest = max(n for n in os.listdir(backup_dir) if n.startswith("gen-"))
    with open(os.path.join(backup_dir, newest, "MANIFEST.json")) as f:
        assert callback_state.ARRAYS_FILE in json.load(f)["files"]
    resumed = KernelLog()
    _fit([BackupAndRestore(backup_dir, save_freq=2), resumed])
    assert resumed.epochs == expected.epochs == [0, 1, 2]
    assert resumed.kernels.shape == expected.kernels.shape == (3, 3, 1)
    assert max_diff(resumed.kernels, expected.kernels) <= 1e-6


class Library(keras.callbacks.Callback):
    """A callback whose code is not the user's: registered by class."""

    def __init__(self):
        super().__init__()
        self.table = None


def _round_trip(before, after):
    entries, arrays = callback_state.snapshot(before)
    # As saved: through JSON, the arrays through callbacks.npz.
    entries = json.loads(json.dumps(entries, allow_nan=True))
    callback_state.restore(after, callback_state.decode(entries, arrays))


def test_keras_adapters_and_a_registered_class_round_trip():
    register_callback_state(
        Library, lambda c: {"table": c.table},
        lambda c, state: setattr(c, "table", state["table"]))
    stopper = keras.callbacks.EarlyStopping(restore_best_weights=True)
    stopper.wait, stopper.stopped_epoch, stopper.best_epoch = 2, 0, 3
    stopper.best = np.float32(0.25)
    stopper.best_weights = [np.arange(6, dtype="float32").reshape(3, 2),
                            np.float32(7.0)]
    plateau = keras.callbacks.ReduceLROnPlateau()
    plateau.best, plateau.wait, plateau.cooldown_counter = 0.5, 1, 2
    checkpoint = keras.callbacks.ModelCheckpoint("m.keras",
                                                 save_best_only=True)
    checkpoint.best = float("inf")
    library = Library()
    library.table = {"rows": (1, 2.5, None, "x"),
                     "data": [np.ones((2,), "int64"), {"v": np.int8(-3)}]}
    after = [keras.callbacks.EarlyStopping(restore_best_weights=True),
             keras.callbacks.ReduceLROnPlateau(),
             keras.callbacks.ModelCheckpoint("m.keras", save_best_only=True),
             Library()]
    _round_trip([stopper, plateau, checkpoint, library], after)
    es, rp, mc, lib = after
    assert (es.wait, es.stopped_epoch, es.best_epoch, es.best) == (
        2, 0, 3, 0.25)
    assert es.best.dtype == np.float32  # NumPy scalars keep their dtype
    assert np.array_equal(es.best_weights[0], stopper.best_weights[0])
    assert es.best_weights[1] == np.float32(7.0)
    assert np.ndim(es.best_weights[1]) == 0  # set_weights needs the shape
    assert (rp.best, rp.wait, rp.cooldown_counter) == (0.5, 1, 2)
    assert mc.best == float("inf")
    assert lib.table["rows"] == [1, 2.5, None, "x"]  # tuples come back lists
    assert lib.table["data"][0].dtype == np.int64
    assert lib.table["data"][1]["v"] == -3


def test_callbacks_are_matched_by_class_and_position():
    """The k-th callback of a class gets the k-th saved state of that class;
    a class whose count changed gets nothing, with a warning."""
    saved = [keras.callbacks.EarlyStopping(), keras.callbacks.EarlyStopping(),
             keras.callbacks.ReduceLROnPlateau()]
    saved[0].wait, saved[1].wait, saved[2].wait = 1, 2, 3
    now = [keras.callbacks.ReduceLROnPlateau(),
           keras.callbacks.EarlyStopping()]
    with pytest.warns(UserWarning, match=r"EarlyStopping: 2 saved, 1 now"):
        _round_trip(saved, now)
    assert (now[0].wait, now[1].wait) == (3, 0)


def test_backups_written_before_the_protocol_are_read():
    decoded = callback_state.decode(
        [{"class": "EarlyStopping", "values": {"wait": 1, "best": 0.5}}],
        None)
    stopper = keras.callbacks.EarlyStopping()
    callback_state.restore([stopper], decoded)
    assert (stopper.wait, stopper.best, stopper.best_weights) == (1, 0.5,
                                                                  None)


class _Stateful(keras.callbacks.Callback):
    def __init__(self, state):
        super().__init__()
        self.state = state

    def get_state(self):
        return self.state

    def set_state(self, state):
        pass


@pytest.mark.parametrize("state, error, match", [
    ([1], TypeError, r"_Stateful.get_state\(\) must return a dict, got list"),
    ({1: 2}, TypeError, r"has the key 1: the keys .* must be strings"),
    ({"a": {"__ndarray__": "a0"}}, ValueError, r"_Stateful.get_state\(\)"
     r"\['a'\] has the key '__ndarray__', which BackupAndRestore reserves"),
    ({"a": [object()]}, TypeError, r"_Stateful.get_state\(\)\['a'\]\[0\] "
     r"is of type object .*JSON values"),
    ({"a": np.array([None])}, TypeError, r"array of Python objects"),
])
def test_a_state_that_cannot_be_saved_is_named(state, error, match):
    with pytest.raises(error, match=match):
        callback_state.snapshot([_Stateful(state)])


def test_half_the_protocol_and_bad_registrations_are_refused():
    class GetOnly(keras.callbacks.Callback):
        def get_state(self):
            return {}

    with pytest.raises(TypeError, match=r"GetOnly has get_state but no "
                       r"set_state"):
        callback_state.stateful_callbacks([GetOnly()])
    with pytest.raises(TypeError, match=r"needs a callback class, got 3"):
        register_callback_state(3, dict, dict)
    with pytest.raises(TypeError, match=r"Library, \.\.\.\): set_state must "
                       r"be a function, got None"):
        register_callback_state(Library, dict, None)


def test_an_array_missing_from_the_generation_is_named():
    with pytest.raises(ValueError, match=r"a callback state's array 'a0' is "
                       r"not in its callbacks.npz"):
        callback_state.decode(
            [{"class": "X", "state": {"w": {"__ndarray__": "a0"}}}], None)
