"""`keras-mgpu bench`: throughput and scaling of a synthetic workload, 1..N replicas.

Each replica count runs in its own child process (`keras-mgpu bench --_child`):
TensorFlow allows one `MirroredStrategy` per process, and logical CPUs must
be configured before TensorFlow initialises its devices. A child runs every
(precision, accumulation) configuration of its replica count and writes JSON
to a file; the parent combines them, prints the table and writes `--json` and
`--plot`.

Workload: `--model resnet` (a small ResNet-style ConvNet on 32x32x3 images:
stem, three stages of two residual blocks, BatchNormalization) or `--model
mlp` (784-2048-2048-10). The data is one random global batch, repeated: the
distributed iterator prefetches it to every replica's device, so the input
pipeline is not what is measured.

Timing: one untimed `fit` of `warmup_steps` steps traces the train step; then
one `fit` of `repeats` epochs of `steps` steps each, each epoch timed from its
start to its end (Keras fetches the logs before `on_epoch_end`, which waits
for the last step). Throughput uses the median epoch. Then one more `fit` of
two epochs of `steps` steps with `DistributedLogger` reads its input wait
(the second epoch's, past the logger's own trace): with the input always
ready, that is the fixed cost of fetching a batch at this step time, the
floor under any real pipeline's input wait.

JSON schema (`--json PATH`), schema id `keras-mgpu-bench/2` (`/1` had no
input wait: its `input_wait_fraction` was always null):

    {"schema": "keras-mgpu-bench/2",
     "versions": {"python": str, "tensorflow": str, "keras": str,
                  "keras_mgpu": str},
     "device": {"kind": "gpu"|"cpu", "gpus": [str],
                "logical_cpus": bool,        # replicas are logical CPUs
                "cpu_count": int, "note": str},
     "settings": {"model": "resnet"|"mlp", "replicas": [int],
                  "precisions": [str],        # as requested
                  "accum": [int], "batch_size": int,   # per replica
                  "steps": int, "repeats": int, "warmup_steps": int},
     "results": [{"replicas": int, "precision": str,   # as requested
                  "policy": str,              # the Keras dtype policy run
                  "accum_steps": int,         # 1: plain fit, no wrapper
                  "global_batch_size": int,
                  "epoch_seconds": [float],   # one per repeat
                  "step_time_ms": float,      # median epoch / steps
                  "examples_per_s": float,
                  "scaling_efficiency": float|null,
                  "peak_memory_bytes": int|null,     # max over replicas
                  "input_examples_per_s": float,     # the input alone
                  "input_wait_fraction": float|null}],  # a ready batch
     "mixed_precision": [{"replicas": int, "accum_steps": int,
                          "policy": str, "speedup": float,
                          "peak_memory_change": float|null}],
     "input_wait": {"note": str},        # what input_wait_fraction is
     "notes": [str]}

`scaling_efficiency` is throughput(N) / (N x throughput(1)) for the same
precision and accumulation (with `--replicas` lacking 1, the smallest count
is the baseline: (throughput(N) / N) / (throughput(m) / m)).
`speedup` is examples/s of the mixed policy over float32, and
`peak_memory_change` is peak(mixed) / peak(float32) - 1 (null on CPU, where
TensorFlow keeps no memory statistics).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Mapping, Optional, Sequence

# The text table and the chart have their own module; `_bench.<name>` keeps
# naming them.
from keras_mgpu._bench_report import check_plot_format  # noqa: F401
from keras_mgpu._bench_report import figure  # noqa: F401
from keras_mgpu._bench_report import format_table  # noqa: F401
from keras_mgpu._bench_report import plot  # noqa: F401
from keras_mgpu._version import __version__

# Defined with the argument parser, which must not import TensorFlow.
from keras_mgpu._args import MAX_REPLICAS  # noqa: F401
from keras_mgpu._args import MODELS
from keras_mgpu._args import PRECISIONS  # noqa: F401
from keras_mgpu._args import parse_choice_list  # noqa: F401
from keras_mgpu._args import parse_int_list  # noqa: F401

SCHEMA = "keras-mgpu-bench/2"
NUM_CLASSES = 10
CPU_NOTE = (
    "No GPU: replicas are logical CPU devices sharing the same CPU cores. "
    "These figures show the mechanics of data-parallel training (per-replica "
    "work, all-reduce overhead), not GPU performance."
)
INPUT_WAIT_NOTE = (
    "input wait is DistributedLogger's, in one more fit per configuration. "
    "The input is one batch repeated and prefetched, always ready, so it is "
    "the fixed cost of fetching a ready batch at this step time: a real "
    "pipeline's input wait at the same step time is this or more, and only "
    "the excess is the pipeline's to remove."
)


# --- Precisions ---------------------------------------------------------------


def resolve_precisions(precisions: Sequence[str],
                       compute_capabilities: Sequence) -> dict[str, str]:
    """Maps each requested precision to the Keras dtype policy to run.

    `"mixed"` is `mixed_precision.choose_policy`'s pick for these GPUs; on a
    CPU or an old GPU, where it picks float32, it is an error (name the
    policy explicitly to force it).

    Example:

    >>> resolve_precisions(["float32", "mixed"], [(8, 0)])
    {'float32': 'float32', 'mixed': 'mixed_bfloat16'}
    """
    from keras_mgpu import mixed_precision

    policies = {}
    for precision in precisions:
        if precision != "mixed":
            policies[precision] = precision
            continue
        policy, reason = mixed_precision.choose_policy(list(compute_capabilities))
        if policy == "float32":
            raise ValueError(
                f"--precision mixed: mixed precision is not supported here "
                f"({reason}). To run it anyway, pass --precision "
                "mixed_bfloat16 or mixed_float16."
            )
        policies[precision] = policy
    return policies


# --- Child: one replica count ------------------------------------------------------


def build_model(name: str):
    """The benchmark's model under the current global dtype policy."""
    import keras

    # The head is float32 under any policy: logits and loss stay float32.
    head = keras.layers.Dense(NUM_CLASSES, dtype="float32", name="logits")
    if name == "mlp":
        return keras.Sequential([
            keras.Input((784,)),
            keras.layers.Dense(2048, activation="relu"),
            keras.layers.Dense(2048, activation="relu"),
            head,
        ], name="mlp")
    layers = keras.layers

    def conv_bn(x, filters, kernel, stride=1, relu=True):
        x = layers.Conv2D(filters, kernel, strides=stride, padding="same",
                          use_bias=False)(x)
        x = layers.BatchNormalization()(x)
        return layers.ReLU()(x) if relu else x

    inputs = keras.Input((32, 32, 3))
    x = conv_bn(inputs, 32, 3)
    for filters, stride in ((32, 1), (64, 2), (128, 2)):
        for block in range(2):
            s = stride if block == 0 else 1
            shortcut = x
            if s != 1 or x.shape[-1] != filters:
                shortcut = conv_bn(x, filters, 1, s, relu=False)
            y = conv_bn(x, filters, 3, s)
            y = conv_bn(y, filters, 3, relu=False)
            x = layers.ReLU()(layers.Add()([shortcut, y]))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, head(x), name="resnet")


