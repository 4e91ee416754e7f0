"""keras-mgpu demo: every component together, on real handwritten digits.

    make demo                                    # or: .venv/bin/python examples/demo.py
    .venv/bin/python examples/demo.py --workers 2     # on 2 local worker processes

Runs on a laptop CPU (split into 2 logical devices) or on all local GPUs. The
data is scikit-learn's bundled 8x8 digits: nothing is downloaded. It:
1. picks a strategy (`auto_strategy`) and a precision policy (`set_policy`);
2. writes the digits to sharded TFRecords and reads them back in parallel;
3. tunes the hidden width and learning rate briefly (`StrategyAwareHyperModel`,
   batch and learning rate scaled to the replicas);
4. trains a model with a float32 output head (`FP32OutputHead`) inside
   `GradientAccumulationModel`, logging to TensorBoard and JSONL
   (`DistributedLogger`) and backing up with the "preemptible" preset;
5. reports held-out accuracy, throughput and where the logs are.

Press Ctrl-C during training and run it again (without --fresh): it resumes
where it stopped. Each training run logs to its own `<workdir>/logs/runN`
(a resumed one continues its run's): TensorBoard on `<workdir>/logs` shows
them side by side. `--workers 2` uses its own workdir (`runs/demo-2workers`).
"""

import argparse
import json
import os
import shutil
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# First: _common quiets TensorFlow's start-up logs, in each worker too.
from _common import REPO, command, shown, tensorboard_command  # noqa: E402
from _interrupt import current, stops_cleanly  # noqa: E402


