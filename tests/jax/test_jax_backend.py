"""keras-mgpu on Keras's JAX backend, 2 forced host devices: the
distribution facts, the in-step program's one all-reduce, the tuner's
scaling, and what is not built yet saying so."""

import json
import math
import pathlib
import re
import subprocess
import sys

import jax
import keras
import keras_tuner
import numpy as np
import pytest
import tensorflow as tf

import keras_mgpu
from keras_mgpu import GradientAccumulationModel
from keras_mgpu import tuner as mgpu_tuner

FEATURES = 6


def mlp(batch_norm=False):
    keras.utils.set_random_seed(3)
    layers = [keras.Input((FEATURES,)), keras.layers.Dense(16, activation="tanh")]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization())
    return keras.Sequential(layers + [keras.layers.Dense(1)])


def test_the_backend_has_two_devices():
    # The JAX run sets XLA_FLAGS=--xla_force_host_platform_device_count=2
    # (Makefile, noxfile.py): every test below needs both.
    assert keras.backend.backend() == "jax"
    assert len(jax.devices()) >= 2


def test_distribution_facts(data_parallel):
    assert keras_mgpu.num_replicas() == 2
    assert keras_mgpu.num_replicas(data_parallel) == 2
    assert keras_mgpu.global_batch_size(8) == 16
    assert keras_mgpu.strategy.of_model(mlp()) is data_parallel
    assert (keras_mgpu.is_chief(), keras_mgpu.worker_index(),
            keras_mgpu.num_workers()) == (True, 0, 1)
    assert not keras_mgpu.strategy.is_multi_worker()
    with pytest.raises(TypeError, match="DataParallel or ModelParallel"):
        keras_mgpu.num_replicas(tf.distribute.get_strategy())


def test_one_device_without_a_distribution():
    assert keras.distribution.distribution() is None
    assert keras_mgpu.num_replicas() == 1
    assert keras_mgpu.global_batch_size(8) == 8


def compiled_collectives(model, x, y) -> dict:
    """The collectives of the compiled train step, read from its HLO:
    how many all-reduces, all-gathers and reduce-scatters."""
    state = model._get_jax_state(trainable_variables=True,
                                 non_trainable_variables=True,
                                 optimizer_variables=True,
                                 metrics_variables=True)
    text = jax.jit(model.train_step).lower(state, (x, y)).compile().as_text()
    return {op: len(re.findall(rf"\b{op}(?:-start)?\(", text))
            for op in ("all-reduce", "all-gather", "reduce-scatter")}


# Each optimizer once, with and without BatchNormalization (the other
# pairs compile the same loop: `make test-all`).
@pytest.mark.parametrize("optimizer, batch_norm", [
    ("sgd", False), ("adam", True),
    pytest.param("sgd", True, marks=pytest.mark.exhaustive),
    pytest.param("adam", False, marks=pytest.mark.exhaustive)])
def test_the_in_step_program_all_reduces_once(data_parallel, optimizer,
                                              batch_norm):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, FEATURES)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    # The data as fit gives it: split along the batch axis.
    sharded = jax.sharding.NamedSharding(
        data_parallel.device_mesh.backend_mesh,
        jax.sharding.PartitionSpec(data_parallel.batch_dim_name))
    counts = {}
    for name, accum_steps, batch in (("plain", None, 8), ("window", 4, 8),
                                     ("in_step", 4, 32)):
        inner = mlp(batch_norm)
        model = inner if accum_steps is None else GradientAccumulationModel(
            inner, accum_steps=accum_steps,
            mode="window" if name == "window" else "in_step")
        model.compile(keras.optimizers.get(
            {"class_name": optimizer, "config": {"global_clipnorm": 1.0}}),
            "mse")
        model.fit(x[:batch], y[:batch], batch_size=batch, verbose=0)
        counts[name] = compiled_collectives(model, *[
            jax.device_put(t[:batch], sharded) for t in (x, y)])["all-reduce"]
    # The in-step window (4 micro-batches of 4 rows per device) reduces
    # its gradient sums, sample count, loss (and moving statistics) once;
    # BatchNormalization's batch statistics add all-gathers, not
    # all-reduces (tests/jax/test_jax_batch_norm.py).
    assert counts["in_step"] == 1, counts
    # One step of a plain or window-mode program is one micro-batch: XLA
    # reduces its gradient (so a window of 4 reduces 4 times).
    assert counts["plain"] >= 1 and counts["window"] >= 1, counts