def _dataset(model_name: str, global_batch: int):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    shape = (784,) if model_name == "mlp" else (32, 32, 3)
    x = rng.standard_normal((global_batch, *shape), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, size=(global_batch,), dtype=np.int32)
    # One batch, repeated: no per-step host work beyond handing over the same
    # tensors; the distributed iterator prefetches them to each device.
    return (tf.data.Dataset.from_tensor_slices((x, y))
            .batch(global_batch, drop_remainder=True)
            .repeat()
            .prefetch(tf.data.AUTOTUNE))


def _input_rate(strategy, dataset, steps: int, global_batch: int) -> float:
    """Examples/s of the input pipeline alone, through the same distribution."""
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    next(iterator)
    start = time.perf_counter()
    for _ in range(steps):
        next(iterator)
    return steps * global_batch / max(time.perf_counter() - start, 1e-9)


def _input_wait(model, dataset, steps: int) -> Optional[float]:
    """DistributedLogger's input wait in the second of two more epochs."""
    from keras_mgpu.callbacks import DistributedLogger

    with tempfile.TemporaryDirectory() as log_dir:
        model.fit(dataset, epochs=2, steps_per_epoch=steps, verbose=0,
                  callbacks=[DistributedLogger(log_dir, update_freq="epoch",
                                               console=False)])
        with open(os.path.join(log_dir, "metrics.jsonl")) as f:
            return json.loads(f.readlines()[-1])["input_wait"]


