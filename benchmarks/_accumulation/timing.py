"""The accumulation benchmark's timed runs: configurations side by side.

The configurations of one model and replica count are built in one
process, warmed up, then take turns epoch by epoch (round-robin, several
rounds); each figure is the median over rounds, per micro-batch, so that
in-step and window mode compare although their `fit` steps differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
from typing import Optional, Sequence

import numpy as np

from keras_mgpu import strategy as strategy_lib

import keras
import tensorflow as tf
from _timing import markdown_table, round_robin, timed_epoch
from _timing import spread as relative_spread

from .configs import (BUILTIN, IN_STEP, IN_STEP_CONFIGS, IN_STEP_XLA,
                      NUM_CLASSES, PLAIN, SEED, WRAPPER, make_config)


@dataclasses.dataclass
class Result:
    """One configuration's timing; the derived figures use the median epoch."""

    model: str
    replicas: int
    config: str
    accum_steps: int
    global_micro_batch: int
    steps: int                      # micro-batches per epoch
    epoch_seconds: list[float]
    fit_steps: int = 0              # fit steps per epoch (steps / N in-step)
    ms_per_micro_batch: float = 0.0
    samples_per_second: float = 0.0
    spread: float = 0.0
    vs_plain: Optional[float] = None

    def __post_init__(self) -> None:
        self.fit_steps = self.fit_steps or self.steps
        median = statistics.median(self.epoch_seconds)
        self.ms_per_micro_batch = 1000.0 * median / self.steps
        self.samples_per_second = self.steps * self.global_micro_batch / median
        self.spread = relative_spread(self.epoch_seconds)


def make_strategies(replicas: Sequence[int]) -> dict[int, tf.distribute.Strategy]:
    """Maps each replica count to its strategy.

    Must run before any other TensorFlow call: the CPU can only be split into
    logical devices before TensorFlow initialises its devices.
    """
    most = max(replicas)
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if most > len(gpus):
            raise SystemExit(f"--replicas asks for {most}, found {len(gpus)} GPUs")
        devices = [f"/gpu:{i}" for i in range(most)]
    else:
        strategy_lib.configure_virtual_cpus(most)
        devices = [f"/cpu:{i}" for i in range(most)]
    strategies = {1: tf.distribute.get_strategy()}
    if most > 1:
        strategies[most] = tf.distribute.MirroredStrategy(devices)
    return strategies


def build_model(name: str) -> keras.Model:
    if name == "mlp":
        return keras.Sequential([
            keras.Input((784,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(NUM_CLASSES),
        ], name="mlp")
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(NUM_CLASSES),
    ], name="convnet")


def make_dataset(name: str, global_batch: int, steps: int) -> tf.data.Dataset:
    """Exactly `steps` batches of fixed random data.

    The samples depend only on their count, so the in-step datasets (big
    batches, `steps / N` of them) hold the micro-batch dataset's samples in
    the same order.
    """
    rng = np.random.default_rng(SEED)
    count = global_batch * steps
    shape = (784,) if name == "mlp" else (28, 28, 1)
    x = rng.standard_normal((count, *shape), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, size=count, dtype=np.int32)
    # Held in memory, so the input pipeline costs every configuration the same
    # small amount. No `.cache()`: MirroredStrategy's first peek at the data
    # reads it partially, and TensorFlow then discards the cache with a warning.
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(global_batch, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )


def micro_batches_per_fit_step(config: str, accum_steps: int) -> int:
    """In-step mode takes N micro-batches per `fit` step, the others one."""
    return accum_steps if config in IN_STEP_CONFIGS else 1


