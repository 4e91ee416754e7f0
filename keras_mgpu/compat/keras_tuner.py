"""KerasTuner's internals (keras_tuner/src/engine): its trial callback,
the best checkpoint of a resumed trial (`SaveBestEpoch`) and the oracle's
saved state.
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Any

from keras_mgpu.compat._core import (
    KerasInternalsError,
    _lock,
    _require,
    _require_module,
)
from keras_mgpu.compat.registry import _TUNER_BEST, _TUNER_STATE


# --- KerasTuner's trial callback (keras_mgpu.tuner) ---------------------------
# keras-tuner 1.4 appends its private `tuner_utils.TunerCallback(tuner,
# trial)` to every trial's callbacks.


def tuner_and_trial(callbacks):
    """(tuner, trial) from the callbacks KerasTuner passes to `fit`, or None.

    `HyperModel.fit` gets no trial; the trial id and the tuner's
    `get_trial_dir` key the per-trial backup.
    """
    for callback in callbacks:
        tuner = getattr(callback, "tuner", None)
        trial = getattr(callback, "trial", None)
        if (
            tuner is not None
            and hasattr(tuner, "get_trial_dir")
            and getattr(trial, "trial_id", None) is not None
        ):
            return tuner, trial
        if type(callback).__name__ == "TunerCallback":
            # KerasTuner's own callback, reshaped: say so rather than run
            # the search without per-trial backups.
            import keras_tuner

            raise KerasInternalsError(
                "keras-mgpu finds the trial through KerasTuner's "
                "TunerCallback(tuner, trial), but in KerasTuner "
                f"{keras_tuner.__version__} it has no `tuner` with "
                "`get_trial_dir` and `trial` with `trial_id`. Install "
                "keras-tuner 1.4.x, or pass backup=False to "
                "StrategyAwareHyperModel."
            )
    return None


# --- KerasTuner's best checkpoint (keras_mgpu.tuner) ---------------------------
# KerasTuner 1.4.8's `Tuner.run_trial` appends its private
# `tuner_utils.SaveBestEpoch` to every trial's callbacks
# (https://github.com/keras-team/keras-tuner/blob/v1.4.8/keras_tuner/src/engine/tuner_utils.py):
# it writes the trial's best checkpoint when an epoch beats `best_value`,
# which starts at -inf or inf in each fit. A trial resumed by its backup
# would take its first resumed epoch as the best, so `best_value` is saved
# with each generation. Remove when KerasTuner restores it itself (a
# resumed trial's checkpoint is then right without it: tests/test_tuner.py
# shows it).


def save_best_epoch_class() -> type:
    """KerasTuner's `SaveBestEpoch` callback class."""
    tuner_utils = _require_module("keras_tuner.src.engine.tuner_utils",
                                  _TUNER_BEST)
    return _require(tuner_utils, "SaveBestEpoch", _TUNER_BEST)


def save_best_epoch_state(callback) -> dict:
    """The state of a `SaveBestEpoch` that decides its next checkpoint."""
    return {"best_value": _require(callback, "best_value", _TUNER_BEST)}


def check_save_best_epoch(callbacks) -> None:
    """Raises `KerasInternalsError` unless each KerasTuner `SaveBestEpoch`
    among `callbacks` has the state a trial's backup saves (called as the
    trial's `fit` begins, before any step)."""
    best = save_best_epoch_class()
    for callback in callbacks:
        if isinstance(callback, best):
            save_best_epoch_state(callback)


def set_save_best_epoch_state(callback, state: dict) -> None:
    _require(callback, "best_value", _TUNER_BEST)
    callback.best_value = state["best_value"]


# --- KerasTuner's oracle state (keras_mgpu.tuner) -----------------------------
# KerasTuner 1.4.8's `Oracle.end_trial` saves `oracle.json` before it takes
# the ended trial out of `ongoing_trials`, and nothing saves the oracle after
# the last trial ends, so the file of a finished search still lists a trial
# as ongoing. `Oracle.reload` sends every ongoing trial of the file for a
# retry (`_retry_queue`): a rerun of the project trains that finished trial
# again. `tests/test_compat.py` shows whether the installed KerasTuner still
# saves in that order.

_tuner_state_fix_enabled = False

# Set by `keras_mgpu.tuner.launch` for the chief: the tuner ids of every
# worker it starts. KerasTuner's chief exits once no tuner it has heard of
# is left, so a worker that asks for its first trial after the others got
# STOPPED (on the rerun of a finished search, say) finds it gone.
TUNER_IDS_ENV = "KERAS_MGPU_TUNER_IDS"
_expecting: weakref.WeakSet[Any] = weakref.WeakSet()  # oracles


def enable_tuner_state_fix() -> bool:
    """Keeps ended trials out of KerasTuner's retries, and out of its file.

    Wraps two methods of `keras_tuner.Oracle` (every oracle, the chief's of
    a parallel search too): `reload` no longer queues for a retry a trial
    that had ended (COMPLETED or FAILED) although the file listed it as
    ongoing, and `create_trial` saves the oracle when it answers STOPPED,
    so the file of a finished search lists no ongoing trial. A trial
    interrupted while running (RUNNING) or invalid is still retried. With
    `KERAS_MGPU_TUNER_IDS` set (`keras_mgpu.tuner.launch` sets it), the
    oracle counts those tuners as running from its first trial on, so a
    parallel chief waits until each of them got STOPPED. Right with or
    without the KerasTuner ordering, so applied whatever its version.
    Idempotent.

    Returns:
        Whether this call applied it (False if it already was).
    """
    global _tuner_state_fix_enabled
    import keras_tuner

    with _lock:
        if _tuner_state_fix_enabled:
            return False
        oracle_class = keras_tuner.Oracle
        reload = _require(oracle_class, "reload", _TUNER_STATE)
        create_trial = _require(oracle_class, "create_trial", _TUNER_STATE)
        status = keras_tuner.engine.trial.TrialStatus
        ended = (status.COMPLETED, status.FAILED)

        @functools.wraps(reload)
        def reload_without_ended_trials(self):
            reload(self)
            queue = _require(self, "_retry_queue", _TUNER_STATE)
            queue[:] = [trial_id for trial_id in queue
                        if self.trials[trial_id].status not in ended]

        def create_trial_saved_when_stopped(self, tuner_id):
            expected = os.environ.get(TUNER_IDS_ENV)
            if expected and self not in _expecting:
                _expecting.add(self)
                self.tuner_ids.update(expected.split(","))
            trial = create_trial(self, tuner_id)
            if trial.status == status.STOPPED:
                self.save()
            return trial

        oracle_class.reload = reload_without_ended_trials
        # Under the oracle's own lock, as KerasTuner's create_trial is.
        oracle_class.create_trial = keras_tuner.synchronized(
            create_trial_saved_when_stopped)
        _tuner_state_fix_enabled = True
        return True


# --- Input wait and batch count (keras_mgpu.runtime) -------------------------
# Keras's TensorFlow trainer makes `model.train_function` a plain closure
# `function(iterator)` over `multi_step_on_iterator`, a `tf.function` that
# fetches each batch inside the graph and returns an `Optional` that
# `function` unwraps (raising StopIteration when empty); in the 3.16
# nightlies `function` fetches the batch of a one-step call on the host and
# calls `one_step_on_data` itself. A callback
# can neither time an in-graph fetch from the host nor see how many batches
# a call fetched (fewer than `steps_per_execution` where the data ends), so
# the same Python step is retraced with an iterator whose fetches are timed
# and counted. `function` itself is re-created here: `_KNOWN_SHAPES` checks
# that Keras's is one of the shapes this copy follows.