def run_child(replicas: int, model_name: str, policies: Mapping[str, str],
              accum: Sequence[int], batch_size: int, steps: int,
              repeats: int, warmup_steps: int) -> dict[str, Any]:
    """Runs every configuration at `replicas` replicas; must start the process.

    It configures the devices (logical CPUs without GPUs), so nothing may
    have initialised TensorFlow's devices before.
    """
    import keras
    import tensorflow as tf

    from keras_mgpu import strategy as strategy_lib
    from keras_mgpu.accumulation import GradientAccumulationModel

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if replicas > len(gpus):
            raise ValueError(f"--replicas: {replicas} replicas requested but "
                             f"only {len(gpus)} GPU(s) are visible.")
        devices = [f"/gpu:{i}" for i in range(replicas)]
        cross_device_ops = (tf.distribute.NcclAllReduce()
                            if replicas > 1 else None)
    else:
        devices = (strategy_lib.configure_virtual_cpus(replicas)
                   if replicas > 1 else ["/cpu:0"])
        cross_device_ops = None
    strategy = strategy_lib.auto_strategy(devices=devices,
                                        cross_device_ops=cross_device_ops)
    global_batch = batch_size * replicas
    dataset = _dataset(model_name, global_batch)
    input_rate = _input_rate(strategy, dataset, max(steps, 10), global_batch)

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds: list[float] = []

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self._start)

    results = []
    for precision, policy in policies.items():
        for n in accum:
            keras.backend.clear_session()
            keras.mixed_precision.set_global_policy(policy)
            try:
                with strategy.scope():
                    model = build_model(model_name)
                    if n > 1:
                        model = GradientAccumulationModel(
                            model, accum_steps=n)
                    model.compile(
                        optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                        loss=keras.losses.SparseCategoricalCrossentropy(
                            from_logits=True))
            finally:
                keras.mixed_precision.set_global_policy("float32")
            model.fit(dataset, epochs=1, steps_per_epoch=warmup_steps,
                      verbose=0)
            if gpus:
                for i in range(replicas):
                    tf.config.experimental.reset_memory_stats(f"GPU:{i}")
            timer = EpochTimer()
            model.fit(dataset, epochs=repeats, steps_per_epoch=steps,
                      verbose=0, callbacks=[timer])
            peak = None
            if gpus:
                peak = max(
                    tf.config.experimental.get_memory_info(f"GPU:{i}")["peak"]
                    for i in range(replicas))
            median = statistics.median(timer.seconds)
            waited = _input_wait(model, dataset, steps)
            results.append({
                "replicas": replicas, "precision": precision,
                "policy": policy, "accum_steps": n,
                "global_batch_size": global_batch,
                "epoch_seconds": [round(s, 6) for s in timer.seconds],
                "step_time_ms": 1000.0 * median / steps,
                "examples_per_s": steps * global_batch / median,
                "scaling_efficiency": None,
                "peak_memory_bytes": peak,
                "input_examples_per_s": input_rate,
                "input_wait_fraction": waited,
            })
    return {"gpus": [tf.config.experimental.get_device_details(g)
                     .get("device_name", g.name) for g in gpus[:replicas]],
            "results": results}


# --- Parent: run the children, combine --------------------------------------------


