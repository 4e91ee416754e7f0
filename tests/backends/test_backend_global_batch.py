"""`GradientAccumulationModel(global_batch_size=...)` on the active Keras
backend: one device and 2 replicas plan different micro-batches per step
and train the same steps, and a window saved half-way on one resumes on
the other, or is refused where its micro-batches cannot tile it."""

import contextlib

import keras
import pytest

from keras_mgpu import GradientAccumulationModel
from tests.backends.test_backend_accumulation import (
    OPTIMIZERS, big_batch_run, data, max_diff, mlp)

GLOBAL = 16
MICRO = 4


def wrapper(scope, micro=MICRO, global_batch=GLOBAL):
    with scope():
        model = GradientAccumulationModel(
            mlp(), global_batch_size=global_batch, micro_batch_size=micro,
            partial_window="carry")
        model.compile(OPTIMIZERS["adam_clipnorm"](), "mse")
        model.optimizer.build(model.trainable_variables)
    return model


def fit(scope, model, rows):
    x, y, w = data(40)
    with scope():
        model.fit(x[rows], y[rows], sample_weight=w[rows], verbose=0,
                  shuffle=False)


@pytest.mark.parametrize("replicas", [1, 2])
def test_each_replica_count_trains_the_big_batch_step(two_replicas,
                                                      replicas):
    scope = two_replicas if replicas == 2 else contextlib.nullcontext
    model = wrapper(scope)
    # 4 micro-batches of 4 on one device, 2 of 8 on 2 replicas.
    assert model.accum_steps == 4 // replicas
    fit(scope, model, slice(0, 32))
    assert int(model.optimizer.iterations.numpy()) == 2
    assert max_diff(model.inner, big_batch_run("adam_clipnorm", n=32)) < 1e-5


@pytest.mark.parametrize("saved_on, resumed_on", [(2, 1), (1, 2)])
def test_a_half_window_resumes_on_another_replica_count(
        two_replicas, tmp_path, saved_on, resumed_on):
    """A window holding 8 samples: 1 micro-batch on 2 replicas, 2 on one
    device; counted in the other's micro-batches when resumed."""
    scopes = {1: contextlib.nullcontext, 2: two_replicas}
    path = str(tmp_path / "window.weights.h5")
    first = wrapper(scopes[saved_on])
    fit(scopes[saved_on], first, slice(0, 24))
    assert (first.update_count, first.micro_step) == (1, 2 // saved_on)
    first.save_weights(path)
    resumed = wrapper(scopes[resumed_on])
    resumed.load_weights(path)
    fit(scopes[resumed_on], resumed, slice(24, 32))
    assert (resumed.update_count, resumed.micro_step) == (2, 0)
    assert max_diff(resumed.inner, big_batch_run("adam_clipnorm", n=32)) < 1e-5


def test_a_half_window_its_micro_batches_cannot_tile_is_refused(
        two_replicas, tmp_path):
    """3 samples, saved on one device with micro-batches of 3, cannot be
    counted in 2 replicas' micro-batches of 6."""
    path = str(tmp_path / "window.weights.h5")
    first = wrapper(contextlib.nullcontext, micro=3, global_batch=12)
    fit(contextlib.nullcontext, first, slice(0, 3))
    first.save_weights(path)
    resumed = wrapper(two_replicas, micro=3, global_batch=12)
    resumed.load_weights(path)
    with pytest.raises(ValueError) as error:
        fit(two_replicas, resumed, slice(3, 15))
    assert ("The window being resumed holds 3 samples (1 micro-batch(es) of "
            "the saved run); this run's micro-batches of 6 samples do not "
            "tile them") in str(error.value)
    assert resumed.update_count == 0
