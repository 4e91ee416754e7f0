"""Distribution facts: which strategy to use, how many replicas, who is chief.

Everything else in keras-mgpu asks the functions here; they answer through
the Keras backend's module (`keras_mgpu.backend.distribution()`): under
`tf.distribute` on TensorFlow, under `keras.distribution` on JAX. The
cluster itself (`TF_CONFIG`, worker numbering) is read by
`keras_mgpu.cluster`; its public names are re-exported here.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any, ContextManager, Optional, Sequence, Union

import keras
import tensorflow as tf

from keras_mgpu import backend
from keras_mgpu._checks import is_positive_int
from keras_mgpu.cluster.tf_config import _TRAINING_TASK_TYPES
from keras_mgpu.cluster import GRPC_START_FAILED
from keras_mgpu.cluster import ClusterInfo
from keras_mgpu.cluster.tf_config import _startup_error
from keras_mgpu.cluster import cluster_info
from keras_mgpu.cluster import make_tf_config  # noqa: F401
from keras_mgpu.cluster import parse_tf_config  # noqa: F401
from keras_mgpu.cluster.slurm import cluster_task, gpu_share

__all__ = [
    "auto_strategy", "num_replicas", "global_batch_size", "num_workers",
    "worker_index", "is_chief", "is_multi_worker", "strategy_kind",
    "configure_virtual_cpus", "require_strategy", "of_model", "scope_of",
    "current", "restore", "local_variable",
    # keras_mgpu.cluster's, re-exported.
    "ClusterInfo", "cluster_info", "make_tf_config", "parse_tf_config",
    "GRPC_START_FAILED",
]


def strategy_kind(
    info: ClusterInfo, num_gpus: int, virtual_cpus: Optional[int],
    devices: Optional[Sequence[str]]
) -> str:
    """Which strategy `auto_strategy` picks, without creating it.

    Returns one of `"multi_worker"`, `"mirrored"`, `"one_device"` or
    `"default"`: the selection table of `auto_strategy` as a pure function
    (used by `keras-mgpu doctor`).

    Example:

    >>> strategy_kind(ClusterInfo(), num_gpus=4, virtual_cpus=None,
    ...               devices=None)
    'mirrored'
    """
    if info.num_workers > 1:
        if virtual_cpus is not None or devices is not None:
            raise ValueError(
                f"auto_strategy(virtual_cpus={virtual_cpus!r}, "
                f"devices={devices!r}) cannot be combined with a multi-worker "
                f"TF_CONFIG ({info.num_workers} workers): each worker mirrors "
                "over its own local GPUs. Unset TF_CONFIG to mirror over "
                "local devices, or drop these arguments."
            )
        return "multi_worker"
    if virtual_cpus is not None:
        if devices is not None:
            raise ValueError(
                "Pass either `virtual_cpus` or `devices` to auto_strategy(), "
                "not both."
            )
        return "mirrored"
    if devices is not None:
        _check_devices(devices)
        return "mirrored" if len(devices) > 1 else "one_device"
    return "mirrored" if num_gpus >= 2 else "default"


def _check_devices(devices) -> None:
    # A string is a sequence too: "/gpu:0" would mirror over 6 "devices".
    if (isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence)
            or not devices
            or not all(isinstance(d, str) and d for d in devices)):
        raise ValueError(
            f"devices must be a non-empty list of device names such as "
            f"['/gpu:0', '/gpu:1'], got {devices!r}. Leave it None to use "
            "every local GPU."
        )


def _local_place(spec: tf.DeviceSpec):
    # "/gpu:0" and "/job:localhost/replica:0/task:0/device:GPU:0" name the
    # same device of this process.
    if (spec.job in (None, "localhost") and spec.replica in (None, 0)
            and spec.task in (None, 0)):
        return None
    return (spec.job, spec.replica or 0, spec.task or 0)


def _names_device(wanted: tf.DeviceSpec, device: tf.DeviceSpec) -> bool:
    return (
        _local_place(wanted) == _local_place(device)
        and (wanted.device_type or "").upper()
        == (device.device_type or "").upper()
        and wanted.device_index in (None, device.device_index)
    )


def _check_devices_exist(devices) -> None:
    # TensorFlow would place a OneDeviceStrategy on a missing GPU on the CPU
    # instead, without a word.
    existing = [d.name for d in tf.config.list_logical_devices()]
    specs = [tf.DeviceSpec.from_string(name) for name in existing]
    missing = []
    for name in devices:
        try:
            wanted = tf.DeviceSpec.from_string(name)
        except ValueError as e:
            raise ValueError(
                f"auto_strategy(devices={list(devices)!r}): {name!r} is not "
                f"a device name ({e}). Use names such as '/gpu:0' or "
                "'/cpu:0'."
            ) from None
        if not any(_names_device(wanted, spec) for spec in specs):
            missing.append(name)
    if missing:
        raise ValueError(
            f"auto_strategy(devices={list(devices)!r}): this machine has no "
            f"device {', '.join(map(repr, missing))}; TensorFlow sees "
            f"{', '.join(existing)}. Name devices from that list, or leave "
            "devices=None to use every local GPU. (A GPU hidden by "
            "CUDA_VISIBLE_DEVICES, or without a working driver, is not seen.)"
        )


def configure_virtual_cpus(n: int) -> list:
    """Splits the host CPU into `n` logical devices (once per process).

    Must run before TensorFlow initialises its devices, i.e. before the first
    op, model or strategy of the process. If the process already has at least
    `n` logical CPUs, the first `n` are used and nothing changes.

    Args:
        n: Number of logical CPU devices, at least 1.

    Returns:
        The logical device names, e.g. `["/device:CPU:0", "/device:CPU:1"]`.

    Example:

    >>> configure_virtual_cpus(2)  # doctest: +SKIP
    ['/device:CPU:0', '/device:CPU:1']
    """
    if not is_positive_int(n):
        raise ValueError(
            f"virtual_cpus must be a positive integer, got {n!r}."
        )
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu) or ()
    if len(current) < n:
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * n
            )
        except RuntimeError:
            have = len(tf.config.list_logical_devices("CPU"))
            raise RuntimeError(
                f"Cannot split the CPU into {n} logical devices: TensorFlow "
                f"has already initialised its devices ({have} logical CPU(s)). "
                "Call keras_mgpu.auto_strategy(virtual_cpus=...) or "
                "keras_mgpu.strategy.configure_virtual_cpus() at the start of "
                "the program, before creating any model, tensor or strategy."
            ) from None
    return [d.name for d in tf.config.list_logical_devices("CPU")][:n]


def auto_strategy(
    *,
    virtual_cpus: Optional[int] = None,
    devices: Optional[Sequence[str]] = None,
    cross_device_ops: Any = None,
    startup_timeout: Optional[float] = 300.0,
) -> Union[tf.distribute.Strategy, keras.distribution.DataParallel]:
    """Picks the distribution that fits this process, on either backend.

    On Keras's TensorFlow backend it builds a `tf.distribute.Strategy`:

    | situation | strategy |
    |---|---|
    | `TF_CONFIG` names more than one worker | `MultiWorkerMirroredStrategy` |
    | no `TF_CONFIG`, a task of an `srun` step of 2 or more | `MultiWorkerMirroredStrategy` over the step's tasks |
    | `virtual_cpus=N` | `MirroredStrategy` over N logical CPUs |
    | `devices=[...]` | `MirroredStrategy` over them (one: `OneDeviceStrategy`) |
    | 2 or more local GPUs | `MirroredStrategy` with NCCL all-reduce |
    | otherwise | the default strategy (one device) |

    A `MultiWorkerMirroredStrategy` also enables
    `keras_mgpu.compat.enable_multi_worker_fit()`, so that `model.fit` works,
    and every strategy enables `keras_mgpu.compat.enable_multi_step_fit()`,
    so that `compile(steps_per_execution=N)` works on several replicas, and
    `keras_mgpu.compat.enable_exact_clipping()`, so that `clipnorm`,
    `clipvalue` and `global_clipnorm` clip the all-reduced gradient, as on
    one device.

    Under `srun` (a SLURM job step of 2 or more tasks) with no `TF_CONFIG`,
    the step's cluster is read from the `SLURM_*` variables
    (`keras_mgpu.slurm`) and set as this process's `TF_CONFIG`; where the
    tasks on a node see the same GPUs, each takes an equal share of them.

    On Keras's JAX backend it sets (`keras.distribution.set_distribution`)
    and returns a `keras.distribution.DataParallel`:

    | situation | distribution |
    |---|---|
    | `TF_CONFIG` names more than one worker | over every device of one JAX process per worker |
    | no `TF_CONFIG`, a task of an `srun` step of 2 or more | over every device of one JAX process per task |
    | `virtual_cpus=N` | over N CPU devices |
    | `devices=[...]` | over them |
    | otherwise | over every local device |

    A cluster is joined with `jax.distributed.initialize()`, worker 0's
    address serving as the coordinator, each worker's rank (chief first)
    as its process id; where this process joined one already (its own
    `jax.distributed.initialize()` or `keras.distribution.initialize()`),
    the cluster must be the same. Processes that do not share a random
    seed (`keras.utils.set_random_seed`) agree on one, so that they
    initialize the replicated weights alike. In a cluster, each process
    feeds its own part of every global batch: `fit` on NumPy arrays takes
    this process's rows and `batch_size` per process; a `tf.data.Dataset`
    is split among the processes by Keras. The distribution is in effect
    at once (its `scope()`, where code enters it, changes nothing), and
    keras-mgpu's facts (`num_replicas`, `is_chief`, `worker_index`,
    `num_workers`), callbacks and `GradientAccumulationModel` read it.
    Call it first in the program: JAX joins a cluster, and splits its CPU,
    only before its first computation.

    Args:
        virtual_cpus: Defaults to `None`. If set, split the host CPU into this
            many logical devices and mirror over them: real multi-replica
            training without GPUs, for trying and testing.
            On JAX, a `DataParallel` over that many CPU devices
            (`jax_num_cpu_devices`).
        devices: Defaults to `None`. Device names to mirror over, each a
            device TensorFlow sees in this process (`ValueError` naming
            the missing ones and those that exist otherwise). On JAX,
            devices of this process as `keras.distribution.list_devices()`
            names them (`"gpu:0"`), or in TensorFlow's spelling
            (`"/gpu:0"`).
        cross_device_ops: Defaults to `None` (NCCL on GPUs, TensorFlow's choice
            otherwise). A `tf.distribute.CrossDeviceOps` for a mirrored
            strategy, e.g. `tf.distribute.HierarchicalCopyAllReduce()` on
            servers without NVLink; or a
            `tf.distribute.experimental.CommunicationOptions` for a
            multi-worker one. On JAX, where XLA chooses the all-reduce,
            anything but `None` is a `ValueError`.
        startup_timeout: Defaults to 300 seconds. How long a worker of a
            multi-worker cluster waits for every other worker to connect
            (TensorFlow alone waits forever, silently). When it runs out,
            a `RuntimeError` names the workers that never connected
            (nothing listening at their `TF_CONFIG` address). `None` waits
            without limit, as TensorFlow does. Ignored without a cluster.
            On JAX, how long a process waits for the coordinator (worker
            0) to listen, a `RuntimeError` naming its address, and then
            for the cluster to form (JAX ends a process that waits longer
            with its own `DEADLINE_EXCEEDED` message).

    Returns:
        On TensorFlow, the strategy: build and compile models inside
        `strategy.scope()`. On JAX, the `keras.distribution.DataParallel`
        now in effect (`keras.distribution.distribution()`). Both work
        with `num_replicas(...)` and `with ....scope():`, so one program
        runs on either backend.

    Raises:
        ValueError: on a malformed `TF_CONFIG`, conflicting arguments, or
            `devices` naming a device this machine does not have; on JAX,
            also `cross_device_ops`, and a `TF_CONFIG` that makes this
            process an evaluator or parameter server.
        RuntimeError: when TensorFlow already initialised its devices and the
            chosen strategy needs to configure them, or when the workers of
            a cluster did not all connect within `startup_timeout`. On JAX,
            when JAX already ran a computation before it could join the
            cluster or split the CPU, when `jax.distributed` already
            joined another cluster, when a distribution other than this
            `DataParallel` is already set, or when the coordinator cannot
            listen at worker 0's address. The message says what to do
            instead.

    Example:

    >>> strategy = auto_strategy(virtual_cpus=2)  # doctest: +SKIP
    >>> num_replicas(strategy)  # doctest: +SKIP
    2
    >>> with strategy.scope():  # doctest: +SKIP
    ...     model = keras.Sequential([keras.layers.Dense(1)])
    """
    if startup_timeout is not None and (
            isinstance(startup_timeout, bool)
            or not isinstance(startup_timeout, (int, float))
            or not startup_timeout > 0):
        raise ValueError(
            f"startup_timeout must be a positive number of seconds or None "
            f"(wait without limit), got {startup_timeout!r}."
        )
    if keras.backend.backend() != "tensorflow":
        # Keras distributes with keras.distribution there, not tf.distribute;
        # the cluster is read from the same places.
        task = cluster_task()
        info = (cluster_info() if task is None
                else parse_tf_config(task.tf_config))
        return backend.distribution().auto_distribution(
            info, task, virtual_cpus=virtual_cpus, devices=devices,
            cross_device_ops=cross_device_ops,
            startup_timeout=startup_timeout)
    from keras_mgpu import compat

    _use_slurm_step()
    info = cluster_info()
    compat.enable_multi_step_fit()
    compat.enable_exact_clipping()
    num_gpus = len(tf.config.list_physical_devices("GPU"))
    kind = strategy_kind(info, num_gpus, virtual_cpus, devices)
    if kind == "multi_worker":
        return _multi_worker_strategy(info, cross_device_ops, startup_timeout)
    if virtual_cpus is not None:
        devices = configure_virtual_cpus(virtual_cpus)
    elif devices is not None:
        _check_devices_exist(devices)
    if kind == "one_device":
        assert devices is not None  # the one device given
        return tf.distribute.OneDeviceStrategy(devices[0])
    if kind == "default":
        return tf.distribute.get_strategy()
    if (
        cross_device_ops is None
        and devices is None
        and virtual_cpus is None
        and num_gpus >= 2
    ):
        cross_device_ops = tf.distribute.NcclAllReduce()
    _check_cross_device_ops(cross_device_ops, tf.distribute.CrossDeviceOps)
    return tf.distribute.MirroredStrategy(
        devices=devices, cross_device_ops=cross_device_ops
    )


def _use_slurm_step() -> None:
    """Under `srun` without `TF_CONFIG`: the step's cluster becomes this
    process's `TF_CONFIG` (what TensorFlow's resolver and every fact here
    read), and each task on a node takes its share of the node's GPUs."""
    task = cluster_task()
    if task is None:
        return
    os.environ["TF_CONFIG"] = task.tf_config
    if task.gpus_bound:
        return
    gpus = tf.config.list_physical_devices("GPU")
    share = gpu_share(task.local_rank, task.local_tasks, len(gpus))
    if share is not None:
        tf.config.set_visible_devices([gpus[i] for i in share], "GPU")


