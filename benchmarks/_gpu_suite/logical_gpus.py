"""The `logical_gpus` part: one GPU as two logical GPUs under MirroredStrategy.

`GradientAccumulationModel` against the big-batch step (largest absolute
weight difference; on a GPU with and without TensorFloat-32), and the
all-reduces run per optimizer step, counted as `tests/test_accumulation.py`
counts them. The dry run uses 2 logical CPUs. The counter is a copy of the
tests' own: importing the tests would configure logical CPUs
(`tests/conftest.py`) in this process.
"""

from __future__ import annotations

from . import ACCUM_STEPS
from .child import Recorder, physical_gpus

# Each of the two logical GPUs; the models of that part need a few MiB.
LOGICAL_GPU_MIB = 4096
# Each is measured with and without TensorFloat-32 on a GPU.
EXACTNESS_OPTIMIZERS = {"gpu": ("adam", "sgd_momentum"), "dry-run": ("adam",)}
EXACTNESS_TOLERANCE = 1e-5


def _counting_all_reduce(tf, gradient_shape):
    """tests/test_accumulation.py's `CountingAllReduce`, built on demand.

    Counts the cross-replica reductions whose payload includes a tensor of
    `gradient_shape` (the first kernel's); a batched reduction counts once:
    one all-reduce, however it is carried out. Defined inside a function
    because its base class is TensorFlow's, imported by the part only.
    """

    class CountingAllReduce(tf.distribute.ReductionToOneDevice):
        def __init__(self):
            super().__init__()
            self.calls = 0
            self.in_batch = False

        def _count(self, values):
            for value in values:
                for v in getattr(value, "values", (value,)):
                    if tuple(v.shape) == tuple(gradient_shape):
                        self.calls += 1
                        return

        def reduce_implementation(self, reduce_op, per_replica_value,
                                  destinations, options):
            if not self.in_batch:
                self._count([per_replica_value])
            return super().reduce_implementation(
                reduce_op, per_replica_value, destinations, options)

        def batch_reduce_implementation(self, reduce_op,
                                        value_destination_pairs, options):
            self._count([v for v, _ in value_destination_pairs])
            self.in_batch = True
            try:
                return super().batch_reduce_implementation(
                    reduce_op, value_destination_pairs, options)
            finally:
                self.in_batch = False

    return CountingAllReduce()


