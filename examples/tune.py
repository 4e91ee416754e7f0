"""Tunes a small digit classifier with KerasTuner on every local replica.

Alone (`python examples/tune.py`) it runs the trials one after another under
`keras_mgpu.auto_strategy()` (without GPUs: 2 logical CPUs). With
`python examples/tune.py --parallel` it starts itself as a chief and one
worker per device group (`--devices-per-trial`, default 1; on a host without
GPUs: 2 CPU workers) through `keras_mgpu.tuner.launch`. The trials go to
runs/tune in the checkout (`--directory`). Rerun the same command after a
crash: finished trials are kept and the interrupted one resumes from its
backup.
"""

import argparse
import os
import sys

# _common first: it quiets TensorFlow's start-up logs, here and (through
# TF_CPP_MIN_LOG_LEVEL) in the workers --parallel starts.
from _common import shown, workdir
from _interrupt import stops_cleanly


def build_model(hp):
    import keras

    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(hp.Choice("units", [32, 64]), activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(
        keras.optimizers.Adam(
            hp.Float("learning_rate", 1e-4, 3e-3, sampling="log")),
        "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def main(directory=None, trials=4, epochs=3):
    directory = workdir(directory, "tune", fresh=False)
    import keras_mgpu

    # Listing physical devices does not initialise them: logical CPUs can
    # still be configured afterwards.
    strategy = keras_mgpu.auto_strategy(
        virtual_cpus=None if _has_gpu() else 2)
    import keras_tuner
    from sklearn.datasets import load_digits

    from keras_mgpu import tuner as mgpu_tuner

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    # Arrays, not a tf.data pipeline: each trial's fit gets its global batch
    # size as batch_size, and shuffles them.
    train, val = (x[:1400], y[:1400]), (x[1400:], y[1400:])
    hypermodel = mgpu_tuner.StrategyAwareHyperModel(
        build_model, per_replica_batch_size=[16, 32], lr_scaling="linear",
        accum_steps=[1, 2])
    tuner = keras_tuner.RandomSearch(
        # KerasTuner reads seed=0 as "no seed" (seed or a random one).
        hypermodel, objective="val_loss", max_trials=trials, seed=1,
        directory=directory, project_name="digits",
        distribution_strategy=strategy)
    # Ctrl-C: one line saying the trials resume (exit code 130).
    with stops_cleanly(os.path.join(directory, "digits")) as progress:
        tuner.search(*train, validation_data=val, epochs=epochs, verbose=0,
                     callbacks=[progress.callback()])
    if os.environ.get("KERASTUNER_TUNER_ID", "chief") == "chief":
        best = tuner.oracle.get_best_trials(1)[0]
        print(f"best of {trials} trials: {best.hyperparameters.values}")
        print("  val_loss:", round(best.score, 4), {
            k: float(best.metrics.get_last_value(k))
            for k in mgpu_tuner.EFFECTIVE_KEYS})
        print(f"trials and their backups: {shown(directory)}/digits "
              "(rerun the same command to resume)")


def _has_gpu():
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--parallel", action="store_true")
    parser.add_argument("--devices-per-trial", type=int, default=1)
    parser.add_argument("--directory", "--workdir", default=None,
                        help="where the trials go (default: runs/tune in "
                             "the checkout; kept, so a rerun resumes)")
    parser.add_argument("--smoke", action="store_true",
                        help="2 trials of 1 epoch, as the test suite runs it")
    options = parser.parse_args()
    size = {"trials": 2, "epochs": 1} if options.smoke else {}
    directory = workdir(options.directory, "tune", fresh=False)
    if options.parallel and "KERASTUNER_TUNER_ID" not in os.environ:
        from keras_mgpu import tuner as mgpu_tuner

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        gpus = mgpu_tuner.local_gpus()
        # A worker's own output (TensorFlow's logs among it) is shown only
        # if it fails, in the error; the chief prints the result.
        with stops_cleanly(os.path.join(directory, "digits")):
            results = mgpu_tuner.launch(
                os.path.abspath(__file__), devices=gpus,
                devices_per_trial=options.devices_per_trial,
                num_workers=None if gpus else 2,
                args=["--parallel", "--directory", directory]
                + (["--smoke"] if options.smoke else []))
        print(results[0].stdout, end="")
    else:
        main(directory, **size)