def _check_cross_device_ops(value, expected_type) -> None:
    if value is not None and not isinstance(value, expected_type):
        raise TypeError(
            f"cross_device_ops={value!r} does not fit this strategy: expected "
            f"a {expected_type.__module__}.{expected_type.__name__}."
        )


def _multi_worker_strategy(info: ClusterInfo, communication_options,
                           startup_timeout: Optional[float]):
    from keras_mgpu import compat

    _check_cross_device_ops(
        communication_options, tf.distribute.experimental.CommunicationOptions
    )
    if startup_timeout is not None and info.task_type in _TRAINING_TASK_TYPES:
        compat.set_cluster_startup_timeout(startup_timeout)
    try:
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=communication_options
        )
    except tf.errors.DeadlineExceededError:
        # Only a startup_timeout makes the cluster's start time out.
        assert startup_timeout is not None
        raise _startup_error(info, startup_timeout) from None
    except tf.errors.UnknownError as e:
        if GRPC_START_FAILED not in str(e):
            raise
        assert info.task_type is not None  # a worker of the cluster
        address = info.cluster[info.task_type][info.task_index]
        # TensorFlow names no address; the port was free when it was
        # picked, and `keras-mgpu launch` restarts on fresh ones.
        raise RuntimeError(
            f"{GRPC_START_FAILED} for worker {info.worker_index} of "
            f"{info.num_workers}: {address} (its TF_CONFIG address) cannot "
            "be listened on; another process holds the port. Free it, or "
            "give this worker another port in TF_CONFIG.") from None
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(
            "Could not create MultiWorkerMirroredStrategy for worker "
            f"{info.worker_index} of {info.num_workers}: {e}. It must be "
            "created at the start of the program, before any TensorFlow op, "
            "model or other strategy: call keras_mgpu.auto_strategy() first."
        ) from e
    compat.enable_multi_worker_fit()
    return strategy


