"""Training programs for BackupAndRestore's crash-and-resume tests.

Each is a worker entry point (run by `keras_mgpu.launcher`): it creates its
strategy first, prints `STEP <n>;` after every batch so a test can kill it at
a chosen step, and returns the final weights. `serve_forks` runs them in
forks of one process instead, for tests that kill many runs.
"""


import json
import os
import selectors
import signal
import subprocess
import sys
import time

import numpy as np


def marker(text: str) -> None:
    """Prints a marker line with one write: a SIGKILL cannot leave half of
    it (`print` writes the text and its newline separately when Python's
    output is unbuffered, PYTHONUNBUFFERED=1)."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"{text}\n".encode())


def train(backup_dir, preset="preemptible", save_freq=4, accum_steps=None,
          epochs=3, steps=8, hold_write_of=None, report_held_at=None,
          pause_at=None, virtual_cpus=None, mode="window", die_at=None,
          log_dir=None, **overrides):
    """`log_dir`: also a `DistributedLogger` there (a record per step).
    No local tier unless `overrides` give one (the presets' "auto" would
    save every step in RAM)."""
    import keras_mgpu

    strategy = keras_mgpu.auto_strategy(virtual_cpus=virtual_cpus)

    import threading

    import keras
    import tensorflow as tf

    from keras_mgpu.callbacks import BackupAndRestore
    from keras_mgpu import _fs
    from tests import workers

    write = _fs.write_file
    held = threading.Event()

    def holding_write(path, data):
        # Holds the background write of generation `hold_write_of` after
        # its weights and variables files until the test kills the
        # process: the kill lands inside that generation.
        write(path, data)
        name = path.rsplit('/', 1)[-1]
        if (f"/.tmp-{hold_write_of}-" in path
                and name == "variables.npz"):
            print(f"HOLDING {name};", flush=True)
            held.set()
            workers.hold_until_killed()

    if hold_write_of is not None:
        _fs.write_file = holding_write

    keras.utils.set_random_seed(0)
    global_batch = 16
    x, y = workers.regression_data(global_batch * steps)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    with strategy.scope():
        inner = keras.Sequential([
            keras.Input((workers.FEATURES,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dropout(0.3, seed=1),
            keras.layers.Dense(1),
        ])
        inner.set_weights(workers.initial_weights(inner))
        model = inner
        if accum_steps:
            model = keras_mgpu.GradientAccumulationModel(
                inner, accum_steps=accum_steps, mode=mode)
        model.compile(keras.optimizers.Adam(0.01), "mse")

    epoch_step = [0]

    def on_epoch_begin(epoch, logs):
        epoch_step[0] = epoch * steps

    def on_batch_end(batch, logs):
        if epoch_step[0] == pause_at:
            # Saves before this step are committed when the test acts, on
            # every worker (the test acts when the first one prints).
            workers.finish_backup_writes()
            if keras_mgpu.num_workers() > 1:
                from keras_mgpu import backend
                backend.active().sum_over_workers(
                    strategy, 1.0, keras_mgpu.num_workers())
        if epoch_step[0] == report_held_at:
            # Training got here while the write is held mid-generation.
            held.wait(timeout=workers.HOLD_SECONDS)
        marker(f"STEP {epoch_step[0]};")
        if (epoch_step[0] == die_at and keras_mgpu.worker_index() == 1
                and os.environ.get("KERAS_MGPU_ATTEMPT") == "1"):
            # A crash of one worker, in the first attempt of a launch.
            os.kill(os.getpid(), signal.SIGKILL)
        if epoch_step[0] == pause_at:
            # Hold still at this step until the test's signal arrives: a
            # SIGKILL ends the process here, a SIGTERM (handled by the
            # backup) lets it go on to save and exit.
            backup._preemption.requested.wait(timeout=workers.HOLD_SECONDS)
        epoch_step[0] += 1

    overrides.setdefault("local_dir", None)
    backup = BackupAndRestore.from_preset(preset, backup_dir,
                                          save_freq=save_freq, **overrides)
    logger = [] if log_dir is None else [keras_mgpu.DistributedLogger(
        log_dir, update_freq=1, console=False)]
    model.fit(dataset, epochs=epochs, verbose=0, shuffle=False, callbacks=[
        keras.callbacks.LambdaCallback(on_epoch_begin=on_epoch_begin),
        backup,
        *logger,
        keras.callbacks.LambdaCallback(on_batch_end=on_batch_end),
    ])
    return {
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
        "iterations": int(model.optimizer.iterations.numpy()),
    }


# steps_per_execution=3 over 13 batches per epoch (the last one partial:
# 205 samples in batches of 16): the epoch's last call holds one batch.
PARTIAL_SAMPLES = 13 * 16 - 3
PARTIAL_SPE = 3


def train_partial_executions(backup_dir, data="numpy", kill_at=None,
                             epochs=3):
    """Trains on `PARTIAL_SAMPLES` with `steps_per_execution=PARTIAL_SPE`,
    saving after every call, from numpy arrays or from a `tf.data` dataset
    of unknown length (`data="unknown_length"`). Prints `STEP <n>;` with the
    runtime's global step after each call and, at `kill_at`, holds (its save
    committed) until killed. Runs in a worker process or in the test's."""
    import keras
    import tensorflow as tf

    from keras_mgpu.callbacks import BackupAndRestore
    from keras_mgpu.runtime import training_runtime
    from tests import workers

    x, y = workers.regression_data(PARTIAL_SAMPLES)
    if data == "numpy":
        inputs = {"x": x, "y": y, "batch_size": 16}
    else:
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        # A filter hides the length: Keras learns it at the data's end.
        inputs = {"x": dataset.filter(lambda *_: True)}
    model = workers.build_mlp()
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse",
                  steps_per_execution=PARTIAL_SPE)
    runtime = training_runtime(model)

    def on_batch_end(batch, logs):
        if runtime.global_step == kill_at:
            workers.finish_backup_writes()
        marker(f"STEP {runtime.global_step};")
        if runtime.global_step == kill_at:
            workers.hold_until_killed()

    model.fit(**inputs, epochs=epochs, verbose=0, shuffle=False, callbacks=[
        BackupAndRestore(backup_dir, save_freq=1),
        keras.callbacks.LambdaCallback(on_batch_end=on_batch_end),
    ])
    return {
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
        "iterations": int(model.optimizer.iterations.numpy()),
        "global_step": runtime.counters().global_step,
    }


