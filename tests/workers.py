"""Training programs shared by in-process tests and worker processes.

A worker-process entry point creates its strategy first, before any other
TensorFlow call, as MultiWorkerMirroredStrategy requires.
"""

import numpy as np

NUM_SAMPLES = 128
FEATURES = 8


def regression_data(num_samples=NUM_SAMPLES, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(num_samples, FEATURES).astype("float32")
    w = rng.randn(FEATURES, 1).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.randn(num_samples, 1)).astype("float32")
    return x, y


def max_diff(a, b) -> float:
    """The largest absolute difference between two lists of arrays."""
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
               for x, y in zip(a, b))


def initial_weights(model, seed=1):
    """Deterministic weights, independent of strategy and creation order."""
    rng = np.random.RandomState(seed)
    # The variables' shapes, not their values: a variable split over
    # several processes has no value any one of them can read.
    return [0.3 * rng.randn(*w.shape).astype("float32")
            for w in model.weights]


def build_mlp():
    import keras

    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(1),
    ])
    model.set_weights(initial_weights(model))
    return model


def optimizers():
    """The accumulation tests' optimizers by name, each a factory."""
    import keras

    return {
        "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(0.01),
        "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
        "adam_clipnorm": lambda: keras.optimizers.Adam(0.01, clipnorm=0.05),
        "adam_clipvalue": lambda: keras.optimizers.Adam(0.01, clipvalue=0.01),
        "adam_global_clipnorm": lambda: keras.optimizers.Adam(
            0.01, global_clipnorm=0.1),
        "sgd_schedule": lambda: keras.optimizers.SGD(
            keras.optimizers.schedules.PiecewiseConstantDecay(
                [2, 4], [0.2, 0.05, 0.01])),
    }


# The optimizers of `optimizers()` that clip, one per kind of clipping.
CLIPPING = ("adam_clipnorm", "adam_clipvalue", "adam_global_clipnorm")


def clipped_fit(strategy, optimizer):
    """Plain `fit` of `build_mlp` with `optimizer` (a name of `optimizers()`
    or a factory): 3 epochs of 4 batches of 32 (16 per replica on 2);
    returns the trained weights."""
    import tensorflow as tf

    x, y = regression_data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    if isinstance(optimizer, str):
        optimizer = optimizers()[optimizer]
    with strategy.scope():
        model = build_mlp()
        model.compile(optimizer(), "mse")
    model.fit(dataset, epochs=3, verbose=0, shuffle=False)
    return [w.numpy() for w in model.trainable_variables]


def multi_worker_clipped_fits():
    """Worker entry point: `clipped_fit` for each of `CLIPPING` under
    auto_strategy()."""
    import keras_mgpu

    strategy = keras_mgpu.auto_strategy()
    return {name: [w.tolist() for w in clipped_fit(strategy, name)]
            for name in CLIPPING}


def fit_small_model(strategy, global_batch=32, epochs=3, optimizer="adam",
                    steps_per_execution=1, unknown_length=False):
    """Trains `build_mlp` on `regression_data`; returns weights and history."""
    import keras
    import tensorflow as tf

    x, y = regression_data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    if unknown_length:
        dataset = dataset.filter(lambda x, y: True)
    with strategy.scope():
        model = build_mlp()
        opt = {"adam": lambda: keras.optimizers.Adam(0.01),
               "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9)}
        model.compile(opt[optimizer](), "mse", metrics=["mae"],
                      steps_per_execution=steps_per_execution)
    history = model.fit(dataset, epochs=epochs, verbose=0, shuffle=False)
    evaluation = model.evaluate(dataset, verbose=0, return_dict=True)
    predictions = model.predict(dataset, verbose=0)
    return {
        "weights": [w.tolist() for w in model.get_weights()],
        "loss": history.history["loss"],
        "evaluation": {k: float(v) for k, v in evaluation.items()},
        "predictions": predictions.tolist(),
        "iterations": int(model.optimizer.iterations.numpy()),
    }


def multi_worker_fit(**kwargs):
    """Worker entry point: `fit_small_model` under auto_strategy()."""
    import keras_mgpu

    strategy = keras_mgpu.auto_strategy()
    result = fit_small_model(strategy, **kwargs)
    import tensorflow as tf

    result["multi_worker"] = isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy)
    result["replicas"] = strategy.num_replicas_in_sync
    result["is_chief"] = keras_mgpu.is_chief()
    result["worker_index"] = keras_mgpu.worker_index()
    return result


def stock_multi_worker_fit():
    """Worker entry point: plain Keras under MultiWorkerMirroredStrategy."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    return fit_small_model(strategy, epochs=1)


def echo(value):
    """Worker entry point: reports its cluster position and `value`."""
    import keras_mgpu.strategy as s

    info = s.cluster_info()
    return {"value": value, "worker_index": info.worker_index,
            "is_chief": info.is_chief, "num_workers": info.num_workers}


def fail(message):
    """Worker entry point: fails on worker 1 only."""
    import sys

    from keras_mgpu.strategy import worker_index

    if worker_index() == 1:
        print(message, file=sys.stderr)
        raise SystemExit(3)
    return "ok"


# Longer than any test's cluster timeout: a held worker is always killed.
HOLD_SECONDS = 600


def finish_backup_writes(seconds=HOLD_SECONDS):
    """Waits for BackupAndRestore's background writes: a fit that raised
    leaves the one in flight running."""
    import threading

    for thread in threading.enumerate():
        if thread.name == "keras-mgpu-backup-write":
            thread.join(timeout=seconds)
            assert not thread.is_alive(), "a backup write did not finish"


def hold_until_killed(seconds=HOLD_SECONDS):
    """Blocks until the test kills this process (after a marker it printed);
    the launcher's timeout ends it if the test never does."""
    import threading

    threading.Event().wait(seconds)