def require_strategy(
    strategy: Optional[tf.distribute.Strategy], call: str
) -> tf.distribute.Strategy:
    """`strategy`, or the current scope's; outside every scope, an error.

    Args:
        strategy: A strategy, or `None` for the current scope's; anything
            else is a `TypeError`.
        call: The caller as the user wrote it, e.g. `"global_batch_size(16)"`,
            named by the error.

    Example:

    >>> require_strategy(None, "f()")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: f() was called outside a strategy scope, ...
    """
    if strategy is not None:
        if not isinstance(strategy, (tf.distribute.Strategy,
                                     tf.compat.v1.distribute.Strategy)):
            raise TypeError(
                f"{call}: strategy must be a tf.distribute.Strategy or None, "
                f"got {strategy!r}. Pass the strategy object (e.g. "
                "keras_mgpu.auto_strategy()'s result, or "
                "tf.distribute.MirroredStrategy()), not its name."
            )
        return strategy
    if not tf.distribute.has_strategy():
        # Outside every scope TensorFlow answers for its default strategy
        # (1 replica), whatever strategy the program created: a script
        # would silently train at a per-replica batch.
        raise ValueError(
            f"{call} was called outside a strategy scope, where TensorFlow "
            "reports 1 replica whatever strategy the program created. Pass "
            "the strategy explicitly (e.g. strategy=keras_mgpu."
            "auto_strategy()'s result, or tf.distribute.get_strategy() for "
            "one device), or call it inside `with strategy.scope():`."
        )
    return tf.distribute.get_strategy()