def serve_forks():
    """Runs each JSON line of stdin, `{"target": name, "kwargs": {...}}`, as
    `name(**kwargs)` (`train_steps` or another function of this module) in
    a process forked from this one, one at a time, and prints `START <pid>;`
    (from the child), what the child prints, then `EXIT <pid> <code>;` (a
    negative code: the signal that ended it). `Forks` is the test's side.

    TensorFlow is imported here once, but not started (no op has run, so
    no runtime thread exists to be lost by a fork): a run starts in
    milliseconds instead of the seconds of a fresh interpreter, so a test
    can afford twenty kills.
    """
    import traceback

    import keras  # noqa: F401
    import tensorflow  # noqa: F401

    from keras_mgpu.callbacks import BackupAndRestore  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        target = globals()[request["target"]]
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                marker(f"START {os.getpid()};")
                target(**request["kwargs"])
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        marker(f"EXIT {pid} {os.waitstatus_to_exitcode(status)};")


def train_steps(backup_dir, result, save_freq=1, keep=1, epochs=2, steps=8,
                width=16, hold=None, local_dir=None, local_save_freq=None,
                settle_at=None):
    """Trains a small MLP (`width` units in two hidden layers) on `steps`
    batches of 8 per epoch, printing `STEP <optimizer step>;` after each
    batch; saves its final weights and step count to `result` (.npz).

    `hold=(stage, generation)` holds the background write at that stage of
    the store's commit of `generation` ("moved": its files are in place,
    no manifest yet; "marker": half its manifest is written under the
    temporary name; "committed": before older generations are pruned) or of
    the pruning of `generation` ("pruning": its manifest is gone, its files
    not yet), printing `HELD <stage> <generation>;`, until the test kills
    the process.

    `local_dir`, `local_save_freq`: a local tier. `settle_at`: at that
    optimizer step, the writes its saves started are committed before its
    marker is printed, and the process then holds until the test kills it
    (a kill that lands steps later would find later saves).
    """
    import keras
    import tensorflow as tf

    from keras_mgpu.callbacks import BackupAndRestore
    from tests import workers

    if hold is not None:
        _hold_the_store_at(*hold)
    keras.utils.set_random_seed(0)
    x, y = workers.regression_data(8 * steps)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    model = keras.Sequential([
        keras.Input((workers.FEATURES,)),
        keras.layers.Dense(width, activation="tanh"),
        keras.layers.Dense(width, activation="tanh"),
        keras.layers.Dense(1),
    ])
    model.set_weights(workers.initial_weights(model))
    model.compile(keras.optimizers.Adam(0.01), "mse")

    class PrintSteps(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            # The generation loaded (its "resumed" line comes once the
            # resume is accepted, which a kill may come before).
            from keras_mgpu.runtime import training_runtime

            for event in training_runtime(self.model).resumed_here:
                marker(f"RESTORED {event.generation};")

        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if step == settle_at:
                workers.finish_backup_writes()
            marker(f"STEP {step};")
            if step == settle_at:
                workers.hold_until_killed()

    model.fit(dataset, epochs=epochs, verbose=0, shuffle=False, callbacks=[
        BackupAndRestore(backup_dir, save_freq=save_freq, keep=keep,
                         local_dir=local_dir,
                         local_save_freq=local_save_freq),
        PrintSteps()])
    np.savez(result, *model.get_weights(),
             iterations=int(model.optimizer.iterations.numpy()))


def _hold_the_store_at(stage, generation):
    """Wraps the store's stage functions (see `train_steps`)."""
    import threading

    from keras_mgpu import _fs
    from keras_mgpu.callbacks.backup import store
    from tests import workers

    def hold():
        # Only the background write: a rerun's restore also removes
        # leftovers, on the training thread.
        if threading.current_thread().name == "keras-mgpu-backup-write":
            print(f"HELD {stage} {generation};", flush=True)
            workers.hold_until_killed()

    name = f"gen-{generation:08d}"
    if stage == "moved":
        mark = store.GenerationStore._mark

        def held_mark(self, final, manifest):
            if final.endswith(name):
                hold()
            mark(self, final, manifest)

        store.GenerationStore._mark = held_mark
    elif stage == "marker":
        write = _fs.write_file

        def held_write(path, data):
            if f"/{name}/.MANIFEST.json.tmp-" in path:
                write(path, bytes(data)[: len(data) // 2])
                hold()
            write(path, data)

        _fs.write_file = held_write
    elif stage == "committed":
        prune = store.GenerationStore.prune

        def held_prune(self):
            if self.generations()[:1] == [generation]:
                hold()
            prune(self)

        store.GenerationStore.prune = held_prune
    elif stage == "pruning":
        remove = _fs.remove_tree

        def held_remove(path):
            if path.endswith(f"/{name}"):
                hold()
            remove(path)

        _fs.remove_tree = held_remove
    else:
        raise ValueError(f"unknown stage {stage!r}")


# Seconds for one run in a fork; they take one or two.
FORK_TIMEOUT = 240


class Forks:
    """A `serve_forks` process (the test's side): `run(**kwargs)` trains in
    a fork of it."""

    def __init__(self, workdir):
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                   CUDA_VISIBLE_DEVICES="-1",
                   PYTHONPATH=os.pathsep.join(
                       [repo, os.environ.get("PYTHONPATH", "")]))
        self._stderr_path = os.path.join(workdir, "serve_forks.stderr")
        self._stderr = open(self._stderr_path, "w")
        self._proc = subprocess.Popen(
            [sys.executable, "-c",
             "from tests import backup_workers; backup_workers.serve_forks()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, env=env, cwd=repo)
        self._buffer = b""
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._proc.stdout, selectors.EVENT_READ)
        self._child = None

    def run(self, kill_when=None, target="train_steps", **kwargs):
        """Runs `target(**kwargs)` (a function of this module); SIGKILLs it
        as soon as `kill_when(line)` returns a number of seconds (not None)
        for a line it printed, that many seconds later. Returns (exit code,
        the lines it printed)."""
        self._proc.stdin.write(json.dumps(
            {"target": target, "kwargs": kwargs}).encode() + b"\n")
        self._proc.stdin.flush()
        lines = []
        deadline = time.monotonic() + FORK_TIMEOUT
        while True:
            line = self._readline(deadline, lines)
            lines.append(line)
            if line.startswith("START "):
                self._child = int(line.split()[1].rstrip(";"))
            elif "EXIT " in line:
                # After a line the killed child had not ended, if any.
                self._child = None
                exit_line = line[line.index("EXIT "):]
                return int(exit_line.split()[2].rstrip(";")), lines
            elif kill_when is not None:
                delay = kill_when(line)
                if delay is not None:
                    # Not a synchronisation: a random point of a step
                    # (and of the write its save started).
                    time.sleep(delay)
                    os.kill(self._child, signal.SIGKILL)
                    kill_when = None

    def _readline(self, deadline, lines):
        # Raw reads: a buffered reader could hold a second line that
        # select() then never reports.
        while b"\n" not in self._buffer:
            if not self._selector.select(
                    max(0.0, deadline - time.monotonic())):
                break
            data = os.read(self._proc.stdout.fileno(), 65536)
            if not data:
                break
            self._buffer += data
        else:
            line, self._buffer = self._buffer.split(b"\n", 1)
            return line.decode(errors="replace")
        self.fail(("no line from the training process in time"
                   if self._proc.poll() is None else "serve_forks exited")
                  + f" after {lines[-20:]}")

    def fail(self, why):
        self.close()
        with open(self._stderr_path) as f:
            stderr = f.read()
        raise AssertionError(f"{why}; its stderr:\n{stderr[-4000:]}")

    def stderr(self):
        with open(self._stderr_path) as f:
            return f.read()

    def close(self):
        if self._child is not None:
            try:
                os.kill(self._child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._proc.kill()
        self._proc.wait(timeout=60)
        self._stderr.close()
