"""Whether a generation may be restored into this model: the same format,
variables, random layers and training configuration (what decides the math
of a step). A change is refused with the old and new values."""

from __future__ import annotations

import hashlib
import io
import json

import keras
import numpy as np

from keras_mgpu._version import __version__
from keras_mgpu.callbacks.backup.generation import EXTRA, READABLE_FORMATS


def check_compatible(model, state: dict, where: str, files: dict) -> None:
    """Raises `ValueError` if the generation (`where` names it) cannot be
    resumed by `model`."""
    if state.get("format") not in READABLE_FORMATS:
        raise ValueError(
            f"The backup ({where}) was written by keras-mgpu "
            f"{state.get('keras_mgpu_version')} in format "
            f"{state.get('format')}; this keras-mgpu ({__version__}) reads "
            f"formats {' and '.join(map(str, READABLE_FORMATS))}. Resume "
            "with that version, or use a new backup_dir. The backup was "
            "left untouched."
        )
    if state["architecture"] != fingerprint(model):
        raise ValueError(
            f"The backup ({where}) was made by a model with different "
            "variables (names, shapes or dtypes) than this one. Use a new "
            "backup_dir for a new architecture, or restore the original "
            "model code. The backup was left untouched."
        )
    with np.load(io.BytesIO(files[EXTRA])) as extra:
        saved_random = len(extra.files)
    random = len(unsaved_variables(model))
    if saved_random != random:
        raise ValueError(
            f"The backup ({where}) holds {saved_random} random-generator "
            f"state(s) (Dropout, noise and other random layers); this "
            f"model has {random}: its layers changed. Use a new "
            "backup_dir for the new model, or restore the original model "
            "code. The backup was left untouched."
        )
    saved = state.get("training")
    if saved is not None:
        _check_same_training(saved, training_config(model, None), where)


def unsaved_variables(model) -> list:
    """Model variables that `save_weights` leaves out: RNG seed states."""
    saved = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in saved]


def fingerprint(model) -> str:
    # Shapes and dtypes in order, not names: Keras numbers layer names per
    # process, so the same architecture can be named differently.
    spec = [
        (tuple(v.shape), keras.backend.standardize_dtype(v.dtype))
        for v in model.weights
    ]
    return hashlib.sha256(repr(spec).encode()).hexdigest()


def training_config(model, params) -> dict:
    """What decides the math of a step, besides the weights: the optimizer
    (class and hyperparameters) and the accumulation window: its
    `accum_steps`, or the global batch it is planned from (the plan may
    differ on another replica count). The batch size is checked by the
    runtime as it skips (by samples); replicas may change (the accumulators
    hold global sums); `epochs` is only recorded."""
    optimizer = getattr(model, "optimizer", None)
    return {
        "optimizer": None if optimizer is None else {
            "class": type(optimizer).__name__,
            "config": _hyperparameters(optimizer.get_config()),
        },
        "accum_steps": getattr(model, "accum_steps", None),
        "global_batch_size": getattr(model, "global_batch_size", None),
        "epochs": (params or {}).get("epochs"),
    }


def _hyperparameters(config):
    """A JSON copy of an optimizer config without its names (Keras numbers
    them per process: "adam_1") or its plain learning rate: that is a
    variable, restored with the weights (ReduceLROnPlateau may have changed
    it); a schedule's config is kept."""
    if isinstance(config, dict):
        return {
            key: _hyperparameters(value) for key, value in config.items()
            if key != "name" and not (
                key == "learning_rate" and isinstance(value, (int, float)))
        }
    if isinstance(config, (list, tuple)):
        return [_hyperparameters(v) for v in config]
    return json.loads(json.dumps(config, default=repr))


def _check_same_training(saved: dict, now: dict, where: str) -> None:
    changes = []
    # Written before global batches were saved: None, as it was then.
    key = "global_batch_size" if (
        saved.get("global_batch_size") or now["global_batch_size"]) else (
        "accum_steps")
    if saved.get(key) != now[key]:
        changes.append(f"{key} {saved.get(key)} -> {now[key]}")
    old, new = saved["optimizer"], now["optimizer"]
    if (old is None) != (new is None) or (
            old is not None and old["class"] != new["class"]):
        changes.append(f"optimizer {old and old['class']} -> "
                       f"{new and new['class']}")
    elif old is not None:
        flat_old, flat_new = _flatten(old["config"]), _flatten(new["config"])
        changes += [
            f"optimizer {key} {flat_old.get(key)!r} -> {flat_new.get(key)!r}"
            for key in sorted(set(flat_old) | set(flat_new))
            if flat_old.get(key) != flat_new.get(key)
        ]
    if changes:
        raise ValueError(
            f"The backup ({where}) was trained differently: "
            f"{'; '.join(changes)}. Resuming would not continue that run "
            "(the optimizer's state and schedule would restart or change "
            "meaning). Compile as the saved run did to resume it, or use a "
            "new backup_dir to start fresh. The backup was left untouched."
        )


def _flatten(config, prefix: str = "") -> dict:
    if not isinstance(config, dict):
        return {prefix: config}
    flat = {}
    for key, value in config.items():
        flat.update(_flatten(value, f"{prefix}{key}." if isinstance(
            value, dict) else f"{prefix}{key}"))
    return flat
