"""The `resnet50` part: ResNet-50's examples/s and peak GPU memory.

Three policies (float32, mixed_float16, mixed_bfloat16), each with
`jit_compile=False` and `True`, as ratios to float32 without XLA. The dry
run builds ResNet-50 (its parameter count) but trains a small ResNet-style
stand-in: ResNet-50's first step alone takes 10 to 90 s per configuration
on 2 CPU cores.
"""

from __future__ import annotations

import statistics
import time

from .child import Recorder, error_text, finite, physical_gpus, time_left
from .report import mib

# ResNet-50's configurations, in the order they run: the baseline first,
# then by interest on a Hopper GPU (bfloat16 is its native half type), the
# XLA ones last, so that when time runs out, float32 with XLA goes first.
RESNET_CONFIGS = (("float32", False), ("mixed_bfloat16", False),
                  ("mixed_float16", False), ("mixed_bfloat16", True),
                  ("mixed_float16", True), ("float32", True))
NO_GPU = ("no GPU: TensorFlow keeps memory statistics for GPUs only "
          "(tf.config.experimental.get_memory_info)")

# Sizes per mode. The GPU sizes are what fits the budget on one H200 with
# room to spare (estimated, not yet measured there); the dry-run sizes are
# the smallest that still run every code path.
RESNET_SIZES = {
    "gpu": dict(image_size=224, classes=1000, batch_size=256,
                warmup_steps=5, steps=10, repeats=3),
    "dry-run": dict(image_size=32, classes=10, batch_size=2,
                    warmup_steps=1, steps=2, repeats=1),
}
# The GPU run's ResNet-50 input; the dry run builds it at this size too.
RESNET_GPU_INPUT = (224, 224, 3)


