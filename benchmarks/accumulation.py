"""Benchmark: gradient accumulation, side by side with plain `fit`.

Compares, on the same synthetic data and the same number of micro-batches:

- plain `fit` (one optimizer step per micro-batch);
- Keras's built-in `Adam(gradient_accumulation_steps=N)` (1 replica only: it
  fails under `MirroredStrategy`; N >= 2 only, N = 1 being plain `fit`);
- `keras_mgpu.GradientAccumulationModel(model, accum_steps=N)`, the default
  `mode="window"`: the data batched to the micro-batch, one `fit` step per
  micro-batch;
- the same wrapper with `mode="in_step"`: the data batched to the big batch
  (N x the micro-batch, `steps / N` batches), one `fit` step per optimizer
  step, the micro-batches looped over inside the step;
- in-step with `compile(jit_compile=True)` ("+XLA"), which XLA-compiles
  the replica-local micro-batch loop only; for N >= 2, and by default for
  the MLP only (`--xla mlp,convnet` or `--xla none`): on a CPU, XLA's
  convolutions run several times slower than oneDNN's, and the ConvNet's
  XLA epochs would add minutes to the default run;

for an MLP and a small ConvNet, N = 1, 4, 8, on 1 and 2 replicas. Every
configuration is timed per micro-batch (epoch time / micro-batches in the
epoch), so in-step and window mode compare although their `fit` steps
differ. Without GPUs the replicas are logical CPU devices sharing the same
cores, so the figures show the mechanics (work added per micro-batch,
all-reduces and `fit` steps saved), not GPU performance.

Timing is paired: the configurations of one model and replica count are
built in one process, warmed up, then take turns epoch by epoch (round-
robin, several rounds); each figure is the median over rounds, and every
ratio printed compares medians measured side by side in that one run.

`--memory` measures peak memory instead (in-step against window mode and
plain `fit` at the micro-batch and at the big batch, for an MLP
512-4x1024-10 with a micro-batch of 1024 and N = 4 and 8), one fresh
subprocess per configuration, from TensorFlow's allocator statistics.

Run from the repository root (the default run takes a few minutes on 2 cores):

    .venv/bin/python benchmarks/accumulation.py
    .venv/bin/python benchmarks/accumulation.py --models mlp --accum 1,4 \\
        --replicas 1 --epochs 2 --steps 32 --json /tmp/accumulation.json
    .venv/bin/python benchmarks/accumulation.py --memory \\
        --json /tmp/accumulation_memory.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
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
from _timing import EpochTimer, markdown_table  # noqa: E402

MODELS = ("mlp", "convnet")
PLAIN = "plain fit"
BUILTIN = "keras built-in"
# Window mode keeps the label of the runs before in-step mode existed, so
# their JSON and the docs' tables still line up with this one's.
WRAPPER = "GradientAccumulationModel"
IN_STEP = "GradientAccumulationModel in_step"
IN_STEP_XLA = "GradientAccumulationModel in_step+XLA"
IN_STEP_CONFIGS = (IN_STEP, IN_STEP_XLA)
DESCRIPTIONS = {
    PLAIN: "plain fit, one optimizer step per micro-batch",
    BUILTIN: "Adam(gradient_accumulation_steps=N), data batched to the "
             "micro-batch (1 replica only)",
    WRAPPER: "GradientAccumulationModel(accum_steps=N), mode='window': data "
             "batched to the micro-batch, one fit step per micro-batch",
    IN_STEP: "GradientAccumulationModel(accum_steps=N, mode='in_step'): data "
             "batched to N x the micro-batch, one fit step per optimizer "
             "step",
    IN_STEP_XLA: "the same, compiled with jit_compile=True (XLA compiles "
                 "the replica-local micro-batch loop only)",
}
NUM_CLASSES = 10
LEARNING_RATE = 1e-3
SEED = 0
# Issue #20's targets for in-step mode, time per micro-batch.
IN_STEP_VS_BUILTIN_TARGET = 0.85   # 1 replica, against Keras's built-in
IN_STEP_VS_WINDOW_TARGET = 0.90    # several replicas, against window mode
IN_STEP_VS_WINDOW_MEMORY_TARGET = 1.5   # peak memory
RATIO_ACCUM_STEPS = (4, 8)

# --memory: the model and sizes of issue #20's memory comparison.
MEMORY_FEATURES, MEMORY_WIDTH, MEMORY_DEPTH = 512, 1024, 4
# Measured over this many optimizer steps, after a warm-up fit of one.
MEMORY_OPTIMIZER_STEPS = 2
MEMORY_CHILD_PREFIX = "MEMORY_RESULT "
MEMORY_CHILD_TIMEOUT_S = 600


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

    def model_list(text: str, allow_none: bool = False) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        if allow_none and names == ["none"]:
            return []
        unknown = sorted(set(names) - set(MODELS))
        if not names or unknown:
            raise argparse.ArgumentTypeError(
                f"unknown model(s) {unknown}; choose from {','.join(MODELS)}"
            )
        return list(dict.fromkeys(names))

    parser = argparse.ArgumentParser(
        description="Gradient accumulation benchmark: plain fit, Keras's "
        "gradient_accumulation_steps and GradientAccumulationModel in window "
        "and in-step mode.",
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
                        help="timed epochs (rounds) per configuration, after "
                             "one untimed warm-up epoch")
    parser.add_argument("--steps", type=int, default=64,
                        help="micro-batches per epoch (in-step: steps / N "
                             "big batches)")
    parser.add_argument("--batch", type=int, default=32,
                        help="per-replica micro-batch size")
    # XLA's CPU convolutions run several times slower than oneDNN's: the
    # ConvNet's in-step+XLA epochs would add minutes to the default run and
    # say little, so only the MLP gets them by default.
    parser.add_argument("--xla", metavar="MODELS", default="mlp",
                        type=lambda text: model_list(text, allow_none=True),
                        help="models also timed in-step with "
                             "jit_compile=True (N >= 2), comma-separated, or "
                             "'none'; with --memory, 'none' leaves in-step+"
                             "XLA out")
    parser.add_argument("--memory", action="store_true",
                        help="measure peak memory (one subprocess per "
                             "configuration) instead of timing; uses "
                             "--memory-accum and --memory-batch")
    parser.add_argument("--memory-accum", type=int_list, default="4,8",
                        help="with --memory: accumulation steps N")
    parser.add_argument("--memory-batch", type=int, default=1024,
                        help="with --memory: the micro-batch (1 replica)")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the results as JSON here")
    # One --memory configuration, in its own process (internal).
    parser.add_argument("--memory-child", metavar="SPEC",
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.steps < 1 or args.batch < 1:
        parser.error("--epochs, --steps and --batch must be positive")
    if args.memory_batch < 1:
        parser.error("--memory-batch must be positive")
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


def make_config(
    inner: keras.Model, config: str, accum_steps: int, loss: keras.losses.Loss
) -> keras.Model:
    """Wraps (or not) and compiles `inner` as `config` trains it."""
    if config == BUILTIN:
        optimizer = keras.optimizers.Adam(
            LEARNING_RATE, gradient_accumulation_steps=accum_steps
        )
    else:
        optimizer = keras.optimizers.Adam(LEARNING_RATE)
    if config == WRAPPER:
        model = keras_mgpu.GradientAccumulationModel(
            inner, accum_steps=accum_steps)
    elif config in IN_STEP_CONFIGS:
        model = keras_mgpu.GradientAccumulationModel(
            inner, accum_steps=accum_steps, mode="in_step")
    else:
        model = inner
    # XLA off except for in-step+XLA: Keras's "auto" already turns it off on
    # CPU and under tf.distribute; pinning it keeps GPU runs comparable too.
    # The in-step wrapper compiles only its replica-local loop with XLA.
    model.compile(optimizer=optimizer, loss=loss,
                  jit_compile=config == IN_STEP_XLA)
    return model


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
    datasets: Sequence[tf.data.Dataset],
    epochs: int,
) -> list[list[float]]:
    """Times every (config, N) of one model and replica count, interleaved.

    `datasets[i]` is configuration i's data: the same samples for all, in
    micro-batches or (in-step) in big batches.

    Each configuration is compiled and trained for one untimed warm-up epoch,
    which traces its train step (Keras keeps the traced step across `fit`
    calls; for in-step+XLA it also holds the XLA compile). The timed epochs
    then go round-robin, one epoch per configuration per round, starting one
    place later each round: on a shared, noisy machine a burst of background
    load then hits all configurations alike rather than whichever happened
    to be running.

    Returns:
        Per configuration, the list of its timed epochs' seconds.
    """
    keras.backend.clear_session()
    gc.collect()
    models = []
    for (config, n), dataset in zip(configs, datasets):
        model = compile_config(model_name, strategy, config, n)
        train_epoch(model, dataset)
        models.append(model)
    seconds: list[list[float]] = [[] for _ in configs]
    for round_index in range(epochs):
        for k in range(len(configs)):
            i = (k + round_index) % len(configs)
            seconds[i].append(train_epoch(models[i], datasets[i]))
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
                # In-step needs one whole big batch per epoch.
                if args.steps >= n:
                    configs.append((IN_STEP, n))
                    # At N = 1 there is no loop for XLA to compile.
                    if model_name in args.xla and n >= 2:
                        configs.append((IN_STEP_XLA, n))
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


def _time_ratio(ours: Result, theirs: Result, target: float) -> dict:
    ratio = ours.ms_per_micro_batch / theirs.ms_per_micro_batch
    return {
        "model": ours.model, "replicas": ours.replicas, "config": ours.config,
        "accum_steps": ours.accum_steps, "ratio": ratio,
        "target": f"<= {target:.2f}", "met": ratio <= target,
    }


def compute_ratios(results: list[Result], args: argparse.Namespace) -> dict:
    """The target ratios, per model (and per N for all but the second).

    Each compares two medians from the same group, measured side by side.
    """
    wrapper_vs_builtin = []
    for model in args.models:
        for n in RATIO_ACCUM_STEPS:
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
    in_step_vs_builtin, in_step_vs_window = [], []
    for model in args.models:
        for n in RATIO_ACCUM_STEPS:
            for config in IN_STEP_CONFIGS:
                ours = find(results, model, 1, config, n)
                theirs = find(results, model, 1, BUILTIN, n)
                if ours and theirs:
                    in_step_vs_builtin.append(
                        _time_ratio(ours, theirs, IN_STEP_VS_BUILTIN_TARGET))
                ours = find(results, model, multi, config, n)
                window = find(results, model, multi, WRAPPER, n)
                if multi > 1 and ours and window:
                    in_step_vs_window.append(
                        _time_ratio(ours, window, IN_STEP_VS_WINDOW_TARGET))
    return {
        "wrapper_vs_builtin_time_per_micro_batch": wrapper_vs_builtin,
        "wrapper_vs_plain_samples_per_second": wrapper_vs_plain,
        "in_step_vs_builtin_time_per_micro_batch": in_step_vs_builtin,
        "in_step_vs_window_time_per_micro_batch": in_step_vs_window,
    }


def format_table(results: list[Result]) -> str:
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


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def _short(config: str) -> str:
    return {IN_STEP: "in_step", IN_STEP_XLA: "in_step+XLA"}.get(config, config)


def format_ratios(ratios: dict) -> str:
    lines = ["(a) GradientAccumulationModel (window) / Keras built-in, time "
             "per micro-batch, 1 replica (target <= 1.00):"]
    for r in ratios["wrapper_vs_builtin_time_per_micro_batch"]:
        lines.append(f"    {r['model']:8s} N={r['accum_steps']}: "
                     f"{r['ratio']:.2f}  {_verdict(r['met'])}")
    if not ratios["wrapper_vs_builtin_time_per_micro_batch"]:
        lines.append("    not measured: needs --replicas 1 and --accum 4 or 8")
    lines.append("(b) GradientAccumulationModel (window) N=4 / plain fit, "
                 "samples/s, multi-replica (target > 1):")
    for r in ratios["wrapper_vs_plain_samples_per_second"]:
        lines.append(f"    {r['model']:8s} {r['replicas']} replicas: "
                     f"{r['ratio']:.2f}  {_verdict(r['met'])}")
    if not ratios["wrapper_vs_plain_samples_per_second"]:
        lines.append("    not measured: needs --replicas 2 and --accum 4")
    lines.append("(c) in-step / Keras built-in, time per micro-batch, 1 "
                 f"replica (target <= {IN_STEP_VS_BUILTIN_TARGET:.2f}):")
    for r in ratios["in_step_vs_builtin_time_per_micro_batch"]:
        lines.append(f"    {r['model']:8s} N={r['accum_steps']} "
                     f"{_short(r['config']):12s}: {r['ratio']:.2f}  "
                     f"{_verdict(r['met'])}")
    if not ratios["in_step_vs_builtin_time_per_micro_batch"]:
        lines.append("    not measured: needs --replicas 1 and --accum 4 or 8")
    lines.append("(d) in-step / window mode, time per micro-batch, "
                 f"multi-replica (target <= {IN_STEP_VS_WINDOW_TARGET:.2f}):")
    for r in ratios["in_step_vs_window_time_per_micro_batch"]:
        lines.append(f"    {r['model']:8s} {r['replicas']} replicas N="
                     f"{r['accum_steps']} {_short(r['config']):12s}: "
                     f"{r['ratio']:.2f}  {_verdict(r['met'])}")
    if not ratios["in_step_vs_window_time_per_micro_batch"]:
        lines.append("    not measured: needs --replicas 2 and --accum 4 or 8")
    return "\n".join(lines)


# --- Peak memory (--memory) ---------------------------------------------------

MEMORY_METHOD = (
    "Each configuration runs in a fresh subprocess on 1 replica: build, "
    "compile, a warm-up fit of 1 optimizer step (traces the step, creates "
    "the optimizer's and the wrapper's variables), then "
    "tf.config.experimental.reset_memory_stats(device) and a measured fit "
    f"of {MEMORY_OPTIMIZER_STEPS} optimizer steps on one fixed batch "
    "(tf.data.Dataset.from_tensors(...).repeat()). 'peak' is "
    "tf.config.experimental.get_memory_info(device)['peak'] after it: the "
    "most bytes TensorFlow's allocator (it keeps statistics for CPU:0 too) "
    "held at once: weights, optimizer slots, window mode's accumulators, "
    "the input batch, activations, gradients, XLA's buffers. 'over start' "
    "is that peak minus the bytes in use when the measured fit began (the "
    "step's transient memory; persistent state such as window mode's "
    "accumulators is not in it). 'RSS growth' is a cross-check from the "
    "OS: the process's peak resident set (VmHWM, reset by writing 5 to "
    "/proc/self/clear_refs) minus its resident set when the measured fit "
    "began; it includes memory outside TensorFlow's allocator but misses "
    "heap that malloc kept from the warm-up and reused. The ratios use "
    "'peak'."
)


def build_memory_model() -> keras.Model:
    """The MLP of issue #20's memory comparison: 512 -> 4 x 1024 -> 10."""
    return keras.Sequential(
        [keras.Input((MEMORY_FEATURES,))]
        + [keras.layers.Dense(MEMORY_WIDTH, activation="relu")
           for _ in range(MEMORY_DEPTH)]
        + [keras.layers.Dense(NUM_CLASSES)],
        name=f"mlp_{MEMORY_FEATURES}_{MEMORY_DEPTH}x{MEMORY_WIDTH}")