def run(workdir: str, log_dir: str, epochs: int, trials: int) -> dict:
    """The demo's training program (one worker's, under --workers)."""
    import keras_mgpu

    import tensorflow as tf

    multi_worker = keras_mgpu.num_workers() > 1
    no_gpu = not tf.config.list_physical_devices("GPU")
    # The strategy comes first: it may have to configure devices.
    strategy = keras_mgpu.auto_strategy(
        virtual_cpus=2 if no_gpu and not multi_worker else None
    )

    import keras

    from _common import digits
    from keras_mgpu import data, mixed_precision
    from keras_mgpu.callbacks import BackupAndRestore, DistributedLogger
    from keras_mgpu.layers import FP32OutputHead

    policy = mixed_precision.set_policy("auto")
    chief = keras_mgpu.is_chief()
    (x, y), (x_test, y_test) = digits()
    # Each worker writes its own copy: workers need not share a filesystem.
    records = f"{workdir}/tfrecords/worker{keras_mgpu.worker_index()}"
    if not tf.io.gfile.exists(f"{records}/train/{data.SPEC_FILE}"):
        data.write_tfrecords((x, y), f"{records}/train", num_shards=4)
        data.write_tfrecords((x_test, y_test), f"{records}/test", num_shards=1)
    per_replica = 32
    train = data.tfrecord_dataset(f"{records}/train/*.tfrecord",
                                  per_replica_batch_size=per_replica,
                                  strategy=strategy, cache=True)
    test = data.tfrecord_dataset(f"{records}/test/*.tfrecord",
                                 per_replica_batch_size=per_replica,
                                 strategy=strategy)

    def make_model(units: int) -> keras.Model:
        return keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(units, activation="relu"),
            FP32OutputHead(10, activation="softmax", name="head"),
        ])

    def build(hp) -> keras.Model:
        model = make_model(hp.Choice("units", [64, 128]))
        model.compile(
            keras.optimizers.Adam(hp.Float("learning_rate", 1e-3, 3e-3,
                                           sampling="log")),
            "sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    units, learning_rate = 128, 2e-3
    tuned = bool(trials) and not multi_worker
    if tuned:
        import keras_tuner

        from keras_mgpu.tuner import StrategyAwareHyperModel

        tuner = keras_tuner.RandomSearch(
            StrategyAwareHyperModel(build, per_replica_batch_size=per_replica,
                                    lr_scaling="sqrt"),
            objective="val_accuracy", max_trials=trials, seed=0,
            directory=workdir, project_name="tuning", overwrite=False,
            distribution_strategy=strategy)
        done = sum(t.status == "COMPLETED"
                   for t in tuner.oracle.trials.values())
        if done >= trials:
            say(f"Tuning done before: {done} trial(s) reloaded from "
                f"{workdir}/tuning.")
        else:
            say(f"Tuning the hidden width and learning rate: {trials} short "
                "trial(s)" + (f" ({done} done before)" if done else "")
                + ", batch and learning rate scaled to "
                f"{strategy.num_replicas_in_sync} replica(s)...")
        # Arrays: the hypermodel gives fit the trial's global batch.
        tuner.search(x, y, validation_data=(x_test, y_test), epochs=2,
                     verbose=0)
        best = tuner.get_best_hyperparameters()[0]
        units, learning_rate = best.get("units"), best.get("learning_rate")
        keras.backend.clear_session()

    with strategy.scope():
        model = keras_mgpu.GradientAccumulationModel(make_model(units),
                                                     accum_steps=2)
        # Two micro-batches per step: the base rate times sqrt(2 * replicas).
        scale = (2 * strategy.num_replicas_in_sync) ** 0.5
        model.compile(keras.optimizers.Adam(learning_rate * scale),
                      "sparse_categorical_crossentropy", metrics=["accuracy"])

    backup_dir = f"{workdir}/backup"
    callbacks = [
        # One line per epoch: loss, throughput, step time, input wait.
        DistributedLogger(log_dir, update_freq=10),
        # Where training is, for the line Ctrl-C ends with.
        current().callback(),
        # Says "resumed from local generation N ..." on a rerun (a copy
        # every batch in /dev/shm, every 10 in backup_dir).
        BackupAndRestore.from_preset("preemptible", backup_dir, save_freq=10),
    ]
    say(f"Training {epochs} epochs ({units} hidden units, 2 micro-batches "
        "per step, validated on the held-out digits); press Ctrl-C and run "
        "the demo again to resume...")
    start = time.perf_counter()
    # The TFRecord dataset's length is unknown until its first epoch ends,
    # where Keras warns that the input "ran out of data": expected here.
    warnings.filterwarnings("ignore", "Your input ran out of data")
    # shuffle=False: Keras 3.15 warns that its default shuffle=True does
    # not apply to a dataset (this one keeps its order, for exact resume).
    # Validation data: TensorBoard overlays `train` and `validation` curves.
    model.fit(train, epochs=epochs, verbose=0, shuffle=False,
              validation_data=test, callbacks=callbacks)
    seconds = time.perf_counter() - start
    accuracy = model.evaluate(test, verbose=0, return_dict=True)["accuracy"]
    findings = mixed_precision.audit(model.inner)
    return {
        "chief": chief,
        "strategy": ("MultiWorkerMirroredStrategy" if multi_worker
                     else type(strategy).__name__),
        "replicas": strategy.num_replicas_in_sync,
        "devices": ("CPUs" if multi_worker else "logical CPUs") if no_gpu
        else "GPUs",
        "policy": policy,
        "tuned": tuned,
        "units": int(units),
        "learning_rate": float(learning_rate),
        "accuracy": float(accuracy),
        "test_examples": int(len(x_test)),
        "train_seconds": seconds,
        "last_epoch": _last_epoch_record(log_dir) if chief else None,
        "optimizer_steps": int(model.optimizer.iterations.numpy()),
        "audit_findings": len(findings),
        "log_dir": log_dir,
    }


def say(text: str) -> None:
    """A progress line, from the chief only."""
    import keras_mgpu

    if keras_mgpu.is_chief():
        print(text, flush=True)


def _last_epoch_record(log_dir: str):
    with open(f"{log_dir}/metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    epochs = [r for r in records if r["kind"] == "epoch"]
    return epochs[-1] if epochs else None


def report(result: dict, workdir: str, workers: int) -> None:
    from keras_mgpu.callbacks import input_wait_summary

    print()
    print("keras-mgpu demo")
    print(f"  strategy:        {result['strategy']}, {result['replicas']} "
          f"replica(s) on {result['devices']}"
          + (f", {workers} worker processes" if workers > 1 else ""))
    print(f"  precision:       {result['policy']}; mixed-precision audit: "
          f"{result['audit_findings']} finding(s)")
    if result["tuned"]:
        print(f"  tuned model:     {result['units']} hidden units, base "
              f"learning rate {result['learning_rate']:.2e}")
    else:
        print(f"  model:           {result['units']} hidden units, base "
              f"learning rate {result['learning_rate']:.2e} (not tuned: "
              + ("the demo tunes in one process only)" if workers > 1
                 else "--trials 0)"))
    print(f"  optimizer steps: {result['optimizer_steps']} "
          "(2 micro-batches each)")
    print(f"  test accuracy:   {result['accuracy']:.3f} on "
          f"{result['test_examples']} held-out digits (chance: 0.100)")
    last = result["last_epoch"]
    if last and last["examples_per_sec"]:
        # The console counts epochs from 1; the JSONL's `epoch` is 0-based.
        print(f"  throughput:      {last['examples_per_sec']:,.0f} "
              f"examples/s (epoch {last['epoch'] + 1}, the last)")
    if last and last["input_wait"] is not None:
        print(f"  input wait:      {input_wait_summary(last['input_wait'])}")
    print(f"  logs:            {shown(result['log_dir'])}")
    # Every run of this workdir, side by side.
    print("  view them:       "
          + tensorboard_command(os.path.dirname(result["log_dir"])))
    if workers == 1:
        print("  on 2 workers:    " + command(
            shown(os.path.join(HERE, "demo.py")), "--workers 2",
            "--workdir", shown(_workdir_for(workdir, 2))))
    if result["devices"] != "GPUs":
        print("  note: CPU run: figures show the mechanics, not GPU speed.")


def _workdir_for(workdir: str, workers: int) -> str:
    """The workdir of a run on `workers` processes: its own, so that its
    logs and backup never mix with a single process's."""
    return workdir if workers == 1 else f"{workdir}-{workers}workers"


def _log_dir(workdir: str) -> str:
    """`<workdir>/logs/runN`: the interrupted run's while its backup is
    there to resume (a finished run deletes it), else a new run's."""
    logs = os.path.join(workdir, "logs")
    runs = sorted(int(name[3:]) for name in (
        os.listdir(logs) if os.path.isdir(logs) else ())
        if name.startswith("run") and name[3:].isdigit())
    resuming = runs and os.path.isdir(os.path.join(workdir, "backup"))
    number = runs[-1] if resuming else (runs[-1] + 1 if runs else 1)
    return os.path.join(logs, f"run{number}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None,
                        help="default: runs/demo (runs/demo-Nworkers with "
                             "--workers N)")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--smoke", action="store_true",
                        help="a short run, as the test suite does")
    parser.add_argument("--fresh", action="store_true",
                        help="delete the workdir first (no resume)")
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.trials = 2, 1
    if args.workdir is None:
        args.workdir = _workdir_for(os.path.join(REPO, "runs", "demo"),
                                    args.workers)
    if args.fresh:
        shutil.rmtree(args.workdir, ignore_errors=True)
    log_dir = _log_dir(args.workdir)
    kwargs = {"workdir": args.workdir, "log_dir": log_dir,
              "epochs": args.epochs, "trials": args.trials}
    print(("Continuing" if os.path.isdir(log_dir) else "Starting")
          + f" run {os.path.basename(log_dir)[3:]} of {shown(args.workdir)}"
          f" (logs: {shown(log_dir)}).", flush=True)
    # Ctrl-C: one line saying what the workdir keeps (the tuning trials
    # and the training backup) and how to resume; exit code 130.
    again = ("run the command again without --fresh (--fresh deletes "
             "it and starts over)" if args.fresh
             else "run the same command again")
    with stops_cleanly(args.workdir, again=again, announce=False):
        if args.workers > 1:
            from keras_mgpu.launcher import run_local_workers

            print(f"Training {args.epochs} epochs on {args.workers} worker "
                  "processes (MultiWorkerMirroredStrategy; no tuning: the "
                  "demo tunes in one process). Starting them takes a while; "
                  "each line they print comes after its worker's name.",
                  flush=True)
            results = run_local_workers(
                "demo:run", args.workers, kwargs=kwargs, timeout=1800,
                cwd=HERE, echo=sys.stdout,
                labels=[f"worker {i}" for i in range(args.workers)])
            result = next(r for r in results if r.result["chief"]).result
        else:
            result = run(**kwargs)
    report(result, args.workdir, args.workers)
    if not args.smoke:
        assert result["accuracy"] > 0.9, (
            f"accuracy {result['accuracy']:.3f} is too low: a bug?")


if __name__ == "__main__":
    main()
