"""Every private name keras-mgpu requires, taken away in turn.

Run as `python -m tests.mutation_workers`: one process imports TensorFlow,
then forks a child per run, so each run starts with Keras unpatched.

- A recording run of each phase below lists the private names and modules
  it looked up through `_require` and `_require_module` (keras_mgpu/compat/_core.py).
- Then, for each name recorded, a run of the first phase that looked it
  up, in which the name is missing (`_lookup` answers as Keras would
  without it), has other parameters (where `_require` checks them), or, for
  a Keras function keras-mgpu runs a copy of, has another body.

Each run prints one JSON line: the phase, the mutation, the exception (type
and message), the train steps the current `fit` had done when it was
raised, and the names looked up. A run that hangs is killed after
`--timeout` seconds and reported as such.
"""

import argparse
import json
import os
import signal
import sys
import tempfile
import traceback

import numpy as np

FEATURES = 8
# Cheapest first: a name is taken away in the first phase that looks it up.
PHASES = ("startup", "hand_loop", "mixed", "fit", "accumulate", "tuner")


# --- stand-ins: a Keras function of the same parameters and another body ----


def _make_function(self, step_function):
    return _ORIGINALS["_make_function"](self, step_function)


def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    return _ORIGINALS["_maybe_symbolic_build"](self, iterator, data_batch)


def save_weights_only(model, filepath, objects_to_skip=None):
    return _ORIGINALS["save_weights_only"](model, filepath, objects_to_skip)


def load_weights_only(model, filepath, skip_mismatch=False,
                      objects_to_skip=None):
    return _ORIGINALS["load_weights_only"](model, filepath, skip_mismatch,
                                           objects_to_skip)


_RESHAPED = {f.__name__: f for f in (_make_function, _maybe_symbolic_build,
                                     save_weights_only, load_weights_only)}
_ORIGINALS = {}


def _takes_something_else(*args, **kwargs):
    raise AssertionError("a name with other parameters was called")


# --- the hooks -----------------------------------------------------------------


class _Steps:
    """Train steps of the `fit` running now (0 between fits)."""

    count = 0