def num_replicas(strategy: Optional[Any] = None) -> int:
    """Replicas training in sync, over all workers.

    Args:
        strategy: Defaults to `None`, the strategy of the current scope;
            outside every scope, `None` raises `ValueError` (TensorFlow
            would report 1 replica whatever strategy the program created).
            On Keras's JAX backend, a `keras.distribution` distribution
            (`DataParallel` or `ModelParallel`), and `None` is the one set
            with `keras.distribution.set_distribution` (1 replica without
            one): the devices along its batch axis.

    Example:

    >>> num_replicas(tf.distribute.get_strategy())
    1
    """
    return backend.distribution().num_replicas(strategy, "num_replicas()")


def global_batch_size(
    per_replica: int, strategy: Optional[Any] = None
) -> int:
    """The batch size to give `fit` so each replica sees `per_replica` samples.

    Args:
        per_replica: Samples per replica per step, a positive integer.
        strategy: Defaults to `None`, the strategy of the current scope,
            as for `num_replicas`.

    Example:

    >>> global_batch_size(32, tf.distribute.get_strategy())
    32
    """
    if isinstance(per_replica, bool) or not isinstance(per_replica, int):
        raise TypeError(
            f"per_replica must be an int, got {per_replica!r}."
        )
    if per_replica < 1:
        raise ValueError(
            f"per_replica must be at least 1, got {per_replica}."
        )
    return per_replica * backend.distribution().num_replicas(
        strategy, f"global_batch_size({per_replica})")


