"""Benchmark: gradient accumulation, side by side with plain `fit`.

Compares, on the same synthetic data and the same number of micro-batches:

- plain `fit` (one optimizer step per micro-batch);
- Keras's built-in `Adam(gradient_accumulation_steps=N)` (1 replica only: it
  fails under `MirroredStrategy`; N >= 2 only, N = 1 being plain `fit`);
- `keras_mgpu.GradientAccumulationModel(model, accum_steps=N)`;

for an MLP and a small ConvNet, N = 1, 4, 8, on 1 and 2 replicas. Without
GPUs the replicas are logical CPU devices sharing the same cores, so the
figures show the mechanics (work added per micro-batch, all-reduces saved),
not GPU performance.

Run from the repository root (the default run takes a few minutes on 2 cores):

    .venv/bin/python benchmarks/accumulation.py
    .venv/bin/python benchmarks/accumulation.py --models mlp --accum 1,4 \\
        --replicas 1 --epochs 2 --steps 32 --json /tmp/accumulation.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from typing import Optional, Sequence

import numpy as np

# Runnable as a plain script from a checkout: the package lives one level up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# TensorFlow's C++ info lines would bury the progress lines and the table.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_mgpu  # noqa: E402  (sets KERAS_BACKEND before keras loads)
from keras_mgpu import strategy as strategy_lib  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from _timing import EpochTimer  # noqa: E402

MODELS = ("mlp", "convnet")
PLAIN = "plain fit"
BUILTIN = "keras built-in"
WRAPPER = "GradientAccumulationModel"
NUM_CLASSES = 10
LEARNING_RATE = 1e-3
SEED = 0


@dataclasses.dataclass
class Result:
    """One configuration's timing; the derived figures use the median epoch."""

    model: str
    replicas: int
    config: str
    accum_steps: int
    global_micro_batch: int
    steps: int
    epoch_seconds: list[float]
    ms_per_micro_batch: float = 0.0
    samples_per_second: float = 0.0
    spread: float = 0.0
    vs_plain: Optional[float] = None

    def __post_init__(self) -> None:
        median = statistics.median(self.epoch_seconds)
        self.ms_per_micro_batch = 1000.0 * median / self.steps
        self.samples_per_second = self.steps * self.global_micro_batch / median
        # How far apart the timed epochs are, to tell noise from a difference.
        self.spread = (max(self.epoch_seconds) - min(self.epoch_seconds)) / median


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    def int_list(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(
                f"expected positive integers such as 1,4,8, got {text!r}"
            )
        return sorted(set(values))

    def model_list(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        unknown = sorted(set(names) - set(MODELS))
        if not names or unknown:
            raise argparse.ArgumentTypeError(
                f"unknown model(s) {unknown}; choose from {','.join(MODELS)}"
            )
        return list(dict.fromkeys(names))

    parser = argparse.ArgumentParser(
        description="Gradient accumulation benchmark: plain fit, Keras's "
        "gradient_accumulation_steps and GradientAccumulationModel.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--models", type=model_list, default=",".join(MODELS),
                        help="comma-separated: mlp,convnet")
    parser.add_argument("--accum", type=int_list, default="1,4,8",
                        help="accumulation steps N, comma-separated")
    parser.add_argument("--replicas", type=int_list, default="1,2",
                        help="replica counts, comma-separated (logical CPUs "
                             "without GPUs)")
    parser.add_argument("--epochs", type=int, default=3,
                        help="timed epochs per configuration, after one "
                             "untimed warm-up epoch")
    parser.add_argument("--steps", type=int, default=64,
                        help="micro-batches per epoch")
    parser.add_argument("--batch", type=int, default=32,
                        help="per-replica micro-batch size")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.steps < 1 or args.batch < 1:
        parser.error("--epochs, --steps and --batch must be positive")
    if len([n for n in args.replicas if n > 1]) > 1:
        # Two MirroredStrategy objects over different device sets collide in
        # TensorFlow's collective executor, so one process gets one.
        parser.error("--replicas takes 1 and at most one other count")
    return args


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
    """Exactly `steps` micro-batches of fixed random data."""
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


def compile_config(
    model_name: str,
    strategy: tf.distribute.Strategy,
    config: str,
    accum_steps: int,
) -> keras.Model:
    """Builds and compiles one configuration, from the same initial weights."""
    keras.utils.set_random_seed(SEED)
    with strategy.scope():
        inner = build_model(model_name)
        if config == BUILTIN:
            optimizer = keras.optimizers.Adam(
                LEARNING_RATE, gradient_accumulation_steps=accum_steps
            )
        else:
            optimizer = keras.optimizers.Adam(LEARNING_RATE)
        model = (
            keras_mgpu.GradientAccumulationModel(inner, accum_steps=accum_steps)
            if config == WRAPPER
            else inner
        )
        # XLA off everywhere: Keras's "auto" already turns it off on CPU and
        # under tf.distribute; pinning it keeps GPU runs comparable too.
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False,
        )
    return model


def train_epoch(model: keras.Model, dataset: tf.data.Dataset) -> float:
    """Seconds of one epoch, without `fit`'s per-call setup."""
    # Keras fetches the logs before `on_epoch_end`, which waits for the last
    # step to finish, so the time covers all the work of the epoch.
    timer = EpochTimer()
    model.fit(dataset, epochs=1, callbacks=[timer.start, timer.stop],
              verbose=0, shuffle=False)
    return timer.times[0]


def run_group(
    model_name: str,
    strategy: tf.distribute.Strategy,
    configs: Sequence[tuple[str, int]],
    dataset: tf.data.Dataset,
    epochs: int,
) -> list[list[float]]:
    """Times every (config, N) of one model and replica count, interleaved.

    Each configuration is compiled and trained for one untimed warm-up epoch,
    which traces its train step (Keras keeps the traced step across `fit`
    calls). The timed epochs then go round-robin, one epoch per configuration
    per round, starting one place later each round: on a shared, noisy
    machine a burst of background load then hits all configurations alike
    rather than whichever happened to be running.

    Returns:
        Per configuration, the list of its timed epochs' seconds.
    """
    keras.backend.clear_session()
    gc.collect()
    models = []
    for config, n in configs:
        model = compile_config(model_name, strategy, config, n)
        train_epoch(model, dataset)
        models.append(model)
    seconds: list[list[float]] = [[] for _ in configs]
    for round_index in range(epochs):
        for k in range(len(configs)):
            i = (k + round_index) % len(configs)
            seconds[i].append(train_epoch(models[i], dataset))
    return seconds


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
            groups.append((model_name, replicas, configs))
    return groups


def find(results: list[Result], model: str, replicas: int, config: str,
         accum_steps: int = 1) -> Optional[Result]:
    for r in results:
        if (r.model, r.replicas, r.config, r.accum_steps) == (
            model, replicas, config, accum_steps
        ):
            return r
    return None


def compute_ratios(results: list[Result], args: argparse.Namespace) -> dict:
    """The two target ratios, per model (and per N for the first)."""
    wrapper_vs_builtin = []
    for model in args.models:
        for n in (4, 8):
            ours = find(results, model, 1, WRAPPER, n)
            theirs = find(results, model, 1, BUILTIN, n)
            if ours and theirs:
                wrapper_vs_builtin.append({
                    "model": model, "replicas": 1, "accum_steps": n,
                    "ratio": ours.ms_per_micro_batch / theirs.ms_per_micro_batch,
                    "target": "<= 1.00",
                    "met": ours.ms_per_micro_batch <= theirs.ms_per_micro_batch,
                })
    wrapper_vs_plain = []
    multi = max(args.replicas)
    for model in args.models if multi > 1 else ():
        ours = find(results, model, multi, WRAPPER, 4)
        plain = find(results, model, multi, PLAIN)
        if ours and plain:
            ratio = ours.samples_per_second / plain.samples_per_second
            wrapper_vs_plain.append({
                "model": model, "replicas": multi, "accum_steps": 4,
                "ratio": ratio, "target": "> 1", "met": ratio > 1.0,
            })
    return {
        "wrapper_vs_builtin_time_per_micro_batch": wrapper_vs_builtin,
        "wrapper_vs_plain_samples_per_second": wrapper_vs_plain,
    }


def format_table(results: list[Result]) -> str:
    """A Markdown table, readable in a terminal too."""
    header = ("model", "replicas", "configuration", "N", "micro-batch",
              "ms/micro-batch", "samples/s", "vs plain", "spread")
    rows = [header]
    for r in results:
        rows.append((
            r.model, str(r.replicas), r.config,
            "-" if r.config == PLAIN else str(r.accum_steps),
            str(r.global_micro_batch), f"{r.ms_per_micro_batch:.2f}",
            f"{r.samples_per_second:,.0f}",
            "-" if r.vs_plain is None else f"{r.vs_plain:.2f}x",
            f"{100 * r.spread:.0f}%",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    text_columns = {0, 2}
    lines = []
    for i, row in enumerate(rows):
        cells = [c.ljust(w) if j in text_columns else c.rjust(w)
                 for j, (c, w) in enumerate(zip(row, widths))]
        lines.append("| " + " | ".join(cells) + " |")
        if i == 0:
            lines.append("|" + "|".join(
                "-" * (w + 1) + ("-" if j in text_columns else ":")
                for j, w in enumerate(widths)) + "|")
    return "\n".join(lines)


def format_ratios(ratios: dict) -> str:
    def verdict(met: bool) -> str:
        return "met" if met else "NOT met"

    lines = ["(a) GradientAccumulationModel / Keras built-in, time per "
             "micro-batch, 1 replica (target <= 1.00):"]
    for r in ratios["wrapper_vs_builtin_time_per_micro_batch"]:
        lines.append(f"    {r['model']:8s} N={r['accum_steps']}: "
                     f"{r['ratio']:.2f}  {verdict(r['met'])}")
    if not ratios["wrapper_vs_builtin_time_per_micro_batch"]:
        lines.append("    not measured: needs --replicas 1 and --accum 4 or 8")
    lines.append("(b) GradientAccumulationModel N=4 / plain fit, samples/s, "
                 "multi-replica (target > 1):")
    for r in ratios["wrapper_vs_plain_samples_per_second"]:
        lines.append(f"    {r['model']:8s} {r['replicas']} replicas: "
                     f"{r['ratio']:.2f}  {verdict(r['met'])}")
    if not ratios["wrapper_vs_plain_samples_per_second"]:
        lines.append("    not measured: needs --replicas 2 and --accum 4")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    strategies = make_strategies(args.replicas)
    on_gpu = bool(tf.config.list_physical_devices("GPU"))

    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, "
          f"keras-mgpu {keras_mgpu.__version__}, Python "
          f"{platform.python_version()}, {os.cpu_count()} CPU cores, "
          f"{'GPUs' if on_gpu else 'no GPU'}")
    if not on_gpu:
        print("NOTE: replicas are logical CPU devices sharing the same cores. "
              "These figures show the mechanics (work added per micro-batch, "
              "all-reduces saved), not GPU performance.")
    print(f"{args.steps} micro-batches of {args.batch} per replica per epoch; "
          f"1 warm-up epoch, then the median of {args.epochs} timed epochs, "
          "interleaved across the configurations of each model and replica "
          "count.\n")

    results: list[Result] = []
    groups = plan(args)
    start = time.perf_counter()
    for i, (model_name, replicas, configs) in enumerate(groups, 1):
        global_batch = args.batch * replicas
        print(f"[{i}/{len(groups)}] {model_name}, {replicas} replica(s), "
              f"{len(configs)} configurations", flush=True)
        dataset = make_dataset(model_name, global_batch, args.steps)
        timings = run_group(model_name, strategies[replicas], configs,
                            dataset, args.epochs)
        group = [Result(model_name, replicas, config, n, global_batch,
                        args.steps, seconds)
                 for (config, n), seconds in zip(configs, timings)]
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
    elapsed = time.perf_counter() - start

    ratios = compute_ratios(results, args)
    print()
    print(format_table(results))
    print("\nvs plain: time per micro-batch relative to plain fit with the "
          "same model and replicas.\nspread: (slowest - fastest) / median of "
          "the timed epochs.\n")
    print(format_ratios(ratios))
    print(f"\nTotal {elapsed:.0f} s.")

    if args.json:
        payload = {
            "benchmark": "accumulation",
            "date": datetime.date.today().isoformat(),
            "versions": {
                "tensorflow": tf.__version__,
                "keras": keras.__version__,
                "keras_mgpu": keras_mgpu.__version__,
                "python": platform.python_version(),
            },
            "cpu_count": os.cpu_count(),
            "gpu": on_gpu,
            "settings": {
                "models": args.models, "accum": args.accum,
                "replicas": args.replicas, "epochs": args.epochs,
                "steps": args.steps, "batch_per_replica": args.batch,
            },
            "results": [dataclasses.asdict(r) for r in results],
            "ratios": ratios,
            "total_seconds": elapsed,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"Wrote {args.json}")


if __name__ == "__main__":
    main()
