"""Tuning programs for `tests/test_tuner.py`: in-process helpers and worker entry points.

A worker-process entry point creates its strategy first, before any other
TensorFlow call.
"""

import json
import os
import socket

import numpy as np

FEATURES = 8


def data(num_samples=64, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(num_samples, FEATURES).astype("float32")
    y = (x @ rng.randn(FEATURES, 1)).astype("float32")
    return x, y


def build_model(hp):
    """A tiny regression MLP whose base learning rate is the `learning_rate` hp."""
    import keras

    units = hp.Choice("units", [4, 8])
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(units, activation="tanh"),
        keras.layers.Dense(1),
    ])
    lr = hp.Float("learning_rate", 1e-3, 1e-2, sampling="log")
    model.compile(keras.optimizers.SGD(lr), "mse")
    return model


def build_seeded_model(hp):
    """`build_model` with the same initial weights in every process."""
    import keras

    keras.utils.set_random_seed(1)
    return build_model(hp)


def resumable_tuner(directory, strategy, kill_trial=None, kill_epoch=None,
                    max_trials=3):
    """The tuner of `resumable_search`: objective `loss` maximized, so each
    trial's best epoch is its first, before any kill."""
    import keras_tuner

    log_path = os.path.join(directory, "epochs.jsonl")
    hypermodel = make_recording_hypermodel(
        log_path, kill_trial, kill_epoch, build_fn=build_seeded_model,
        per_replica_batch_size=8)
    return keras_tuner.RandomSearch(
        hypermodel, objective=keras_tuner.Objective("loss", "max"),
        max_trials=max_trials, seed=3, directory=directory,
        project_name="resume", overwrite=False,
        distribution_strategy=strategy)


def search_resumable(tuner):
    x, y = data()
    # In order: the killed trial resumes exactly only on the same batches.
    tuner.search(x, y, epochs=4, shuffle=False, verbose=0)
    return {
        "trials": {t.trial_id: t.status for t in tuner.oracle.trials.values()},
        "best": {t.trial_id: {"score": t.score, "best_step": t.best_step,
                              "hp": t.hyperparameters.values}
                 for t in tuner.oracle.trials.values()},
    }


def meet_peers(address, timeout=120):
    """Blocks until the test's rendezvous (a Unix socket at `address`) says
    every tuning worker has arrived."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(address)
        if s.recv(1) != b"1":
            raise RuntimeError("the rendezvous closed before every tuning "
                               "worker arrived")


def make_recording_hypermodel(log_path, kill_trial=None, kill_epoch=None,
                              rendezvous=None, build_fn=build_model,
                              **kwargs):
    """A StrategyAwareHyperModel that logs each trained epoch to `log_path`.

    With `rendezvous`, the first trial of this process waits there until
    every tuning worker holds a trial of its own.
    """
    import keras

    from tests import workers

    pending = [rendezvous] if rendezvous else []

    class Recorder(keras.callbacks.Callback):
        def __init__(self, trial_id):
            super().__init__()
            self.trial_id = trial_id

        def on_epoch_begin(self, epoch, logs=None):
            if self.trial_id == kill_trial and epoch == kill_epoch:
                # The backup of the epochs before this one is committed
                # (BackupAndRestore runs first; its write is waited for):
                # die in here.
                workers.finish_backup_writes()
                print("KILL-ME", flush=True)
                workers.hold_until_killed()

        def on_epoch_end(self, epoch, logs=None):
            record = {
                "trial": self.trial_id, "epoch": epoch, "pid": os.getpid(),
                "iterations": int(self.model.optimizer.iterations.numpy()),
            }
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def recorder(trial_id):
        if pending:
            meet_peers(pending.pop())
        return Recorder(trial_id)

    return with_trial_callback(build_fn, recorder, **kwargs)


def with_trial_callback(build_fn, make_callback, **kwargs):
    """A StrategyAwareHyperModel whose every fit also gets
    `make_callback(trial_id)` (called as the fit starts)."""
    from keras_mgpu import compat
    from keras_mgpu import tuner as mgpu_tuner

    class WithTrialCallback(mgpu_tuner.StrategyAwareHyperModel):
        def fit(self, hp, model, *args, callbacks=None, **kw):
            _, trial = compat.tuner_and_trial(callbacks)
            callbacks = list(callbacks) + [make_callback(trial.trial_id)]
            return super().fit(hp, model, *args, callbacks=callbacks, **kw)

    return WithTrialCallback(build_fn, **kwargs)


def read_log(log_path):
    if not os.path.exists(log_path):
        return []
    with open(log_path) as f:
        return [json.loads(line) for line in f if line.strip()]


def resumable_search(directory, kill_trial=None, kill_epoch=None):
    """Worker entry point: 3 trials x 4 epochs, rerunnable with overwrite=False."""
    import keras_mgpu

    strategy = keras_mgpu.auto_strategy(virtual_cpus=2)
    return search_resumable(
        resumable_tuner(directory, strategy, kill_trial, kill_epoch))


def parallel_search(directory, max_trials=4, rendezvous=None,
                    kill_trial=None, kill_epoch=None):
    """Worker entry point for `keras_mgpu.tuner.launch`: chief or worker.

    Reports the trials this process trained; the chief also the oracle's
    end order and the ongoing trials its saved state lists.
    """
    import keras_mgpu

    strategy = keras_mgpu.auto_strategy(virtual_cpus=2)
    import keras_tuner

    tuner_id = os.environ["KERASTUNER_TUNER_ID"]
    log_path = os.path.join(directory, f"epochs_{tuner_id}.jsonl")
    # Each worker holds its first trial until the other holds one too, so
    # both run some: the test shows trials really ran in parallel processes.
    hypermodel = make_recording_hypermodel(
        log_path, kill_trial, kill_epoch, per_replica_batch_size=4,
        rendezvous=None if tuner_id == "chief" else rendezvous)
    tuner = keras_tuner.RandomSearch(
        hypermodel, objective="loss", max_trials=max_trials, seed=5,
        directory=directory, project_name="parallel",
        distribution_strategy=strategy)
    x, y = data(32)
    tuner.search(x, y, epochs=1, verbose=0)
    result = {"tuner_id": tuner_id,
              "trained": sorted({r["trial"] for r in read_log(log_path)
                                 if r["pid"] == os.getpid()})}
    if tuner_id == "chief":
        result["end_order"] = tuner.oracle.end_order
        with open(os.path.join(directory, "parallel", "oracle.json")) as f:
            result["saved_ongoing"] = json.load(f)["ongoing_trials"]
        result["trials"] = {
            t.trial_id: {
                "status": t.status,
                "replicas": float(
                    t.metrics.get_last_value("effective/replicas")),
            }
            for t in tuner.oracle.trials.values()
        }
    return result


def die_first(directory, victim="tuner1", timeout=120):
    """Worker entry point for a launch failure: every process says it is up;
    `victim` then waits for `<directory>/go` (written by the test when it
    sees the chief's line, so only with live output) and kills itself with
    SIGKILL, while the others hold until the launcher stops them."""
    import signal
    import time

    from tests import workers

    tuner_id = os.environ["KERASTUNER_TUNER_ID"]
    print(f"{tuner_id} up", flush=True)
    if tuner_id == victim:
        go = os.path.join(directory, "go")
        deadline = time.monotonic() + timeout
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{go} never appeared: no live output")
            time.sleep(0.05)
        print("dying", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    workers.hold_until_killed()