def compile_config(
    model_name: str,
    strategy: tf.distribute.Strategy,
    config: str,
    accum_steps: int,
) -> keras.Model:
    """Builds and compiles one configuration, from the same initial weights."""
    keras.utils.set_random_seed(SEED)
    with strategy.scope():
        return make_config(
            build_model(model_name), config, accum_steps,
            keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def run_group(
    model_name: str,
    strategy: tf.distribute.Strategy,
    configs: Sequence[tuple[str, int]],
    datasets: Sequence[tf.data.Dataset],
    epochs: int,
) -> list[list[float]]:
    """Times every (config, N) of one model and replica count, interleaved.

    `datasets[i]` is configuration i's data: the same samples for all, in
    micro-batches or (in-step) in big batches.

    Each configuration is compiled and trained for one untimed warm-up epoch,
    which traces its train step (Keras keeps the traced step across `fit`
    calls; for in-step+XLA it also holds the XLA compile). The timed epochs
    then go round-robin (`_timing.round_robin`), one epoch per
    configuration per round.

    Returns:
        Per configuration, the list of its timed epochs' seconds.
    """
    keras.backend.clear_session()
    gc.collect()
    models = []
    for (config, n), dataset in zip(configs, datasets):
        model = compile_config(model_name, strategy, config, n)
        timed_epoch(model, dataset)
        models.append(model)
    return round_robin(len(configs), epochs,
                       lambda i: timed_epoch(models[i], datasets[i]))


def plan(args: argparse.Namespace) -> list[tuple[str, int, list[tuple[str, int]]]]:
    """Groups of (model, replicas, [(config, N), ...]), plain fit first.

    Single-replica groups run first, before anything has used the
    MirroredStrategy, so they are measured in the same process state whatever
    --replicas asks for.
    """
    groups = []
    for replicas in args.replicas:
        for model_name in args.models:
            configs = [(PLAIN, 1)]
            for n in args.accum:
                # Built-in accumulation: N >= 2 only (N = 1 is plain fit), and
                # 1 replica only (it fails under MirroredStrategy).
                if replicas == 1 and n >= 2:
                    configs.append((BUILTIN, n))
                configs.append((WRAPPER, n))
                # In-step needs one whole big batch per epoch.
                if args.steps >= n:
                    configs.append((IN_STEP, n))
                    # At N = 1 there is no loop for XLA to compile.
                    if model_name in args.xla and n >= 2:
                        configs.append((IN_STEP_XLA, n))
            groups.append((model_name, replicas, configs))
    return groups


def run(args: argparse.Namespace,
        strategies: dict[int, tf.distribute.Strategy]) -> list[Result]:
    """Times every group `plan` makes, printing each configuration's figure."""
    results: list[Result] = []
    groups = plan(args)
    for i, (model_name, replicas, configs) in enumerate(groups, 1):
        global_batch = args.batch * replicas
        print(f"[{i}/{len(groups)}] {model_name}, {replicas} replica(s), "
              f"{len(configs)} configurations", flush=True)
        # One dataset per batch size: the same samples, in micro-batches or
        # in in-step's big batches.
        by_batching: dict[int, tf.data.Dataset] = {}
        datasets = []
        for config, n in configs:
            k = micro_batches_per_fit_step(config, n)
            if k not in by_batching:
                by_batching[k] = make_dataset(
                    model_name, global_batch * k, args.steps // k)
            datasets.append(by_batching[k])
        timings = run_group(model_name, strategies[replicas], configs,
                            datasets, args.epochs)
        group = []
        for (config, n), seconds in zip(configs, timings):
            k = micro_batches_per_fit_step(config, n)
            group.append(Result(model_name, replicas, config, n, global_batch,
                                (args.steps // k) * k, seconds,
                                fit_steps=args.steps // k))
        plain = group[0]
        for result in group:
            label = result.config
            if result is not plain:
                result.vs_plain = (result.ms_per_micro_batch
                                   / plain.ms_per_micro_batch)
                label += f", N={result.accum_steps}"
            epochs = ", ".join(f"{s:.2f}s" for s in result.epoch_seconds)
            print(f"    {label}: {result.ms_per_micro_batch:.2f} "
                  f"ms/micro-batch (epochs: {epochs})", flush=True)
        results.extend(group)
    return results


def format_table(results: list[Result]) -> str:
    """The results, a row per configuration."""
    header = ("model", "replicas", "configuration", "N", "micro-batch",
              "fit steps", "ms/micro-batch", "samples/s", "vs plain",
              "spread")
    rows = []
    for r in results:
        rows.append((
            r.model, str(r.replicas), r.config,
            "-" if r.config == PLAIN else str(r.accum_steps),
            str(r.global_micro_batch), str(r.fit_steps),
            f"{r.ms_per_micro_batch:.2f}",
            f"{r.samples_per_second:,.0f}",
            "-" if r.vs_plain is None else f"{r.vs_plain:.2f}x",
            f"{100 * r.spread:.0f}%",
        ))
    return markdown_table(header, rows, {0, 2})
