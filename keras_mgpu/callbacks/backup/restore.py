"""The restore at the start of `fit`: the newest usable generation, checked
against this model and loaded into it and the runtime."""

from __future__ import annotations

import dataclasses
import io
import warnings
from typing import Optional

import numpy as np

from keras_mgpu import _fs, compat
from keras_mgpu.callbacks.backup import agreement, generation, local_tier
from keras_mgpu.callbacks.backup.compatibility import (check_compatible,
                                                      unsaved_variables)


@dataclasses.dataclass
class Restored:
    """What a restore leaves for later in the `fit`."""

    # The other callbacks' states, applied when the first epoch begins.
    callback_states: Optional[list] = None
    # The backup is at or past the last epoch: kept at the end of `fit`.
    keep_backups: bool = False
    # The chief's line saying where the run resumed from: printed once
    # nothing can refuse the resume any more, not here (the callbacks'
    # states and the batches to skip are still to come).
    announcement: Optional[str] = None


def restore_latest(model, fit, backup_dir: str, params: Optional[dict], *,
                   restart_if_unusable: bool,
                   local: Optional[local_tier.LocalTier] = None) -> Restored:
    """Restores `model` and `fit.runtime` from the newest usable generation
    in `fit.store`, falling back past unusable ones with a warning; nothing
    if there is none. `fit`: who takes part (`runtime`, `strategy`, `chief`,
    `multi_worker`, `store`). With a `local` tier, from its newest
    generation every worker has instead, where that is not older."""
    store = fit.store
    if fit.chief and _fs.exists(backup_dir):
        # What killed saves left: uncommitted, so never read.
        store.remove_leftovers()
    restored = Restored()
    near, claim = None, -1
    if local is not None:
        claim = local_tier.durable_step(store)
        near = local.agreed(fit.strategy, claim)
    if near is not None and near.step >= claim:
        chosen, state, files = near.number, near.state, near.files
    else:
        chosen, state, files = _durable(
            fit, backup_dir, restart_if_unusable or near is not None)
        if near is not None and (
                chosen is None
                or near.step >= state["runtime"]["global_step"]):
            # The durable tier's newest was unusable, and older than the
            # local copy every worker has.
            chosen, state, files = near.number, near.state, near.files
        else:
            near = None
    if local is not None:
        local.keep_up_to(-1 if chosen is None
                         else state["runtime"]["global_step"])
    if chosen is None:
        return restored
    tier, directory = "backup", backup_dir
    if near is not None:
        assert local is not None and local.directory is not None
        tier, directory = "local", local.directory
    check_compatible(model, state, f"generation {chosen} in {directory}",
                     files)
    if not model.built:
        raise ValueError(
            f"Cannot restore from {backup_dir}: the model is not "
            "built. Build it (e.g. give it a keras.Input) before fit()."
        )
    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    # The bytes verified above, not the file read again: no TMPDIR
    # needed either.
    compat.load_weights_file(model, files[generation.WEIGHTS])
    with np.load(io.BytesIO(files[generation.EXTRA])) as extra:
        for i, variable in enumerate(unsaved_variables(model)):
            variable.assign(extra[f"arr_{i}"])
    epochs = (params or {}).get("epochs")
    where = _position(state["epoch"], state["step_in_epoch"])
    if epochs is not None and state["epoch"] >= epochs:
        # fit would train nothing, and then delete the only record of
        # the run as if it had finished.
        restored.keep_backups = True
        warnings.warn(
            f"BackupAndRestore: the backup in {backup_dir} "
            f"(generation {chosen}) is {where}, but fit(epochs={epochs}) "
            f"ends with epoch {epochs}: nothing is trained and the backups "
            "are kept. Raise epochs to continue that run, or use a new "
            "backup_dir to start another.",
            stacklevel=3,
        )
    compat.set_initial_epoch(model, state["epoch"])
    fit.runtime.resume(state["runtime"], generation=chosen,
                       epoch=state["epoch"],
                       step_in_epoch=state["step_in_epoch"])
    restored.callback_states = state["callbacks"]
    if fit.chief:
        restored.announcement = (
            f"BackupAndRestore: resumed from {tier} generation {chosen} "
            f"{where} ({directory})")
    return restored


def _durable(fit, backup_dir: str, restart_if_unusable: bool) -> tuple:
    """(number, state, files) of the newest usable durable generation, the
    workers agreed; (None, None, None) if there is none (an error if every
    one is unusable, unless `restart_if_unusable`)."""
    found = fit.store.latest_usable(generation.REQUIRED,
                                    validate=generation.parse_state)
    chosen = found.number
    unusable = [f"generation {n} ({why})" for n, why in found.unusable]
    fallbacks = [n for n, _ in found.unusable[1:]] + [chosen]
    for (number, why), fallback in zip(found.unusable, fallbacks):
        if fallback is not None:
            warnings.warn(
                f"BackupAndRestore: generation {number} in "
                f"{backup_dir} is unusable ({why}); falling back "
                f"to generation {fallback}.",
                stacklevel=3,
            )
    if fit.multi_worker:
        agreement.check_same_generation(fit.strategy, chosen or 0, backup_dir)
    if chosen is None and unusable:
        _all_unusable(backup_dir, unusable, restart_if_unusable)
    return chosen, found.value, found.files


def _position(epoch: int, step_in_epoch: int) -> str:
    """Where a generation was saved (`epoch` from 0, as Keras passes it),
    counted as Keras's progress bar counts: from 1, the step being the
    batches of that epoch already trained (its bar's `4/8`)."""
    if step_in_epoch:
        return f"at epoch {epoch + 1}, step {step_in_epoch}"
    return f"at the start of epoch {epoch + 1}"


def _all_unusable(backup_dir: str, unusable: list,
                  restart_if_unusable: bool) -> None:
    message = (
        f"Every backup generation in {backup_dir} is unusable: "
        f"{'; '.join(unusable)}."
    )
    if not restart_if_unusable:
        raise RuntimeError(
            f"{message} Nothing was restored and nothing was deleted. To "
            "train from the start, pass restart_if_unusable=True or use a "
            "new backup_dir."
        )
    warnings.warn(f"BackupAndRestore: {message} Training from the start "
                  "(restart_if_unusable=True).", stacklevel=4)
