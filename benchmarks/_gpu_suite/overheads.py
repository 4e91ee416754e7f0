"""The `overheads` part: what keras-mgpu's components cost, as epoch ratios.

`GradientAccumulationModel(accum_steps=4)` (window mode), the same with
`mode="in_step"`, Keras's `gradient_accumulation_steps=4` and plain `fit`;
`DistributedLogger` at `update_freq=1` and `100` against no callback;
`BackupAndRestore` saving every 100 steps against none. The configurations
take turns, round by round; each ratio is paired within a round, the median
over rounds, with the quartiles.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

from . import ACCUM_STEPS
from .child import Recorder, finite, physical_gpus, time_left

# Sizes per mode, as for ResNet-50: the GPU's fit the budget (estimated),
# the dry run's are the smallest that still run every code path.
OVERHEAD_SIZES = {
    # Keras's per-step overhead dominates a ~1 ms step: where a callback's
    # cost shows most. `steps` is a multiple of ACCUM_STEPS, so in-step
    # mode's big batches hold every micro-batch.
    "gpu": dict(features=784, width=2048, classes=10, batch_size=256,
                steps=200, epochs=3, rounds=7),
    # 100 steps per epoch, so that BackupAndRestore(save_freq=100) saves in
    # the timed epoch.
    "dry-run": dict(features=16, width=32, classes=10, batch_size=16,
                    steps=100, epochs=2, rounds=2),
}


def _quartiles(values: list) -> tuple:
    """(q1, median, q3); one value is all three."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def run(rec: Recorder, dry_run: bool, budget_s: float) -> None:
    """Accumulation, logger and backup costs, as paired epoch-time ratios."""
    import keras
    import numpy as np
    import tensorflow as tf

    from _timed_backup import TimedBackup
    from _timing import EpochTimer
    from keras_mgpu import GradientAccumulationModel
    from keras_mgpu.callbacks import DistributedLogger

    gpus = physical_gpus(tf, dry_run)
    size = OVERHEAD_SIZES["dry-run" if dry_run else "gpu"]
    features, width, classes = size["features"], size["width"], \
        size["classes"]
    batch, steps, epochs = size["batch_size"], size["steps"], size["epochs"]

    def mlp():
        return keras.Sequential([
            keras.Input((features,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(classes)])

    plain, builtin, ours = ("plain fit",
                            f"keras gradient_accumulation_steps={ACCUM_STEPS}",
                            f"GradientAccumulationModel(accum_steps="
                            f"{ACCUM_STEPS})")
    in_step = (f"GradientAccumulationModel(accum_steps={ACCUM_STEPS}, "
               "mode='in_step')")
    logger_1, logger_100 = ("DistributedLogger(update_freq=1)",
                            "DistributedLogger(update_freq=100)")
    backup = "BackupAndRestore(save_freq=100)"
    names = [plain, builtin, ours, in_step, logger_1, logger_100, backup]
    root = tempfile.mkdtemp(prefix="overheads_", dir=rec.workdir)

    def make_model(name):
        model = mlp()
        optimizer = keras.optimizers.Adam(1e-3, **(
            {"gradient_accumulation_steps": ACCUM_STEPS}
            if name == builtin else {}))
        if name == ours:
            model = GradientAccumulationModel(model, accum_steps=ACCUM_STEPS)
        elif name == in_step:
            model = GradientAccumulationModel(model, accum_steps=ACCUM_STEPS,
                                              mode="in_step")
        # jit_compile explicit: "auto" means XLA on a GPU, and an XLA
        # compile of each configuration would cost more than it measures.
        model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), jit_compile=False)
        return model

    def make_callbacks(name, round_index):
        path = os.path.join(root, f"{names.index(name)}-{round_index}")
        if name == logger_1:
            return [DistributedLogger(path, update_freq=1, console=False)]
        if name == logger_100:
            return [DistributedLogger(path, update_freq=100, console=False)]
        if name == backup:
            return [TimedBackup(path, save_freq=100)]
        return []

    rng = np.random.default_rng(0)
    x = rng.standard_normal((steps * batch, features), dtype=np.float32)
    y = rng.integers(0, classes, steps * batch).astype(np.int32)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        batch, drop_remainder=True).cache().prefetch(2)
    # In-step mode takes the same samples as big batches of ACCUM_STEPS
    # micro-batches: a quarter of the steps, the same micro-batches.
    big_data = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        ACCUM_STEPS * batch, drop_remainder=True).cache().prefetch(2)
    keras.utils.set_random_seed(0)
    models = {name: make_model(name) for name in names}
    # epochs_of[name][r]: the median timed epoch of round r.
    epochs_of = {name: [] for name in names}
    stalls = []
    rec.results = {
        "model": f"MLP {features}-{width}-{width}-{classes}",
        "params": int(models[plain].count_params()), "batch_size": batch,
        "steps_per_epoch": steps, "epochs_per_fit": epochs,
        "timed_epochs_per_fit": epochs - 1, "rounds": 0,
        "jit_compile": False, "device": "/gpu:0" if gpus else "/cpu:0",
        "configs": [], "ratios": [], "backup": {"saves": 0,
                                                "stall_ms": None}}
    rec.save()

    def paired(of, against):
        values = [a / b for a, b in zip(epochs_of[of], epochs_of[against])]
        q1, median, q3 = _quartiles(values)
        return {"name": f"{of} / {against}", "of": of, "against": against,
                "median": finite(median), "q1": finite(q1),
                "q3": finite(q3)}

    longest = 0.0
    try:
        for round_index in range(size["rounds"]):
            left = time_left(budget_s)
            if round_index and left < 1.3 * longest:
                rec.note = (f"{round_index} of {size['rounds']} rounds: "
                            f"{left:.0f} s of the budget left, a round "
                            f"takes {longest:.0f} s")
                break
            began = time.monotonic()
            for k in range(len(names)):
                # One place later each round: no configuration always runs
                # right after the same other one.
                name = names[(k + round_index) % len(names)]
                timer = EpochTimer()
                callbacks = make_callbacks(name, round_index)
                models[name].fit(big_data if name == in_step else data,
                                 epochs=epochs, verbose=0,
                                 shuffle=False,
                                 callbacks=[timer.start, *callbacks,
                                            timer.stop])
                # The first epoch holds tracing, cache filling and the
                # callbacks' setup: not timed.
                epochs_of[name].append(statistics.median(timer.times[1:]))
                for callback in callbacks:
                    stalls += getattr(callback, "save_seconds", [])
            longest = max(longest, time.monotonic() - began)
            rec.results["rounds"] = round_index + 1
            rec.results["configs"] = [
                {"name": name,
                 "epoch_s": finite(statistics.median(epochs_of[name])),
                 "step_ms": finite(1000 * statistics.median(epochs_of[name])
                                    / steps),
                 "examples_per_s": finite(
                     steps * batch / statistics.median(epochs_of[name]))}
                for name in names]
            rec.results["ratios"] = [
                paired(ours, plain), paired(builtin, plain),
                paired(ours, builtin), paired(in_step, plain),
                paired(in_step, builtin), paired(in_step, ours),
                paired(logger_1, plain), paired(logger_100, plain),
                paired(backup, plain)]
            rec.results["backup"] = {
                "saves": len(stalls),
                "stall_ms": (finite(1000 * statistics.median(stalls))
                             if stalls else None)}
            rec.save()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for ratio in rec.results["ratios"]:
        print(f"{ratio['name']}: {ratio['median']:.3f}", flush=True)