def run(rec: Recorder, dry_run: bool, budget_s: float) -> None:
    """ResNet-50 throughput and peak memory per policy and jit_compile."""
    import keras
    import numpy as np
    import tensorflow as tf

    gpus = physical_gpus(tf, dry_run)
    size = RESNET_SIZES["dry-run" if dry_run else "gpu"]
    device = "/gpu:0" if gpus else "/cpu:0"
    # One device, with its distributed iterator: the repeated batch is
    # prefetched to the GPU, so the step is what is timed, not the copy.
    strategy = tf.distribute.OneDeviceStrategy(device)
    image, classes = size["image_size"], size["classes"]

    def resnet50():
        return keras.applications.ResNet50(
            weights=None, input_shape=(image, image, 3), classes=classes)

    def stand_in():
        # The dry run's model: ResNet's ingredients (convolution, batch
        # normalization, a residual add, pooling, a softmax head), small
        # enough that six traces, three of them by XLA, fit a CI run.
        layers = keras.layers
        inputs = keras.Input((image, image, 3))
        x = layers.Conv2D(8, 3, strides=2, padding="same")(inputs)
        y = layers.Conv2D(8, 3, padding="same", use_bias=False)(x)
        y = layers.BatchNormalization()(y)
        x = layers.ReLU()(layers.Add()([x, y]))
        x = layers.GlobalAveragePooling2D()(x)
        return keras.Model(inputs, layers.Dense(classes,
                                                activation="softmax")(x),
                           name="resnet_stand_in")

    # ResNet-50 at the GPU run's size: in the dry run, the same constructor
    # call is checked and its size reported, without training it.
    model_params = keras.applications.ResNet50(
        weights=None, input_shape=RESNET_GPU_INPUT).count_params()
    build = stand_in if dry_run else resnet50
    trained_params = build().count_params() if dry_run else model_params
    keras.backend.clear_session()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((size["batch_size"], image, image, 3),
                            dtype=np.float32)
    y = rng.integers(0, classes, size["batch_size"]).astype(np.int32)
    data = tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(2)
    rec.results = {
        "model": "ResNet50", "model_params": int(model_params),
        "trained": ("small ResNet-style stand-in (dry run)" if dry_run
                    else "ResNet50"),
        "trained_params": int(trained_params), **size, "device": device,
        "tensor_float_32": (bool(tf.config.experimental
                                 .tensor_float_32_execution_enabled())
                            if gpus else None),
        "memory_reason": None if gpus else NO_GPU, "configs": []}
    if dry_run:
        rec.note = ("dry run: a small ResNet-style stand-in is trained; "
                    "ResNet-50 is only built")
    rec.save()

    from _timing import EpochTimer

    longest = 0.0
    for policy, jit in RESNET_CONFIGS:
        row = {"policy": policy, "jit_compile": jit, "status": "not run",
               "error": None, "seconds": None, "epoch_seconds": [],
               "step_ms": None, "examples_per_s": None,
               "start_memory_bytes": None, "peak_memory_bytes": None,
               "speedup": None, "memory_ratio": None}
        rec.results["configs"].append(row)
        left = time_left(budget_s)
        if left < 1.2 * longest:
            row["error"] = (f"not started: {left:.0f} s of the part's budget "
                            f"left, the longest configuration took "
                            f"{longest:.0f} s")
            rec.save()
            continue
        began = time.monotonic()
        # What the row says if the part is stopped while this one runs.
        row["error"] = "did not finish: the part was stopped while it ran"
        rec.save()
        # The previous configuration's model and its compiled step go first
        # (clear_session also runs Python's garbage collection), so that
        # this one's peak is its own.
        keras.backend.clear_session()
        if gpus:
            tf.config.experimental.reset_memory_stats("GPU:0")
            row["start_memory_bytes"] = int(
                tf.config.experimental.get_memory_info("GPU:0")["current"])
        try:
            keras.mixed_precision.set_global_policy(policy)
            try:
                with strategy.scope():
                    model = build()
                    # jit_compile explicit: Keras's default ("auto") turns
                    # XLA on when a GPU is visible.
                    model.compile(
                        keras.optimizers.SGD(0.01, momentum=0.9),
                        keras.losses.SparseCategoricalCrossentropy(),
                        jit_compile=jit)
            finally:
                keras.mixed_precision.set_global_policy("float32")
            # Traces (and with XLA compiles) the step, untimed.
            model.fit(data, epochs=1, steps_per_epoch=size["warmup_steps"],
                      verbose=0)
            timer = EpochTimer()
            model.fit(data, epochs=size["repeats"],
                      steps_per_epoch=size["steps"], verbose=0,
                      callbacks=[timer.start, timer.stop])
            median = statistics.median(timer.times)
            row.update(status="ok", error=None,
                       epoch_seconds=[round(t, 6) for t in timer.times],
                       step_ms=finite(1000 * median / size["steps"]),
                       examples_per_s=finite(
                           size["steps"] * size["batch_size"] / median))
            if gpus:
                row["peak_memory_bytes"] = int(
                    tf.config.experimental.get_memory_info("GPU:0")["peak"])
        except Exception as e:  # one configuration's failure (e.g. OOM)
            row.update(status="failed", error=error_text(e))
        row["seconds"] = round(time.monotonic() - began, 3)
        longest = max(longest, row["seconds"])
        base = rec.results["configs"][0]
        for r in rec.results["configs"]:
            if base["examples_per_s"] and r["examples_per_s"]:
                r["speedup"] = r["examples_per_s"] / base["examples_per_s"]
            if base["peak_memory_bytes"] and r["peak_memory_bytes"]:
                r["memory_ratio"] = (r["peak_memory_bytes"]
                                     / base["peak_memory_bytes"])
        rec.save()
        print(f"{policy:<15} jit_compile={str(jit):<5} "
              + (f"{row['examples_per_s']:>10,.1f} examples/s, peak "
                 f"{mib(row['peak_memory_bytes'])} MiB"
                 if row["status"] == "ok" else row["error"]), flush=True)

