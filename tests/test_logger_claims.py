"""One writer per log_dir: every way two `DistributedLogger` runs could
write one log_dir at once is refused, naming the run that writes it."""

import json
import os
import subprocess
import sys
import threading

import keras
import numpy as np
import pytest

from keras_mgpu.callbacks import DistributedLogger, LogDirInUse
from tests.logger_checks import metrics_only
from tests.test_backup_lock import first_line

TIMEOUT = 240
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fit(*callbacks):
    """Two batches of a one-layer model, one epoch."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(np.ones((16, 2)), np.ones((16, 1)), batch_size=8, epochs=1,
              verbose=0, callbacks=list(callbacks))


def _logger(log_dir):
    return DistributedLogger(log_dir, update_freq=1, console=False)


def _records(log_dir):
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [(r["kind"], r["step"])
                for r in metrics_only(map(json.loads, f))]


ONE_FIT = [("window", 1), ("window", 2), ("epoch", 2)]


class _Held:
    """A fit on another thread, held inside its first batch until
    `release()`: its log_dir is in use meanwhile."""

    def __init__(self, *callbacks):
        self._held, self._go = threading.Event(), threading.Event()
        self.error = None

        def hold(batch, logs):
            if batch == 0:
                self._held.set()
                self._go.wait(timeout=TIMEOUT)

        def run():
            try:
                _fit(*callbacks,
                     keras.callbacks.LambdaCallback(on_train_batch_end=hold))
            except Exception as error:  # shown by release()
                self.error = error
                self._held.set()

        self._thread = threading.Thread(target=run, name="held-fit")
        self._thread.start()
        assert self._held.wait(timeout=TIMEOUT), "the fit never began"
        assert self.error is None, self.error

    def release(self):
        self._go.set()
        self._thread.join(timeout=TIMEOUT)
        assert not self._thread.is_alive()
        assert self.error is None, self.error


def test_two_loggers_in_one_callbacks_list_are_refused(tmp_path):
    """Both began in one `on_train_begin`, on one thread: the second is
    refused before a batch, naming the first's place in the list; with
    that fit gone (it raised), a logger may write the log_dir."""
    log_dir = str(tmp_path / "logs")
    with pytest.raises(LogDirInUse) as refused:
        _fit(_logger(log_dir), _logger(log_dir))
    assert "another DistributedLogger in this fit's callbacks " \
           "(callbacks[0])" in str(refused.value)
    assert "another log_dir" in str(refused.value)
    assert _records(log_dir) == []
    _fit(_logger(log_dir))
    assert _records(log_dir) == ONE_FIT


class _FitsInside(keras.callbacks.Callback):
    """Starts another fit from its first batch end, as a tuner or an
    evaluation callback might; keeps what that fit raised."""

    def __init__(self, logger):
        super().__init__()
        self.logger, self.error = logger, None

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            try:
                _fit(self.logger)
            except LogDirInUse as error:
                self.error = error


def test_a_fit_started_inside_a_fit_on_its_log_dir_is_refused(tmp_path):
    log_dir = str(tmp_path / "logs")
    inner = _FitsInside(_logger(log_dir))
    _fit(_logger(log_dir), inner)
    message = str(inner.error)
    assert "another DistributedLogger's fit in this process" in message
    assert "on this thread" in message and "started inside it" in message
    assert "another log_dir" in message
    # The outer fit's records, whole, and none of the inner's.
    assert _records(log_dir) == ONE_FIT


def test_a_fit_inside_a_hand_written_loop_on_its_log_dir_is_refused(
        tmp_path):
    """A loop driving its callbacks (`CallbackList`) holds the log_dir from
    `on_train_begin` to `on_train_end`: a fit started inside it there is
    refused, told how a loop ends; after `on_train_end` it may write."""
    log_dir = str(tmp_path / "logs")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)],
                             name="hand_loop_model")
    model.compile("sgd", "mse")
    callbacks = keras.callbacks.CallbackList([_logger(log_dir)], model=model)
    callbacks.on_train_begin()
    try:
        callbacks.on_epoch_begin(0)
        callbacks.on_train_batch_begin(0)
        logs = model.train_on_batch(np.ones((8, 2)), np.ones((8, 1)),
                                    return_dict=True)
        callbacks.on_train_batch_end(0, logs)
        with pytest.raises(LogDirInUse) as refused:
            _fit(_logger(log_dir))
        callbacks.on_epoch_end(0, logs)
    finally:
        callbacks.on_train_end()
    message = str(refused.value)
    assert "hand-written loop of model 'hand_loop_model' on this thread" \
           in message
    assert "on_train_end" in message and "another log_dir" in message
    _fit(_logger(log_dir))
    assert _records(log_dir) == [("window", 1), ("epoch", 1)] + ONE_FIT


def test_one_logger_in_two_fits_at_once_is_refused(tmp_path):
    log_dir = str(tmp_path / "logs")
    logger = _logger(log_dir)
    held = _Held(logger)
    try:
        with pytest.raises(LogDirInUse) as refused:
            _fit(logger)
    finally:
        held.release()
    message = str(refused.value)
    assert "this logger is already writing" in message
    assert "on thread 'held-fit'" in message
    # One after the other, the same logger continues its file.
    _fit(logger)
    assert _records(log_dir) == ONE_FIT + [
        ("window", s) for s in (1, 2)] + [("epoch", 2)]


@pytest.mark.parametrize("spell", [
    lambda base: ("ram://claims-test/logs", "ram://claims-test/logs/"),
    lambda base: (base, "file://" + base),
], ids=["url-trailing-slash", "file-url"])
def test_a_log_dir_spelled_another_way_is_the_same_log_dir(tmp_path, spell):
    held_spelling, other = spell(str(tmp_path / "logs"))
    held = _Held(_logger(held_spelling))
    try:
        with pytest.raises(LogDirInUse, match="another DistributedLogger's "
                                              "fit in this process"):
            _fit(_logger(other))
    finally:
        held.release()


class _Crash(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        raise RuntimeError("crash")


def test_a_fit_that_raised_frees_its_log_dir_on_a_live_thread(tmp_path):
    """Keras never calls `on_train_end` for a fit that raised: the log_dir
    is free as the fit unwinds, while its logger and thread live on."""
    log_dir = str(tmp_path / "logs")
    crashed, go = threading.Event(), threading.Event()
    kept = [_logger(log_dir)]

    def crash_then_wait():
        try:
            _fit(kept[0], _Crash())
        except RuntimeError:
            crashed.set()
        go.wait(timeout=TIMEOUT)

    thread = threading.Thread(target=crash_then_wait)
    thread.start()
    try:
        assert crashed.wait(timeout=TIMEOUT)
        _fit(_logger(log_dir))
    finally:
        go.set()
        thread.join(timeout=TIMEOUT)
    assert _records(log_dir) == ONE_FIT


# --- Across processes ---------------------------------------------------------

# Fits two batches logging to argv[1]; inside the first, prints HOLDING and
# waits for a line on stdin.
HOLDER = """
import sys
import keras
import numpy as np
from keras_mgpu.callbacks import DistributedLogger