def _counter():
    import keras

    class CountSteps(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            _Steps.count = 0

        def on_train_batch_end(self, batch, logs=None):
            _Steps.count += 1

        def on_train_end(self, logs=None):
            _Steps.count = 0

    return CountSteps()


def _install(mutation, looked_up):
    """Records every lookup into `looked_up`; applies `mutation`
    (`(kind, key)` or None) to the one named by `key`."""
    from keras_mgpu import compat

    lookup, require, import_module = (compat._core._lookup,
                                      compat._core._require,
                                      compat._core._import_module)
    kind, target = mutation or (None, None)

    def recording_require(owner, name, used_for, params=None):
        key = f"{compat._owner_name(owner)}.{name}"
        if key not in looked_up:
            looked_up[key] = {"signature": params is not None,
                              "used_for": used_for,
                              "steps": _Steps.count}
        return require(owner, name, used_for, params)

    def mutated_lookup(owner, name):
        value = lookup(owner, name)
        if f"{compat._owner_name(owner)}.{name}" != target:
            return value
        if kind == "missing":
            return compat._MISSING
        if kind == "signature":
            return _takes_something_else
        _ORIGINALS[name] = getattr(value, "keras_stock", value)
        return _RESHAPED[name]

    def mutated_import(path):
        if path not in looked_up:
            looked_up[path] = {"signature": False, "used_for": None,
                               "steps": _Steps.count}
        if kind == "missing" and path == target:
            raise ImportError(f"No module named {path!r}")
        return import_module(path)

    # `_lookup` and `_import_module` are called only inside compat._core;
    # `_require` is bound in each module of the package that calls it.
    for name, module in list(sys.modules.items()):
        if ((name == "keras_mgpu.compat"
                or name.startswith("keras_mgpu.compat."))
                and vars(module).get("_require") is require):
            module._require = recording_require
    compat._core._lookup = mutated_lookup
    compat._core._import_module = mutated_import


# --- the phases ------------------------------------------------------------------


def _data(n=64, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, FEATURES).astype("float32")
    y = (x @ rng.randn(FEATURES, 1)).astype("float32")
    return x, y


def _mlp(head=None):
    import keras

    layers = [keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh")]
    layers.append(head or keras.layers.Dense(1))
    return keras.Sequential(layers)


def phase_fit(workdir):
    """Mirrored(2) with every fix (the multi-worker one too: it acts only
    on several workers, but its build runs on every fit): the logger and
    the backup on a fit of two steps per execution, then a second fit that
    resumes from it."""
    import keras

    import keras_mgpu
    from keras_mgpu import compat
    from keras_mgpu.callbacks import BackupAndRestore, DistributedLogger

    strategy = keras_mgpu.auto_strategy(virtual_cpus=2)
    compat.enable_multi_worker_fit()
    x, y = _data()
    with strategy.scope():
        model = _mlp()
        model.compile(keras.optimizers.Adam(0.01, clipnorm=1.0), "mse",
                      steps_per_execution=2)
    backup = os.path.join(workdir, "backup")
    for epochs in (1, 2):
        model.fit(x, y, batch_size=16, epochs=epochs, verbose=0,
                  callbacks=[_counter(),
                             DistributedLogger(os.path.join(workdir, "logs")),
                             BackupAndRestore(backup, save_freq=2,
                                              delete_checkpoint=False)])


def phase_accumulate(workdir):
    """Both accumulation modes on Mirrored(2)."""
    import keras

    import keras_mgpu

    strategy = keras_mgpu.auto_strategy(virtual_cpus=2)
    x, y = _data()
    for mode in ("window", "in_step"):
        with strategy.scope():
            model = keras_mgpu.GradientAccumulationModel(
                _mlp(), accum_steps=2, mode=mode)
            model.compile(keras.optimizers.Adam(0.01), "mse")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                  callbacks=[_counter()])


def phase_mixed(workdir):
    """mixed_float16: the float32 head, the audit and the loss-scale
    monitor."""
    import keras

    from keras_mgpu import mixed_precision
    from keras_mgpu.callbacks import LossScaleMonitor
    from keras_mgpu.layers import FP32OutputHead

    class Scale(keras.layers.Layer):
        # A layer of the user's own: the audit reads its variables.
        def build(self, shape):
            self.scale = self.add_weight(shape=(), initializer="ones")

        def call(self, x):
            return x * self.scale

    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = _data()
    y = (y > 0).astype("float32")
    model = keras.Sequential([keras.Input((FEATURES,)), Scale(),
                              FP32OutputHead(1, activation="sigmoid")])
    model.compile(keras.optimizers.Adam(0.01), "binary_crossentropy")
    mixed_precision.audit(model)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0,
              callbacks=[_counter(), LossScaleMonitor()])


def phase_tuner(workdir):
    """A one-trial search of the strategy-aware hypermodel, with its
    per-trial backup, and its rerun."""
    import keras
    import keras_tuner

    from keras_mgpu.tuner import StrategyAwareHyperModel

    def build(hp):
        model = _mlp()
        model.compile(keras.optimizers.SGD(
            keras.optimizers.schedules.ExponentialDecay(
                hp.Float("learning_rate", 1e-3, 1e-2), 10, 0.5)), "mse")
        return model

    def search():
        tuner = keras_tuner.RandomSearch(
            StrategyAwareHyperModel(build, per_replica_batch_size=16),
            objective="loss", max_trials=1, seed=1,
            directory=os.path.join(workdir, "tuner"))
        tuner.search(x, y, epochs=1, verbose=0, callbacks=[_counter()])
        return tuner

    x, y = _data()
    search()
    # The rerun of a finished search reloads its oracle.
    tuner = search()
    # KerasTuner reports a trial's exception in the trial, and goes on.
    for trial in tuner.oracle.trials.values():
        if trial.status == "FAILED":
            raise TrialFailed(trial.message)