def memory_specs(args: argparse.Namespace) -> list[dict]:
    """The configurations --memory measures, one subprocess each.

    `batch` is the samples per `fit` step, `micro_batch` the samples per
    forward and backward pass.
    """
    micro = args.memory_batch
    specs = [dict(config=PLAIN, accum_steps=1, batch=micro, micro_batch=micro)]
    for n in args.memory_accum:
        if n > 1:
            # Plain fit on the big batch: what accumulation saves memory
            # against.
            specs.append(dict(config=PLAIN, accum_steps=1, batch=n * micro,
                              micro_batch=n * micro, big_batch_of=n))
        specs.append(dict(config=WRAPPER, accum_steps=n, batch=micro,
                          micro_batch=micro))
        specs.append(dict(config=IN_STEP, accum_steps=n, batch=n * micro,
                          micro_batch=micro))
        if args.xla and n > 1:
            specs.append(dict(config=IN_STEP_XLA, accum_steps=n,
                              batch=n * micro, micro_batch=micro))
    return specs


def _proc_status_kib(field: str) -> Optional[int]:
    """A `kB` field of /proc/self/status (Linux), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Resets VmHWM to the current resident set (Linux 4.0+)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_child(spec: dict) -> dict:
    """Runs one --memory configuration in this (fresh) process."""
    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    config, n, batch = spec["config"], spec["accum_steps"], spec["batch"]
    keras.utils.set_random_seed(SEED)
    inner = build_memory_model()
    model = make_config(
        inner, config, n,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # Made by TensorFlow, so the batch is in its allocator's figures (a
    # tensor made from NumPy may alias NumPy's memory instead).
    x = tf.random.stateless_normal((batch, MEMORY_FEATURES), seed=(SEED, 0))
    y = tf.random.stateless_uniform((batch,), seed=(SEED, 1),
                                    maxval=NUM_CLASSES, dtype=tf.int32)
    fit_steps_per_update = n if config == WRAPPER else 1

    def fit(updates: int) -> None:
        data = tf.data.Dataset.from_tensors((x, y)).repeat(
            updates * fit_steps_per_update)
        model.fit(data, epochs=1, verbose=0, shuffle=False)

    fit(1)
    gc.collect()
    tf.config.experimental.reset_memory_stats(device)
    start = tf.config.experimental.get_memory_info(device)["current"]
    rss_start = _proc_status_kib("VmRSS")
    rss_reset = _reset_peak_rss()
    fit(MEMORY_OPTIMIZER_STEPS)
    info = tf.config.experimental.get_memory_info(device)
    rss_peak = _proc_status_kib("VmHWM") if rss_reset else None
    return {
        **spec, "device": device,
        "params": int(inner.count_params()),
        "optimizer_steps": int(model.optimizer.iterations.numpy()),
        "start_bytes": int(start), "peak_bytes": int(info["peak"]),
        "over_start_bytes": int(info["peak"]) - int(start),
        "rss_growth_bytes": (None if rss_peak is None or rss_start is None
                             else 1024 * (rss_peak - rss_start)),
        # The whole process's peak (Linux: ru_maxrss in KiB), TensorFlow's
        # own start-up included: context for the growth above.
        "process_max_rss_bytes":
            1024 * resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


def _memory_label(r: dict) -> str:
    if r["config"] == PLAIN:
        kind = "big batch" if r.get("big_batch_of") else "micro-batch"
        return f"plain fit, {kind}"
    return r["config"]


def run_memory(args: argparse.Namespace) -> dict:
    """Measures every --memory configuration, each in a fresh subprocess."""
    specs = memory_specs(args)
    results = []
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    for i, spec in enumerate(specs, 1):
        print(f"[{i}/{len(specs)}] {_memory_label(spec)}, N="
              f"{spec['accum_steps']}, {spec['batch']} samples per fit step",
              flush=True)
        began = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__),
                 "--memory-child", json.dumps(spec)],
                capture_output=True, text=True, env=env,
                timeout=MEMORY_CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            results.append({**spec, "error": "timed out"})
            print(f"    timed out after {MEMORY_CHILD_TIMEOUT_S} s")
            continue
        lines = [line for line in proc.stdout.splitlines()
                 if line.startswith(MEMORY_CHILD_PREFIX)]
        if proc.returncode or not lines:
            tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
            results.append({**spec, "error": f"exit {proc.returncode}: "
                                             f"{tail}"})
            print(f"    failed (exit {proc.returncode}):\n{tail}")
            continue
        result = json.loads(lines[-1][len(MEMORY_CHILD_PREFIX):])
        result["seconds"] = time.perf_counter() - began
        expected = 1 + MEMORY_OPTIMIZER_STEPS
        if result["optimizer_steps"] != expected:
            # The measured fit would not be the steps it claims to be.
            result["error"] = (f"{result['optimizer_steps']} optimizer steps, "
                               f"expected {expected}")
        results.append(result)
        print(f"    peak {result['peak_bytes'] / 2**20:.1f} MiB "
              f"({result['seconds']:.0f} s)", flush=True)
    ok = [r for r in results if "error" not in r]
    ratios = []
    for n in args.memory_accum:
        window = next((r for r in ok if r["config"] == WRAPPER
                       and r["accum_steps"] == n), None)
        for r in ok:
            if window is None or r["accum_steps"] != n:
                continue
            if r["config"] in IN_STEP_CONFIGS:
                ratio = r["peak_bytes"] / window["peak_bytes"]
                ratios.append({
                    "config": r["config"], "accum_steps": n,
                    "micro_batch": args.memory_batch, "ratio": ratio,
                    "target": f"<= {IN_STEP_VS_WINDOW_MEMORY_TARGET:.2f}",
                    "met": ratio <= IN_STEP_VS_WINDOW_MEMORY_TARGET,
                })
    return {
        "model": build_memory_model().name,
        "params": next((r["params"] for r in ok), None),
        "device": next((r["device"] for r in ok), None),
        "micro_batch": args.memory_batch, "accum": args.memory_accum,
        "optimizer_steps_measured": MEMORY_OPTIMIZER_STEPS,
        "method": MEMORY_METHOD,
        "results": results,
        "ratios": {"in_step_vs_window_peak_memory": ratios},
    }


def format_memory(memory: dict) -> str:
    mib = 2.0 ** 20
    window_peak = {r["accum_steps"]: r["peak_bytes"]
                   for r in memory["results"]
                   if r["config"] == WRAPPER and "error" not in r}

    def against_window(r: dict) -> str:
        if r["config"] == WRAPPER:
            return "-"
        # Plain fit on the micro-batch belongs to no one N.
        n = r.get("big_batch_of") if r["config"] == PLAIN else r["accum_steps"]
        if n not in window_peak:
            return "-"
        return f"{r['peak_bytes'] / window_peak[n]:.2f}x"

    header = ("configuration", "N", "samples/fit step", "micro-batch",
              "peak MiB", "over start MiB", "RSS growth MiB", "vs window")
    rows = []
    for r in memory["results"]:
        n = "-" if r["config"] == PLAIN else str(r["accum_steps"])
        if "error" in r:
            rows.append((_memory_label(r), n, str(r["batch"]),
                         str(r["micro_batch"]), "failed", "-", "-", "-"))
            continue
        rss = r["rss_growth_bytes"]
        rows.append((
            _memory_label(r), n, str(r["batch"]), str(r["micro_batch"]),
            f"{r['peak_bytes'] / mib:.1f}",
            f"{r['over_start_bytes'] / mib:.1f}",
            "n/a" if rss is None else f"{rss / mib:.1f}",
            against_window(r),
        ))
    lines = [markdown_table(header, rows, {0}), "",
             "vs window: peak over window mode's peak at the same N (plain "
             "fit, big batch: at N = its batch / the micro-batch).", "",
             "(e) in-step / window mode, peak memory, 1 replica (target <= "
             f"{IN_STEP_VS_WINDOW_MEMORY_TARGET:.2f}):"]
    for r in memory["ratios"]["in_step_vs_window_peak_memory"]:
        lines.append(f"    N={r['accum_steps']} {_short(r['config']):12s}: "
                     f"{r['ratio']:.2f}  {_verdict(r['met'])}")
    if not memory["ratios"]["in_step_vs_window_peak_memory"]:
        lines.append("    not measured")
    return "\n".join(lines)


# --- Main -----------------------------------------------------------------------


def versions_line(on_gpu: bool) -> str:
    return (f"TensorFlow {tf.__version__}, Keras {keras.__version__}, "
            f"keras-mgpu {keras_mgpu.__version__}, Python "
            f"{platform.python_version()}, {os.cpu_count()} CPU cores, "
            f"{'GPUs' if on_gpu else 'no GPU'}")


def write_json(path: str, args: argparse.Namespace, on_gpu: bool,
               results: list[Result], ratios: dict, memory: Optional[dict],
               elapsed: float) -> None:
    """One schema for both runs: a timing run has `memory` null, a --memory
    run has no `results` and empty `ratios`."""
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
            "xla": args.xla, "memory": args.memory,
        },
        "configurations": DESCRIPTIONS,
        "targets": {
            "in_step_vs_builtin_time_per_micro_batch":
                IN_STEP_VS_BUILTIN_TARGET,
            "in_step_vs_window_time_per_micro_batch":
                IN_STEP_VS_WINDOW_TARGET,
            "in_step_vs_window_peak_memory": IN_STEP_VS_WINDOW_MEMORY_TARGET,
        },
        "results": [dataclasses.asdict(r) for r in results],
        "ratios": ratios,
        "memory": memory,
        "total_seconds": elapsed,
    }
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"Wrote {path}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    if args.memory_child:
        print(MEMORY_CHILD_PREFIX
              + json.dumps(memory_child(json.loads(args.memory_child))))
        return
    if args.memory:
        on_gpu = bool(tf.config.list_physical_devices("GPU"))
        print(versions_line(on_gpu))
        print(f"Peak memory, {build_memory_model().name}, micro-batch "
              f"{args.memory_batch}, N = "
              f"{', '.join(map(str, args.memory_accum))}.\n"
              f"How: {MEMORY_METHOD}\n", flush=True)
        start = time.perf_counter()
        memory = run_memory(args)
        elapsed = time.perf_counter() - start
        print()
        print(format_memory(memory))
        print(f"\nTotal {elapsed:.0f} s.")
        if args.json:
            write_json(args.json, args, on_gpu, [], {}, memory, elapsed)
        return

    strategies = make_strategies(args.replicas)
    on_gpu = bool(tf.config.list_physical_devices("GPU"))

    print(versions_line(on_gpu))
    if not on_gpu:
        print("NOTE: replicas are logical CPU devices sharing the same cores. "
              "These figures show the mechanics (work added per micro-batch, "
              "all-reduces saved), not GPU performance.")
    print(f"{args.steps} micro-batches of {args.batch} per replica per epoch "
          "(in-step: batches of N micro-batches); 1 warm-up epoch, then the "
          f"median of {args.epochs} timed epochs, interleaved (round-robin) "
          "across the configurations of each model and replica count.")
    uneven = [n for n in args.accum if args.steps % n and args.steps >= n]
    if uneven:
        print(f"NOTE: --steps {args.steps} is not a multiple of N = "
              f"{', '.join(map(str, uneven))}: in-step epochs there hold "
              "steps // N big batches, and are timed per micro-batch they "
              "hold.")
    print()

    results: list[Result] = []
    groups = plan(args)
    start = time.perf_counter()
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
    elapsed = time.perf_counter() - start

    ratios = compute_ratios(results, args)
    print()
    print(format_table(results))
    print("\nConfigurations:")
    for config in (PLAIN, BUILTIN, WRAPPER, IN_STEP, IN_STEP_XLA):
        if any(r.config == config for r in results):
            print(f"  {config}: {DESCRIPTIONS[config]}.")
    print("vs plain: time per micro-batch relative to plain fit with the "
          "same model and replicas.\nfit steps: fit steps per epoch (in-step: "
          "one per N micro-batches).\nspread: (slowest - fastest) / median "
          "of the timed epochs.\n")
    print(format_ratios(ratios))
    print(f"\nTotal {elapsed:.0f} s.")

    if args.json:
        write_json(args.json, args, on_gpu, results, ratios, None, elapsed)


if __name__ == "__main__":
    main()
