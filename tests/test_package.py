"""The `keras_mgpu` package: what `import keras_mgpu` gives, and its console."""

import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import keras
import numpy as np
import pytest

import keras_mgpu
from keras_mgpu import compat
from keras_mgpu.callbacks import DistributedLogger
from keras_mgpu.layers import FP32OutputHead

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, *args: str) -> str:
    """Runs `code` in a fresh interpreter; returns its stdout."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="-1", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=240,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    return proc.stdout


# --- Exports --------------------------------------------------------------------


def test_loss_scale_monitor_is_a_keras_mgpu_callback():
    from keras_mgpu.callbacks import loss_scale_monitor

    monitor = keras_mgpu.callbacks.LossScaleMonitor
    assert monitor is loss_scale_monitor.LossScaleMonitor
    assert monitor.__module__ == "keras_mgpu.callbacks.loss_scale_monitor"
    # The old home keeps working.
    assert keras_mgpu.mixed_precision.LossScaleMonitor is monitor
    assert keras_mgpu.mixed_precision.loss_scale is loss_scale_monitor.loss_scale


def test_missing_keras_tuner_attribute_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "keras_tuner", None)
    monkeypatch.delitem(sys.modules, "keras_mgpu.tuner", raising=False)
    if "tuner" in vars(keras_mgpu):  # getattr would import it
        monkeypatch.delattr(keras_mgpu, "tuner")
    with pytest.raises(ImportError,
                       match=r'pip install "keras-mgpu\[tuner\]"'):
        keras_mgpu.tuner  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'not_a_module'"):
        keras_mgpu.not_a_module  # noqa: B018


def test_saved_classes_load_after_import_keras_mgpu_alone(tmp_path):
    # Saved where keras_mgpu.tuner (and keras-tuner) is imported...
    pytest.importorskip("keras_tuner")
    from keras_mgpu import tuner

    base = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                              FP32OutputHead(3, activation="softmax")])
    model = keras_mgpu.GradientAccumulationModel(inner, accum_steps=2)
    model.compile(keras.optimizers.SGD(tuner.ScaledSchedule(base, 4.0)),
                  "sparse_categorical_crossentropy")
    model.fit(np.ones((8, 4), "float32"), np.zeros(8, "float32"),
              batch_size=4, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    expected = float(tuner.ScaledSchedule(base, 4.0)(10))

    # ...loaded where only `import keras_mgpu` ran; then the lazy
    # attributes, keras-tuner imported by the first use of keras_mgpu.tuner.
    out = run_python("""
        import sys
        # First import through the old name: no import cycle.
        from keras_mgpu.mixed_precision import LossScaleMonitor
        import keras, keras_mgpu
        from keras_mgpu import compat

        assert "keras_tuner" not in sys.modules
        assert "keras_mgpu.tuner" not in sys.modules
        for name in ("ScaledSchedule", "FP32OutputHead",
                     "GradientAccumulationModel"):
            assert keras.saving.get_registered_object(
                "keras_mgpu>" + name) is not None, name
        model = keras.models.load_model(sys.argv[1])
        assert type(model).__name__ == "GradientAccumulationModel"
        assert type(model.inner.layers[-1]).__name__ == "FP32OutputHead"
        schedule = compat.learning_rate_schedule(
            getattr(model.optimizer, "inner_optimizer", model.optimizer))
        assert type(schedule) is keras_mgpu.schedules.ScaledSchedule
        assert abs(float(schedule(10)) - float(sys.argv[2])) < 1e-7
        assert "keras_tuner" not in sys.modules

        names = dir(keras_mgpu)
        for name in ("tuner", "launcher", "runtime", "cli", "callbacks",
                     "data", "schedules", "mixed_precision"):
            assert name in names, name
        assert "keras_tuner" not in sys.modules
        assert keras_mgpu.launcher.run_local_workers
        tuner = keras_mgpu.tuner
        assert "keras_tuner" in sys.modules
        assert tuner is sys.modules["keras_mgpu.tuner"]
        assert tuner.ScaledSchedule is keras_mgpu.schedules.ScaledSchedule
        assert LossScaleMonitor is keras_mgpu.callbacks.LossScaleMonitor
        print("loaded", float(schedule(10)))
    """, path, repr(expected))
    assert f"loaded {expected}" in out
    assert type(compat.learning_rate_schedule(model.optimizer)) is \
        keras_mgpu.schedules.ScaledSchedule


# --- Console lines and Keras's progress bar ---------------------------------------


@pytest.mark.parametrize("verbose", [1, "auto", 2, 0])
def test_console_line_starts_its_own_line_after_keras_epoch(verbose, capsys,
                                                            tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    capsys.readouterr()
    model.fit(np.ones((32, 4)), np.ones((32, 1)), batch_size=8, epochs=2,
              verbose=verbose,
              callbacks=[DistributedLogger(tmp_path, update_freq=2)])
    out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    lines = out.split("\n")
    ours = [i for i, line in enumerate(lines) if "DistributedLogger" in line]
    assert len(ours) == 2, out
    for epoch, i in enumerate(ours, start=1):
        # A line of its own (not glued to the bar's `loss: 0.1234`)...
        assert lines[i].startswith(f"DistributedLogger epoch {epoch}: "), out
        # ...after Keras's finished epoch line (the bar's last redraw).
        if verbose:
            assert lines[i - 1].split("\r")[-1].lstrip().startswith("4/4"), \
                out
    if not verbose:
        assert ours == [0, 1], out  # no bar: printed at each epoch's end


# --- One import name --------------------------------------------------------------


def test_the_root_names_are_the_components_own():
    out = run_python("""
        import sys, keras_mgpu
        keras_mgpu.quiet_tensorflow
        print("keras" in sys.modules, "tensorflow" in sys.modules)
        for name in sorted(set(keras_mgpu.__all__) - {"__version__"}):
            value = getattr(keras_mgpu, name)
            module = sys.modules[value.__module__]
            print(name, getattr(module, name) is value,
                  value.__module__.startswith("keras_mgpu."))
    """)
    lines = out.splitlines()
    # Naming quiet_tensorflow imports neither Keras nor TensorFlow.
    assert lines[0] == "False False"
    names = [line.split()[0] for line in lines[1:]]
    assert {"DistributedLogger", "BackupAndRestore", "quiet_tensorflow",
            "GradientAccumulationModel", "auto_strategy"} <= set(names)
    assert all(line.endswith("True True") for line in lines[1:]), lines


def test_python_dash_m_runs_the_command_without_tensorflow():
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "keras_mgpu", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage: keras-mgpu ")
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0]
                for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert "keras_mgpu" in imported
    assert not {"keras", "tensorflow"} & imported


def test_the_wheel_installs_one_top_level_name(tmp_path):
    # From a copy of what the build reads (no build/ left over from an
    # earlier one), with the environment's setuptools: no download.
    source = tmp_path / "source"
    shutil.copytree(os.path.join(ROOT, "keras_mgpu"), source / "keras_mgpu",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.cfg", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), source)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps",
         "--no-build-isolation", "-w", str(tmp_path), str(source)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [wheel] = tmp_path.glob("keras_mgpu-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        [info] = {n.split("/")[0] for n in names if ".dist-info/" in n}
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
        top_level = archive.read(f"{info}/top_level.txt").decode().split()
    installed = {n.split("/")[0] for n in names} - {info}
    assert installed == {"keras_mgpu"} and top_level == ["keras_mgpu"]
    assert "keras_mgpu/py.typed" in names
    assert "keras-mgpu = keras_mgpu.cli:main" in entry_points