class TrialFailed(Exception):
    """A trial of the search failed; its message is KerasTuner's record."""


def phase_hand_loop(workdir):
    """The logger driven by a hand-written `train_on_batch` loop."""
    import keras

    from keras_mgpu.callbacks import DistributedLogger

    x, y = _data()
    model = _mlp()
    model.compile(keras.optimizers.Adam(0.01), "mse")
    logger = DistributedLogger(os.path.join(workdir, "logs"))
    logger.set_model(model)
    logger.on_train_begin()
    logger.on_epoch_begin(0)
    for step in range(4):
        logger.on_train_batch_begin(step)
        logs = model.train_on_batch(x[16 * step:16 * step + 16],
                                    y[16 * step:16 * step + 16],
                                    return_dict=True)
        _Steps.count += 1
        logger.on_train_batch_end(step, logs)
    logger.on_epoch_end(0, logs)
    logger.on_train_end(logs)


def phase_startup(workdir):
    """The multi-worker start-up deadline, configured for a worker of a
    two-worker `TF_CONFIG` (nothing is started: no TensorFlow op runs)."""
    from keras_mgpu import compat

    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
        "task": {"type": "worker", "index": 0}})
    compat.set_cluster_startup_timeout(60)


# --- the runs ----------------------------------------------------------------------


def _run(phase, mutation):
    """The child: runs `phase` under `mutation`; returns its report."""
    import keras  # noqa: F401

    looked_up = {}
    _install(mutation, looked_up)
    report = {"phase": phase, "mutation": mutation, "error": None}
    with tempfile.TemporaryDirectory() as workdir:
        try:
            globals()[f"phase_{phase}"](workdir)
        except BaseException as error:  # noqa: BLE001 - reported, judged by the test
            report["error"] = {
                "type": type(error).__name__,
                "message": str(error),
                "steps": _Steps.count,
                "traceback": traceback.format_exc(limit=-6),
            }
    report["looked_up"] = looked_up
    return report


def _fork(phase, mutation, timeout):
    """Runs `_run` in a fork; its report, or one saying how it ended."""
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        code = 1
        try:
            os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
            with os.fdopen(write, "w") as out:
                out.write(json.dumps(_run(phase, mutation)))
            code = 0
        finally:
            os._exit(code)
    os.close(write)

    def give_up(signum, frame):
        os.kill(pid, signal.SIGKILL)

    signal.signal(signal.SIGALRM, give_up)
    signal.alarm(timeout)
    try:
        with os.fdopen(read) as child:
            text = child.read()
        _, status = os.waitpid(pid, 0)
    finally:
        signal.alarm(0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0 or not text:
        return {"phase": phase, "mutation": mutation, "looked_up": {},
                "error": {"type": "ChildDied", "steps": None,
                          "message": f"exit code {code} (timeout "
                          f"{timeout} s)", "traceback": ""}}
    return json.loads(text)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--timeout", type=int, default=300)
    args = parser.parse_args(argv)

    import keras  # noqa: F401 - imported once, before the forks
    import keras_tuner  # noqa: F401
    import tensorflow  # noqa: F401

    import keras_mgpu  # noqa: F401
    from keras_mgpu import compat

    first_phase = {}
    for phase in args.phases.split(","):
        control = _fork(phase, None, args.timeout)
        print(json.dumps(control), flush=True)
        for key, seen in control["looked_up"].items():
            first_phase.setdefault(key, (phase, seen))
    for key, (phase, seen) in first_phase.items():
        kinds = ["missing"]
        if seen["signature"]:
            kinds.append("signature")
        if key.rsplit(".", 1)[-1] in compat._KNOWN_SHAPES:
            kinds.append("reshaped")
        for kind in kinds:
            print(json.dumps(_fork(phase, (kind, key), args.timeout)),
                  flush=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