def run(rec: Recorder, dry_run: bool, budget_s: float) -> None:
    """2 logical devices: accumulation exactness and all-reduces per step."""
    import tensorflow as tf

    gpus = physical_gpus(tf, dry_run)
    # Before anything initialises the devices: this process's first act.
    if gpus:
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(
                memory_limit=LOGICAL_GPU_MIB)] * 2)
        devices = [d.name for d in tf.config.list_logical_devices("GPU")][:2]
    else:
        from keras_mgpu import strategy as strategy_lib

        devices = strategy_lib.configure_virtual_cpus(2)
    import keras
    import numpy as np

    from keras_mgpu import GradientAccumulationModel

    features, hidden = 8, 16
    # tests/test_accumulation.py's optimizers, by the same names.
    optimizers = {
        "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(0.01),
    }

    def build_mlp():
        # tests/workers.py's model, with its deterministic weights.
        model = keras.Sequential([keras.Input((features,)),
                                  keras.layers.Dense(hidden,
                                                     activation="tanh"),
                                  keras.layers.Dense(1)])
        rng = np.random.RandomState(1)
        model.set_weights([0.3 * rng.randn(*w.shape).astype("float32")
                           for w in model.get_weights()])
        return model

    def micro_batches(count, size=8):
        rng = np.random.RandomState(0)
        x = rng.randn(count * size, features).astype("float32")
        w = rng.randn(features, 1).astype("float32")
        y = (np.tanh(x @ w) + 0.1 * rng.randn(count * size, 1)).astype(
            "float32")
        return [(x[i:i + size], y[i:i + size])
                for i in range(0, count * size, size)]

    def dataset(batches):
        # Exactly these batches, in order (tests/test_accumulation.py's
        # batches_dataset).
        out = None
        for batch in batches:
            one = tf.data.Dataset.from_tensors(batch)
            out = one if out is None else out.concatenate(one)
        return out

    def train(strategy, batches, accum_steps=None, optimizer="adam",
              run_eagerly=False):
        with strategy.scope():
            inner = build_mlp()
            model = inner if accum_steps is None else \
                GradientAccumulationModel(inner, accum_steps=accum_steps)
            # jit_compile explicit: "auto" would compile the one-device
            # reference with XLA on a GPU and not the mirrored run.
            model.compile(optimizers[optimizer](), "mse",
                          run_eagerly=run_eagerly, jit_compile=False)
        model.fit(dataset(batches), epochs=1, verbose=0, shuffle=False)
        return model

    def weights(model):
        return [v.numpy() for v in model.trainable_variables]

    def max_diff(a, b):
        return max(float(np.abs(x - y).max()) for x, y in zip(a, b))

    key_base = [60_000]

    def mirrored(counting=None):
        # A collective key base per strategy, as tests/conftest.py gives
        # each: live strategies must not share collective groups.
        key_base[0] += 1000
        cls = type("SuiteMirroredStrategy", (tf.distribute.MirroredStrategy,),
                   {"_collective_key_base": key_base[0]})
        # Not NCCL, TensorFlow's choice on GPUs: it is not made for two
        # logical devices of one GPU. Through one device, as the tests'
        # counter reduces.
        return cls(devices, cross_device_ops=counting
                   or tf.distribute.ReductionToOneDevice())

    rec.results = {"device_kind": "GPU" if gpus else "CPU",
                   "devices": devices,
                   "memory_limit_mib": LOGICAL_GPU_MIB if gpus else None}
    rec.save()

    # Exactness: tests/test_accumulation.py's
    # test_accumulated_step_equals_big_batch_step at 2 replicas.
    micro = micro_batches(24)
    big = [tuple(np.concatenate(parts) for parts in zip(*micro[i:i + 4]))
           for i in range(0, 24, 4)]
    start_weights = weights(build_mlp())
    exact = {"micro_batch": 8, "micro_batches": len(micro),
             "accum_steps": ACCUM_STEPS, "tolerance": EXACTNESS_TOLERANCE,
             "runs": [], "max_abs_weight_diff": None}
    rec.results["exactness"] = exact
    strategy = mirrored()
    default = tf.distribute.get_strategy()
    # On a GPU, float32 matmuls use TensorFloat-32 by default; the claim is
    # about float32 arithmetic, so both settings are measured there.
    tf32_settings = (True, False) if gpus else (None,)
    for tf32 in tf32_settings:
        if tf32 is not None:
            tf.config.experimental.enable_tensor_float_32_execution(tf32)
        for name in EXACTNESS_OPTIMIZERS["dry-run" if dry_run else "gpu"]:
            reference = train(default, big, optimizer=name)
            model = train(strategy, micro, accum_steps=ACCUM_STEPS,
                          optimizer=name)
            exact["runs"].append({
                "optimizer": name, "tensor_float_32": tf32,
                "optimizer_steps": int(model.optimizer.iterations.numpy()),
                "reference_moved": max_diff(weights(reference),
                                            start_weights),
                "max_abs_weight_diff": max_diff(weights(model),
                                                weights(reference))})
            exact["max_abs_weight_diff"] = max(
                r["max_abs_weight_diff"] for r in exact["runs"])
            rec.save()
            print(f"exactness {name} (TF32 {tf32}): max abs weight "
                  f"difference {exact['runs'][-1]['max_abs_weight_diff']:.3g}",
                  flush=True)
    if gpus:
        tf.config.experimental.enable_tensor_float_32_execution(True)

    # All-reduces: tests/test_accumulation.py's
    # test_one_all_reduce_per_optimizer_step, run eagerly: Python then runs
    # every step, so the count is the all-reduces executed. (Its traced
    # variant counts the all-reduces in the step's graph, the same on any
    # device: the test suite checks it.)
    micro = micro_batches(12)
    counts = {"micro_batches": len(micro), "accum_steps": ACCUM_STEPS,
              "executed": {}, "expected": {"per_optimizer_step": 1.0}}
    rec.results["all_reduce"] = counts
    logger = tf.get_logger()
    for name, accum_steps in (("plain", None), ("accumulated", ACCUM_STEPS)):
        ops = _counting_all_reduce(tf, (features, hidden))
        # Eager on purpose: TensorFlow's warning that a mirrored strategy
        # is slow eagerly would fill a failure's stderr tail.
        level = logger.level
        logger.setLevel("ERROR")
        try:
            model = train(mirrored(ops), micro, accum_steps=accum_steps,
                          run_eagerly=True)
        finally:
            logger.setLevel(level)
        steps = int(model.optimizer.iterations.numpy())
        counts["executed"][name] = {
            "all_reduces": ops.calls, "optimizer_steps": steps,
            "per_optimizer_step": ops.calls / steps}
        rec.save()
    print(f"all-reduces run: {counts['executed']}", flush=True)