def num_workers() -> int:
    """Training worker processes: the `TF_CONFIG` cluster's workers (1
    without one); on JAX, `jax.process_count()`."""
    return backend.distribution().num_workers()


def worker_index() -> int:
    """This process's worker rank, chief first (0 without `TF_CONFIG`); on
    JAX, `jax.process_index()`."""
    return backend.distribution().worker_index()


def is_chief() -> bool:
    """Whether this process is the chief: the one that writes shared output
    (on JAX, process 0)."""
    return backend.distribution().is_chief()


def is_multi_worker(strategy: Optional[Any] = None) -> bool:
    """Whether `strategy` (or the one in scope; on JAX, the distribution)
    spans several worker processes."""
    return backend.distribution().is_multi_worker(strategy)


def of_model(model: keras.Model) -> Any:
    """The strategy `model` trains under: its `distribute_strategy` on
    TensorFlow, the distribution set with `keras.distribution` (None on one
    device) on JAX. Give it to `num_replicas` and `global_batch_size`."""
    return backend.distribution().of_model(model)


def scope_of(model: keras.Model) -> ContextManager[Any]:
    """The scope to create or assign `model`'s variables in (the
    strategy's scope; on JAX the distribution's, or none)."""
    return backend.distribution().scope_of(model)


def current() -> Any:
    """The distribution in effect: the current scope's strategy on
    TensorFlow, the one set with `keras.distribution` (or None) on JAX."""
    return backend.distribution().current()


def restore(distribution: Any) -> None:
    """Makes `distribution` (a `current()` value) current again where
    `keras.backend.clear_session()` dropped it: on JAX, KerasTuner's
    clearing before each trial drops the `keras.distribution` setting;
    `tf.distribute` scopes are left alone."""
    backend.distribution().restore(distribution)


def local_variable(value: Any, dtype: tf.DType) -> tf.Variable:
    """A non-trainable variable that is this process's own, even inside a
    strategy scope.

    Scopes are per thread, so it is created on a fresh one: a mirrored copy
    would need a collective to create under MultiWorkerMirroredStrategy,
    and a value only one worker keeps (its own input wait, the chief's
    summary step) must not wait for the others.
    """
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(
            tf.Variable, value, dtype=dtype, trainable=False
        ).result()
