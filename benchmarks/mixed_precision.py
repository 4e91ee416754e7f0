"""Throughput and peak memory: float32 vs mixed precision, with/without FP32OutputHead.

Trains a small ResNet-style ConvNet on synthetic data under each policy
(float32, mixed_float16, mixed_bfloat16), with a plain
`Dense(softmax)` output and with `FP32OutputHead`, and prints one table with
examples/s, peak GPU memory and ratios to the float32 plain run.

    python benchmarks/mixed_precision.py            # small CPU-sized default
    python benchmarks/mixed_precision.py --image 64 --batch 128 --steps 50

On CPU the figures are not a claim: CPUs have no float16/bfloat16 matrix
units that Keras uses, so mixed precision is usually slower there.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_mgpu.layers import FP32OutputHead  # noqa: E402

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")


def resnet(image: int, classes: int, width: int, blocks: int, head: bool):
    inputs = keras.Input((image, image, 3))
    x = keras.layers.Conv2D(width, 3, padding="same")(inputs)
    for _ in range(blocks):
        y = keras.layers.Conv2D(width, 3, padding="same", activation="relu")(x)
        y = keras.layers.BatchNormalization()(y)
        y = keras.layers.Conv2D(width, 3, padding="same")(y)
        x = keras.layers.Activation("relu")(keras.layers.Add()([x, y]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    if head:
        outputs = FP32OutputHead(classes, activation="softmax")(x)
    else:
        outputs = keras.layers.Dense(classes, activation="softmax")(x)
    return keras.Model(inputs, outputs)


def peak_memory_mib() -> float | None:
    if not tf.config.list_physical_devices("GPU"):
        return None
    return tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20


def run(policy: str, head: bool, args) -> dict:
    keras.mixed_precision.set_global_policy(policy)
    try:
        if tf.config.list_physical_devices("GPU"):
            tf.config.experimental.reset_memory_stats("GPU:0")
        model = resnet(args.image, args.classes, args.width, args.blocks, head)
        model.compile("sgd", "sparse_categorical_crossentropy")
        rng = np.random.default_rng(0)
        n = args.batch * args.steps
        x = rng.standard_normal((n, args.image, args.image, 3), "float32")
        y = rng.integers(0, args.classes, n).astype("float32")
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(
            args.batch, drop_remainder=True).cache().prefetch(2)
        # Warm-up epochs over the same data: trace, compile and fill the
        # cache, untimed.
        model.fit(data, epochs=args.warmup, verbose=0)
        start = time.perf_counter()
        history = model.fit(data, epochs=1, verbose=0)
        seconds = time.perf_counter() - start
        return {
            "policy": policy,
            "head": "FP32OutputHead" if head else "Dense(softmax)",
            "examples_per_s": n / seconds,
            "peak_mib": peak_memory_mib(),
            "loss": history.history["loss"][-1],
        }
    finally:
        keras.mixed_precision.set_global_policy("float32")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", type=int, default=32)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed epochs before the timed one")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    args = parser.parse_args(argv)

    gpus = tf.config.list_physical_devices("GPU")
    rows = [run(p, head, args) for p in args.policies for head in (False, True)]
    base = {r["head"]: r for r in rows if r["policy"] == "float32"}
    reference = rows[0]
    print(f"\nDevice: {gpus[0].name if gpus else 'CPU'}; image {args.image}, "
          f"batch {args.batch}, {args.steps} timed steps, width {args.width}, "
          f"{args.blocks} residual blocks")
    header = (f"{'policy':<15} {'output':<15} {'examples/s':>11} "
              f"{'x f32 plain':>11} {'x f32 same':>10} {'peak MiB':>9} "
              f"{'mem x f32':>9} {'loss':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        same = base.get(r["head"], reference)
        peak = "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        mem_ratio = "n/a" if r["peak_mib"] is None or not same["peak_mib"] \
            else f"{r['peak_mib'] / same['peak_mib']:.2f}"
        print(f"{r['policy']:<15} {r['head']:<15} "
              f"{r['examples_per_s']:>11.1f} "
              f"{r['examples_per_s'] / reference['examples_per_s']:>11.2f} "
              f"{r['examples_per_s'] / same['examples_per_s']:>10.2f} "
              f"{peak:>9} {mem_ratio:>9} {r['loss']:>8.4f}")
    if not gpus:
        print("\nCPU run: these figures are not a claim about mixed precision. "
              "CPUs lack the float16/bfloat16 matrix units it is for; run on "
              "a GPU (compute capability >= 7.0) to measure it. Peak memory "
              "is reported for GPUs only.")
    return rows


if __name__ == "__main__":
    main()