def hold(batch, logs):
    if batch == 0:
        print("HOLDING", flush=True)
        sys.stdin.readline()

model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
model.fit(np.ones((16, 2)), np.ones((16, 1)), batch_size=8, verbose=0,
          callbacks=[DistributedLogger(sys.argv[1], update_freq=1,
                                       console=False),
                     keras.callbacks.LambdaCallback(on_train_batch_end=hold)])
"""


def test_another_process_is_refused_in_any_spelling_and_named(tmp_path):
    """A process on this machine fits into `logs`: a logger here is
    refused however it spells that directory (relative, through a link,
    with a trailing slash, as a `file://` URL), and the message names that
    process. The holder's records are its own, whole."""
    log_dir = str(tmp_path / "logs")
    os.makedirs(log_dir)
    os.symlink(log_dir, tmp_path / "link")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="-1",
               PYTHONPATH=os.pathsep.join(
                   [REPO, os.environ.get("PYTHONPATH", "")]))
    with open(tmp_path / "holder.err", "w+") as stderr:
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, log_dir], env=env, cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
            text=True)
        try:
            line = first_line(holder.stdout, TIMEOUT)
            assert line == "HOLDING\n", (line, holder.poll(), _tail(stderr))
            for spelling in (os.path.relpath(log_dir), str(tmp_path / "link"),
                             log_dir + "/", "file://" + log_dir):
                with pytest.raises(LogDirInUse) as refused:
                    _fit(_logger(spelling))
                message = str(refused.value)
                assert f"written by another process: process {holder.pid} " \
                       in message, (spelling, message)
                assert "another log_dir" in message
            holder.communicate(input="go\n", timeout=TIMEOUT)
            assert holder.returncode == 0, _tail(stderr)
        finally:
            if holder.poll() is None:
                holder.kill()
            holder.wait(timeout=TIMEOUT)
    assert _records(log_dir) == ONE_FIT


def _tail(stderr) -> str:
    stderr.flush()
    stderr.seek(0)
    return stderr.read()[-3000:]
