"""DistributedLogger's event files, read back by TensorBoard itself.

Trains a tiny model with the logger, starts the installed TensorBoard on the
log directory and checks the runs, tags and series through its HTTP data
API: Keras `TensorBoard`'s layout, so `train` and `validation` overlay on
one chart.
"""

import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mgpu.callbacks import DistributedLogger

EPOCHS = 3
BATCHES = 8  # per epoch: 64 samples, batch 8
UPDATE_FREQ = 2
STARTUP_TIMEOUT = 120  # seconds for TensorBoard to load the logs and serve
REQUEST_TIMEOUT = 30
SERVING = "TensorBoard "  # "TensorBoard 2.21.0 at http://...:N/ (Press ..."
_TIMED_OUT = object()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(log_dir, history) of a tiny seeded `fit` with the logger."""
    keras.utils.set_random_seed(0)
    x = np.random.RandomState(0).normal(size=(64, 4)).astype("float32")
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32") + 0.5
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse",
                  metrics=["mae"])
    log_dir = tmp_path_factory.mktemp("tb") / "logs"
    history = model.fit(
        x, y, batch_size=8, epochs=EPOCHS, verbose=0,
        validation_data=(x[:16], y[:16]),
        callbacks=[DistributedLogger(log_dir, update_freq=UPDATE_FREQ,
                                     console=False)])
    return log_dir, history.history


class TensorBoard:
    """A TensorBoard subprocess serving `log_dir` on a free local port.

    `--reload_task blocking --reload_interval 0` loads every event file once,
    before the server is built, so everything is served by the time it
    prints its URL; `--load_fast false` keeps the pure-Python multiplexer
    (no Rust data server).
    """

    def __init__(self, log_dir, tmp_dir):
        env = dict(os.environ)
        env.update({
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "CUDA_VISIBLE_DEVICES": "-1",
            "PYTHONUNBUFFERED": "1",
            # `.tensorboard-info/` is written under the temp dir.
            "TMPDIR": str(tmp_dir),
            # Nothing to fetch: no proxies, no gcloud metadata lookups.
            "NO_GCE_CHECK": "true",
            "no_proxy": "*",
            "NO_PROXY": "*",
        })
        self.stderr = []  # every line, for failure messages
        self._lines = queue.Queue()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main",
             "--logdir", str(log_dir), "--host", "127.0.0.1", "--port", "0",
             "--load_fast", "false", "--reload_task", "blocking",
             "--reload_interval", "0"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True, env=env)
        # Drains stderr for the process's whole life, so a full pipe never
        # blocks it; `None` marks its end.
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = None

    def _read(self):
        for line in self.proc.stderr:
            self.stderr.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def wait_for_url(self, timeout):
        deadline = time.monotonic() + timeout
        while self.url is None:
            remaining = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(remaining, 0))
            except queue.Empty:
                line = _TIMED_OUT
            if line is _TIMED_OUT:
                self.fail(f"no serving line within {timeout} s")
            if line is None:
                self.proc.wait(timeout=REQUEST_TIMEOUT)
                self.fail(f"exited with {self.proc.returncode} before serving")
            if line.startswith(SERVING) and " at http" in line:
                self.url = line.split(" at ", 1)[1].split()[0].rstrip("/")
        return self.url

    def get(self, path, **query):
        url = self.url + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        try:
            with urllib.request.urlopen(url, timeout=REQUEST_TIMEOUT) as r:
                return json.loads(r.read().decode())
        except Exception as e:  # noqa: BLE001 - reported with the stderr
            error = e
        self.fail(f"GET {url}: {error!r}")

    def fail(self, message):
        self.close()
        pytest.fail(f"TensorBoard: {message}\n--- its stderr ---\n"
                    + "".join(self.stderr), pytrace=False)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=REQUEST_TIMEOUT)
        self._reader.join(timeout=REQUEST_TIMEOUT)


@pytest.fixture(scope="module")
def tensorboard(trained, tmp_path_factory):
    log_dir, _ = trained
    server = TensorBoard(log_dir, tmp_path_factory.mktemp("tb_tmp"))
    try:
        server.wait_for_url(STARTUP_TIMEOUT)
        yield server
    finally:
        server.close()


def series(tensorboard, run, tag):
    """[(step, value), ...] of one scalar series, as TensorBoard serves it."""
    rows = tensorboard.get("/data/plugin/scalars/scalars", run=run, tag=tag)
    return [(step, value) for _, step, value in rows]


def test_runs(tensorboard):
    runs = tensorboard.get("/data/runs")
    assert {"train", "validation"} <= set(runs), runs


def test_tags_are_keras_tensorboard_names(tensorboard):
    tags = tensorboard.get("/data/plugin/scalars/tags")
    train, validation = set(tags["train"]), set(tags["validation"])
    assert {t for t in train if "/" not in t} == {
        "batch_loss", "batch_mae", "batch_steps_per_second",
        "epoch_learning_rate", "epoch_loss", "epoch_mae",
        "epoch_steps_per_second",
    }
    assert validation == {
        "epoch_loss", "epoch_mae",
        "evaluation_loss_vs_iterations", "evaluation_mae_vs_iterations",
    }
    # The telemetry, in groups, in `train` only: one worker, no loss scale,
    # no accumulation; `memory/` only with GPUs; the time ledger.
    groups = {t.split("/")[0] for t in train if "/" in t}
    gpus = bool(tf.config.list_logical_devices("GPU"))
    assert groups == {"throughput", "input", "goodput"} | (
        {"memory"} if gpus else set())
    assert {
        "throughput/epoch_examples_per_sec",
        "throughput/batch_examples_per_sec",
        "throughput/epoch_step_time_mean", "throughput/batch_step_time_mean",
        "input/epoch_wait", "input/batch_wait",
    } <= train


def test_epoch_loss_overlays_train_and_validation(tensorboard, trained):
    _, history = trained
    train = series(tensorboard, "train", "epoch_loss")
    validation = series(tensorboard, "validation", "epoch_loss")
    # Same tag, same step axis (the epoch): one chart, two runs.
    assert [s for s, _ in train] == list(range(EPOCHS))
    assert [s for s, _ in validation] == list(range(EPOCHS))
    assert [v for _, v in train] == pytest.approx(history["loss"], rel=1e-6)
    assert [v for _, v in validation] == pytest.approx(
        history["val_loss"], rel=1e-6)
    mae = series(tensorboard, "validation", "epoch_mae")
    assert [v for _, v in mae] == pytest.approx(history["val_mae"], rel=1e-6)


def test_window_and_evaluation_series(tensorboard, trained):
    _, history = trained
    ends = [BATCHES * (e + 1) for e in range(EPOCHS)]  # 8, 16, 24
    batch = dict(series(tensorboard, "train", "batch_loss"))
    # One point per window of UPDATE_FREQ batches, at the global step.
    assert sorted(batch) == list(
        range(UPDATE_FREQ, BATCHES * EPOCHS + 1, UPDATE_FREQ))
    # Keras's loss is the epoch's running mean: an epoch's last window
    # reads the epoch's loss.
    assert [batch[s] for s in ends] == pytest.approx(history["loss"],
                                                     rel=1e-6)
    evaluation = series(tensorboard, "validation",
                        "evaluation_loss_vs_iterations")
    assert [s for s, _ in evaluation] == ends
    assert [v for _, v in evaluation] == pytest.approx(history["val_loss"],
                                                       rel=1e-6)
