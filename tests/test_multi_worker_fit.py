"""Keras 3 `fit` under MultiWorkerMirroredStrategy (keras-team/keras#20585)."""

import subprocess
import sys

import numpy as np
import pytest

from keras_mgpu import launcher
from tests import workers
from tests.conftest import mirrored


def assert_weights_close(a, b, atol):
    assert len(a) == len(b)
    for wa, wb in zip(a, b):
        np.testing.assert_allclose(np.asarray(wa), np.asarray(wb), atol=atol,
                                   rtol=0)


# Adam, whose slots the workers must keep equal; plain SGD: `make test-all`.
@pytest.mark.parametrize("optimizer", [
    "adam", pytest.param("sgd", marks=pytest.mark.exhaustive)])
def test_multi_worker_fit_matches_mirrored_and_single_device(
        run_workers, optimizer):
    # Same global batch (32) and data order: 2 workers x 1 replica x 16,
    # 2 logical CPUs x 16, and one device x 32.
    multi = run_workers(workers.multi_worker_fit,
                        kwargs={"optimizer": optimizer})
    mirrored2 = workers.fit_small_model(mirrored(2), optimizer=optimizer)
    single = workers.fit_small_model(mirrored(1), optimizer=optimizer)

    assert [r.result["multi_worker"] for r in multi] == [True, True]
    assert [r.result["replicas"] for r in multi] == [2, 2]
    assert [r.result["is_chief"] for r in multi] == [True, False]
    # Four steps per epoch, three epochs, in every setting.
    for result in (multi[0].result, multi[1].result, mirrored2, single):
        assert result["iterations"] == 12
    start = workers.initial_weights(workers.build_mlp())
    assert np.abs(np.asarray(single["weights"][0]) - start[0]).max() > 1e-2

    assert_weights_close(multi[0].result["weights"], multi[1].result["weights"],
                         atol=0)
    assert_weights_close(multi[0].result["weights"], single["weights"], 1e-5)
    assert_weights_close(mirrored2["weights"], single["weights"], 1e-5)
    np.testing.assert_allclose(multi[0].result["loss"], single["loss"],
                               rtol=1e-5)
    for key, value in single["evaluation"].items():
        assert multi[0].result["evaluation"][key] == pytest.approx(value,
                                                                   rel=1e-5)
    np.testing.assert_allclose(multi[0].result["predictions"],
                               single["predictions"], atol=1e-5)


def test_multi_worker_clipping_matches_one_process(run_workers):
    """clipnorm, clipvalue and global_clipnorm on 2 workers (auto_strategy
    applies compat.enable_exact_clipping) train as one process does on the
    same global batches, not clipped per worker."""
    results = run_workers(workers.multi_worker_clipped_fits)
    for name in workers.CLIPPING:
        single = workers.clipped_fit(mirrored(1), name)
        for r in results:
            assert_weights_close(r.result[name], single, 1e-5)


def test_stock_keras_multi_worker_fit_still_needs_the_workaround(run_workers):
    """keras-team/keras#20585 is still in the installed Keras.

    The workaround is applied whatever the version (it is also right without
    the bug). When a Keras release fixes the bug, this test fails on it: the
    workaround can then be retired for that release.
    """
    with pytest.raises(launcher.WorkerError) as info:
        run_workers(workers.stock_multi_worker_fit)
    assert "PerReplica" in str(info.value)


def test_multi_worker_fit_on_a_newer_keras_works_and_warns_once(run_workers):
    """A Keras release past the tested range (simulated: 3.16.0) still gets
    the fix: the workaround is decided by the trainer's shape, not a version
    range. One warning per worker names the version; no PerReplica error.
    `steps_per_execution=4` on data of unknown length ends each epoch on
    both workers together, with no batch skipped or repeated."""
    results = run_workers(workers.multi_worker_fit_as_keras,
                          kwargs={"version": "3.16.0"})
    single = workers.fit_small_model(mirrored(1))
    accumulated = workers.accumulation_run(mirrored(2))
    multi_step = workers.fit_small_model(mirrored(1), global_batch=24)
    for r in results:
        assert r.result["plain"]["iterations"] == 12
        assert_weights_close(r.result["plain"]["weights"], single["weights"],
                             1e-5)
        assert r.result["accumulated"]["iterations"] == 6
        assert_weights_close(r.result["accumulated"]["weights"],
                             accumulated["weights"], 1e-5)
        assert r.result["multi_step"]["iterations"] == 18
        assert multi_step["iterations"] == 18
        assert_weights_close(r.result["multi_step"]["weights"],
                             multi_step["weights"], 1e-5)
        np.testing.assert_allclose(r.result["multi_step"]["loss"],
                                   multi_step["loss"], rtol=1e-5)
        [warning] = r.result["untested_warnings"]
        assert "Keras 3.16.0 is installed" in warning
        assert "keras-team/keras#20585" in warning


def test_import_does_not_patch_keras_or_load_optional_packages():
    code = """
import sys
import keras_mgpu
from keras.src.backend.tensorflow import trainer
from keras_mgpu import compat
print("PATCHED_ON_IMPORT", compat.multi_worker_fit_enabled(),
      trainer.reduce_per_replica.__module__)
optional = ["keras_tuner", "wandb", "xprof", "tensorboard_plugin_profile"]
print("OPTIONAL", [m for m in optional if m in sys.modules])
print("ENABLE", compat.enable_multi_worker_fit(), compat.enable_multi_worker_fit(),
      trainer.reduce_per_replica.__module__)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert ("PATCHED_ON_IMPORT False keras.src.backend.tensorflow.trainer"
            in proc.stdout)
    assert "OPTIONAL []" in proc.stdout
    assert "ENABLE True True keras_mgpu.compat" in proc.stdout


def test_other_keras_backend_is_refused_with_a_clear_error(monkeypatch):
    from keras_mgpu import backend

    monkeypatch.setenv("KERAS_BACKEND", "torch")
    with pytest.raises(ImportError) as info:
        backend.active("torch")
    assert "active backend is 'torch' (KERAS_BACKEND='torch')" in str(
        info.value)
    assert "Set KERAS_BACKEND to tensorflow or jax" in str(info.value)
    assert backend.active("tensorflow").NAME == "tensorflow"
    assert backend.distribution("jax").__name__ == (
        "keras_mgpu.backend.jax.distribution")
