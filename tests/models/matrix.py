"""What the tested-models matrix's checks share (tests/models/): the
sizes, the models' parameters (`.ci/run` runs `CI_MODELS`, the others are
marked `full_matrix`, which `nox -s models` runs too; the life-cycle checks
run `CI_LIFECYCLE_MODELS`, the kill and resume `CI_KILL_MODELS`, the rest
of `CI_MODELS` there is `exhaustive`),
one `fit` of a catalogue model, and `record`: with
`KERAS_MGPU_MATRIX_LOG=<path>` each check appends what it measured there
(one JSON line), which
`tests/models/report.py` turns into docs/models.md's table.
"""

import json
import os

import keras
import numpy as np
import pytest

from tests.models.catalogue import (
    CI_KILL_MODELS, CI_LIFECYCLE_MODELS, CI_MODELS, MODELS)

BACKEND = keras.backend.backend()
MICRO = 8  # global micro-batch
ACCUM = 2
SAMPLES = 32  # two windows


def model_params(default=CI_MODELS):
    """Every model as a test parameter: `default`'s for this backend
    unmarked, the rest of `CI_MODELS` marked `exhaustive`, the others
    `full_matrix`."""
    def marks(name):
        if name in default[BACKEND]:
            return ()
        if name in CI_MODELS[BACKEND]:
            return pytest.mark.exhaustive
        return pytest.mark.full_matrix

    return [pytest.param(name, marks=marks(name)) for name in MODELS]


MODEL_PARAMS = model_params()
LIFECYCLE_PARAMS = model_params(CI_LIFECYCLE_MODELS)
KILL_PARAMS = model_params(CI_KILL_MODELS)
# `(name, mode)` for accumulation: window mode as `MODEL_PARAMS`, in-step
# mode as the life cycle's (the convnet's in-step run takes the loop its
# window run and the transformer's in-step run take: `make test-all`).
MODE_PARAMS = [
    pytest.param(p.values[0], mode, marks=p.marks, id=f"{p.values[0]}-{mode}")
    for window, in_step in zip(MODEL_PARAMS, LIFECYCLE_PARAMS)
    for mode, p in (("window", window), ("in_step", in_step))]


def record(model, check, **measured):
    path = os.environ.get("KERAS_MGPU_MATRIX_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"model": model, "backend": BACKEND,
                                "check": check, **measured}) + "\n")


def max_diff(a, b):
    return max(float(np.abs(np.asarray(u, "float64") - np.asarray(v)).max())
               for u, v in zip(a, b))


def crossentropy(from_logits=True):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits)


def subset(x, index):
    return ({k: v[index] for k, v in x.items()} if isinstance(x, dict)
            else x[index])


def fit(entry, scope, batch, x, y, optimizer, wrap=None, weights=None):
    """One epoch of `entry`'s model (wrapped by `wrap`) in `scope`, from
    the given initial weights; returns the inner model."""
    with scope():
        model = entry.build()
        if weights is not None:
            model.set_weights(weights)
        trained = wrap(model) if wrap else model
        trained.compile(optimizer(), crossentropy())
        trained.fit(x, y, batch_size=batch, epochs=1, shuffle=False,
                    verbose=0)
    return model


def reference_order(samples, devices, accum, micro):
    """In-step mode on JAX normalises each global micro-batch k: every
    device's k-th slice of its share. The order that puts those groups
    one after another, for a reference at the micro-batch size."""
    share = samples // devices
    size = micro // devices
    return np.concatenate([
        np.arange(d * share + k * size, d * share + (k + 1) * size)
        for k in range(accum) for d in range(devices)])