def run_children(settings: Mapping[str, Any], policies: Mapping[str, str],
                 timeout: float, log=print) -> list[dict[str, Any]]:
    """One child process per replica count; their JSON outputs, in order."""
    outputs = []
    env = dict(os.environ)
    # The benchmark is local: a cluster's TF_CONFIG would make auto_strategy
    # refuse local devices.
    env.pop("TF_CONFIG", None)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = os.pathsep.join(
        [p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
    for i, replicas in enumerate(settings["replicas"], 1):
        log(f"[{i}/{len(settings['replicas'])}] {replicas} replica(s): "
            f"{settings['model']}, {', '.join(policies.values())}, "
            f"accum {','.join(map(str, settings['accum']))}", flush=True)
        with tempfile.TemporaryDirectory(prefix="keras_mgpu_bench_") as tmp:
            out = os.path.join(tmp, "result.json")
            command = [
                sys.executable, "-m", "keras_mgpu.cli", "bench", "--_child",
                "--_out", out, "--_policies", json.dumps(policies),
                "--replicas", str(replicas), "--model", settings["model"],
                "--accum", ",".join(map(str, settings["accum"])),
                "--batch-size", str(settings["batch_size"]),
                "--steps", str(settings["steps"]),
                "--repeats", str(settings["repeats"]),
                "--warmup-steps", str(settings["warmup_steps"]),
            ]
            try:
                done = subprocess.run(command, env=env, capture_output=True,
                                      text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"bench at {replicas} replica(s) timed out after "
                    f"{timeout:.0f} s; lower --steps/--repeats or raise "
                    "--timeout.") from None
            if done.returncode != 0 or not os.path.exists(out):
                tail = "\n".join(done.stderr.splitlines()[-30:])
                raise RuntimeError(
                    f"bench at {replicas} replica(s) failed (exit "
                    f"{done.returncode}):\n{tail}")
            with open(out) as f:
                outputs.append(json.load(f))
    return outputs


def combine(settings: Mapping[str, Any], policies: Mapping[str, str],
            outputs: Sequence[Mapping[str, Any]], on_gpu: bool) -> dict:
    """The JSON payload: results with efficiencies and mixed-precision ratios."""
    import keras
    import tensorflow as tf

    results = [dict(r) for out in outputs for r in out["results"]]
    base_replicas = min(settings["replicas"])

    def find(replicas, precision, accum):
        for r in results:
            if (r["replicas"], r["precision"], r["accum_steps"]) == (
                    replicas, precision, accum):
                return r
        return None

    for r in results:
        base = find(base_replicas, r["precision"], r["accum_steps"])
        if base:
            r["scaling_efficiency"] = (
                (r["examples_per_s"] / r["replicas"])
                / (base["examples_per_s"] / base_replicas))
    mixed = []
    if "float32" in policies.values():
        f32_name = next(p for p, v in policies.items() if v == "float32")
        for precision, policy in policies.items():
            if policy == "float32":
                continue
            for replicas in settings["replicas"]:
                for n in settings["accum"]:
                    ours, ref = (find(replicas, precision, n),
                                 find(replicas, f32_name, n))
                    if not (ours and ref):
                        continue
                    change = None
                    if ours["peak_memory_bytes"] and ref["peak_memory_bytes"]:
                        change = (ours["peak_memory_bytes"]
                                  / ref["peak_memory_bytes"] - 1.0)
                    mixed.append({
                        "replicas": replicas, "accum_steps": n,
                        "policy": policy,
                        "speedup": ours["examples_per_s"]
                        / ref["examples_per_s"],
                        "peak_memory_change": change,
                    })
    gpus: list = max((out["gpus"] for out in outputs), key=len, default=[])
    notes = [] if on_gpu else [CPU_NOTE]
    if 1 not in settings["replicas"]:
        notes.append(f"No 1-replica run: efficiencies are relative to "
                     f"{base_replicas} replicas.")
    return {
        "schema": SCHEMA,
        "versions": {"python": platform.python_version(),
                     "tensorflow": tf.__version__,
                     "keras": keras.__version__,
                     "keras_mgpu": __version__},
        "device": {"kind": "gpu" if on_gpu else "cpu", "gpus": list(gpus),
                   "logical_cpus": not on_gpu,
                   "cpu_count": os.cpu_count() or 1,
                   "note": "" if on_gpu else CPU_NOTE},
        "settings": dict(settings),
        "results": results,
        "mixed_precision": mixed,
        "input_wait": {"note": INPUT_WAIT_NOTE},
        "notes": notes,
    }


# --- Schema check ----------------------------------------------------------


_NUM = (int, float)
_RESULT_FIELDS = {
    "replicas": int, "precision": str, "policy": str, "accum_steps": int,
    "global_batch_size": int, "epoch_seconds": list, "step_time_ms": _NUM,
    "examples_per_s": _NUM, "scaling_efficiency": (*_NUM, type(None)),
    "peak_memory_bytes": (int, type(None)), "input_examples_per_s": _NUM,
    "input_wait_fraction": (*_NUM, type(None)),
}
_MIXED_FIELDS = {"replicas": int, "accum_steps": int, "policy": str,
                 "speedup": _NUM, "peak_memory_change": (*_NUM, type(None))}
_TOP_FIELDS = {"schema": str, "versions": dict, "device": dict,
               "settings": dict, "results": list, "mixed_precision": list,
               "input_wait": dict, "notes": list}
_SETTINGS_FIELDS = {"model": str, "replicas": list, "precisions": list,
                    "accum": list, "batch_size": int, "steps": int,
                    "repeats": int, "warmup_steps": int}
_DEVICE_FIELDS = {"kind": str, "gpus": list, "logical_cpus": bool,
                  "cpu_count": int, "note": str}


def _check_fields(obj: Any, fields: Mapping[str, Any], where: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be an object, got {obj!r}.")
    for key, kind in fields.items():
        if key not in obj:
            raise ValueError(f"{where} lacks field {key!r}.")
        value = obj[key]
        if isinstance(value, bool) and kind is not bool:
            raise ValueError(f"{where}.{key} must not be a boolean.")
        if not isinstance(value, kind):
            raise ValueError(f"{where}.{key} has the wrong type: {value!r}.")


def validate(payload: Mapping[str, Any]) -> None:
    """Raises `ValueError`, naming the field, if `payload` breaks the schema.

    Example:

    >>> validate({"schema": "something else"})
    Traceback (most recent call last):
    ...
    ValueError: schema is 'something else', expected 'keras-mgpu-bench/2'.
    """
    if payload.get("schema") != SCHEMA:
        raise ValueError(f"schema is {payload.get('schema')!r}, expected "
                         f"{SCHEMA!r}.")
    _check_fields(payload, _TOP_FIELDS, "payload")
    _check_fields(payload["settings"], _SETTINGS_FIELDS, "settings")
    _check_fields(payload["device"], _DEVICE_FIELDS, "device")
    if payload["device"]["kind"] not in ("cpu", "gpu"):
        raise ValueError(f"device.kind is {payload['device']['kind']!r}.")
    if payload["settings"]["model"] not in MODELS:
        raise ValueError(f"settings.model is "
                         f"{payload['settings']['model']!r}.")
    for i, r in enumerate(payload["results"]):
        _check_fields(r, _RESULT_FIELDS, f"results[{i}]")
        if r["examples_per_s"] <= 0 or r["replicas"] < 1:
            raise ValueError(f"results[{i}] has a non-positive throughput or "
                             "replica count.")
        if not r["epoch_seconds"] or not all(
                isinstance(s, _NUM) for s in r["epoch_seconds"]):
            raise ValueError(f"results[{i}].epoch_seconds must be a "
                             "non-empty list of numbers.")
    for i, m in enumerate(payload["mixed_precision"]):
        _check_fields(m, _MIXED_FIELDS, f"mixed_precision[{i}]")
    _check_fields(payload["input_wait"], {"note": str}, "input_wait")