def test_the_tuner_scales_batch_and_learning_rate(data_parallel, tmp_path):
    def build(hp):
        model = keras.Sequential([keras.Input((FEATURES,)),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(
            hp.Float("learning_rate", 0.01, 0.02)), "mse")
        return model

    hypermodel = mgpu_tuner.StrategyAwareHyperModel(
        build, per_replica_batch_size=4, accum_steps=2, backup=False)
    tuner = keras_tuner.RandomSearch(
        hypermodel, objective="loss", max_trials=1, directory=str(tmp_path))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, FEATURES)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    tuner.search(x, y, epochs=1, verbose=0)
    # KerasTuner cleared Keras's session, and with it the distribution;
    # the hypermodel set it again for the trial.
    assert keras.distribution.distribution() is data_parallel
    trial = next(iter(tuner.oracle.trials.values()))
    assert trial.status == "COMPLETED"

    def metric(name):
        return float(trial.metrics.get_last_value(name))

    assert metric("effective/replicas") == 2
    assert metric("effective/global_batch_size") == 8
    assert metric("effective/batch_size") == 16
    assert metric("effective/lr_scale") == 4.0  # 2 replicas x 2
    assert metric("effective/learning_rate") == pytest.approx(
        4 * trial.hyperparameters.get("learning_rate"), rel=1e-5)
    assert math.isfinite(metric("loss"))


# The module of each module function the JAX step needs (by default the
# trainer's), and the mode that needs it (by default both).
_OWNER_MODULES = {"moments": "keras.src.backend.jax.nn"}
_MODE = {"moments": "in_step", "keras.src.backend.jax.nn": "in_step"}


def _refused(name, replacement, monkeypatch):
    """Wrapping a model is refused, naming the name, when Keras's JAX
    backend (the trainer's class, or the module of a function) lacks
    `name` or has another signature for it, or lacks the module `name`."""
    if name.startswith("keras."):
        if replacement is not None:
            return  # a module has no signature
        import_module = keras_mgpu.compat._core._import_module

        def without(path):
            if path == name:
                raise ImportError(f"No module named {path!r}")
            return import_module(path)

        monkeypatch.setattr(keras_mgpu.compat._core, "_import_module",
                            without)
    else:
        owner = next(
            (cls for cls in keras.Model.__mro__ if name in vars(cls)),
            sys.modules[_OWNER_MODULES.get(
                name, "keras.src.backend.jax.trainer")])
        if replacement is None:
            monkeypatch.delattr(owner, name)
        else:
            monkeypatch.setattr(owner, name, replacement)
    if name in _MODE:
        GradientAccumulationModel(mlp(), accum_steps=2)  # window: unused
    with pytest.raises(keras_mgpu.compat.KerasInternalsError) as error:
        GradientAccumulationModel(mlp(), accum_steps=2,
                                  mode=_MODE.get(name, "window"))
    message = str(error.value)
    assert name in message
    assert f"Keras {keras.__version__}" in message
    assert f"install keras>={keras_mgpu.compat.TESTED_KERAS.low}" in message


def test_a_jax_trainer_without_what_the_step_needs_is_refused(monkeypatch):
    # The private names of the JAX step (compat/jax_trainer.py; those of
    # compat/jax_nn.py, tests/jax/test_jax_logits.py takes away), and the
    # module of Keras's JAX `moments`, taken away in turn and given
    # another signature, as tests/test_compat_mutations.py does for the
    # TensorFlow backend's.
    from keras_mgpu.compat import jax_trainer
    from tests.test_compat_mutations import _required_names

    names = _required_names(
        modules=lambda path: path.name == "jax_trainer.py") | {
            jax_trainer._JAX_NN}
    assert names == {"_update_metrics_variables", "_distribute_data",
                     "moments", "keras.src.backend.jax.nn"}
    for name in names:
        with monkeypatch.context() as patch:
            _refused(name, None, patch)
        with monkeypatch.context() as patch:
            _refused(name, lambda self, state, data: None, patch)


def test_the_accumulation_benchmark_runs(tmp_path):
    # benchmarks/jax_accumulation_vs_keras.py --quick, so that it cannot
    # rot: both modes match the big batch in its run too.
    root = pathlib.Path(__file__).parents[2]
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "jax_accumulation_vs_keras.py"),
         "--quick", "--json", str(report)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cases = json.loads(report.read_text())["cases"]
    ours = [c for c in cases if c["method"].startswith("keras-mgpu")]
    assert len(ours) == 2
    for case in ours:
        assert case["diff"] < 1e-6 and case["moved"] > 1e-3, case
        assert case["iterations"] == case["schedule_steps"] == 4, case