def print_then_sleep(marker, seconds):
    """Worker entry point: prints `marker`, then holds for `seconds`."""
    print(marker, flush=True)
    hold_until_killed(seconds)
    return "finished"


def print_on_one_then_sleep(marker, printer, seconds):
    """Worker entry point: worker `printer` prints `marker`; all hold for
    `seconds`, as a tuning chief waits for its workers."""
    from keras_mgpu.strategy import worker_index

    if worker_index() == printer:
        print(marker, flush=True)
    hold_until_killed(seconds)
    return "finished"


def accumulation_run(strategy):
    """GradientAccumulationModel(accum_steps=4) on 6 micro-batches x 3 epochs."""
    import keras
    import tensorflow as tf

    from keras_mgpu import GradientAccumulationModel

    x, y = regression_data(96)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    with strategy.scope():
        model = GradientAccumulationModel(build_mlp(), accum_steps=4)
        model.compile(keras.optimizers.Adam(0.01, global_clipnorm=0.2), "mse")
    model.fit(dataset, epochs=3, verbose=0, shuffle=False)
    return {
        "weights": [w.numpy().tolist() for w in model.trainable_variables],
        "iterations": int(model.optimizer.iterations.numpy()),
    }


def multi_worker_accumulation():
    """Worker entry point: `accumulation_run` under auto_strategy()."""
    import keras_mgpu

    return accumulation_run(keras_mgpu.auto_strategy())


def in_step_configs():
    """`in_step_runs`'s configurations by name: (optimizer name, compile
    arguments); each optimizer, and steps_per_execution / jit_compile on
    Adam with global clipping."""
    configs = {name: (name, {}) for name in optimizers()}
    for steps, jit in ((4, False), (1, True), (4, True)):
        configs[f"spe{steps}-jit{jit}"] = (
            "adam_global_clipnorm",
            {"steps_per_execution": steps, "jit_compile": jit})
    return configs


def in_step_runs(strategy, names, reference=False):
    """`mode="in_step"` fits over 5 big batches of 32 and one of 20, for
    the configurations `names` of `in_step_configs()`; `reference=True`:
    plain `fit` on the same batches."""
    import keras
    import tensorflow as tf

    from keras_mgpu import GradientAccumulationModel

    x, y = regression_data(180)
    configs = in_step_configs()
    runs = {}
    for name in names:
        optimizer, compile_kwargs = configs[name]
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
        with strategy.scope():
            model = build_mlp()
            if not reference:
                model = GradientAccumulationModel(model, accum_steps=4,
                                                  mode="in_step")
            model.compile(optimizers()[optimizer](), "mse",
                          **({} if reference else compile_kwargs))
        model.fit(dataset, epochs=2, verbose=0, shuffle=False)
        runs[name] = {
            "weights": [w.numpy().tolist()
                        for w in model.trainable_variables],
            "iterations": int(model.optimizer.iterations.numpy()),
        }
    return runs


def multi_worker_in_step(names):
    """Worker entry point: `in_step_runs` under auto_strategy()."""
    import keras_mgpu

    return in_step_runs(keras_mgpu.auto_strategy(), names)


def multi_worker_fp32_head():
    """Worker entry point: a model with FP32OutputHead under auto_strategy()."""
    import keras_mgpu

    strategy = keras_mgpu.auto_strategy()
    import keras

    from keras_mgpu.layers import FP32OutputHead

    x, y = regression_data(64)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, activation="relu"),
            FP32OutputHead(1, name="head"),
        ])
        model.compile("adam", "mse")
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    return {k: [float(v) for v in vals] for k, vals in history.history.items()}


def multi_worker_fit_as_keras(version):
    """Worker entry point: plain and accumulated `fit` under auto_strategy(),
    with Keras reporting `version` (as a newer release would)."""
    import warnings

    import keras

    keras.__version__ = version
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import keras_mgpu

        strategy = keras_mgpu.auto_strategy()
        plain = fit_small_model(strategy)
        accumulated = accumulation_run(strategy)
        # 6 batches per epoch, the last short, of unknown number: the
        # data ends inside the second call of each epoch.
        multi_step = fit_small_model(strategy, global_batch=24,
                                     steps_per_execution=4,
                                     unknown_length=True)
    from keras_mgpu import compat

    return {
        "plain": plain,
        "accumulated": accumulated,
        "multi_step": multi_step,
        "untested_warnings": [
            str(w.message) for w in caught
            if issubclass(w.category, compat.UntestedKerasWarning)
        ],
    }
