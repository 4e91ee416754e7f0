"""Distribution facts: which strategy to use, how many replicas, who is chief.

This is the only module of keras-mgpu that reads `TF_CONFIG`. Everything else
asks the functions here.

Worker numbering: a cluster has an optional `"chief"` task and zero or more
`"worker"` tasks. The training workers are numbered chief first, so with a
chief, `chief:0` is worker 0 and `worker:i` is worker `i + 1`; without one,
`worker:i` is worker `i`. The chief is worker 0. Evaluator and parameter
server tasks are not training workers.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import socket
from typing import Any, Mapping, Optional, Sequence

import tensorflow as tf

from keras_mgpu._checks import is_positive_int

_TRAINING_TASK_TYPES = ("chief", "worker")
_KNOWN_TASK_TYPES = ("chief", "worker", "evaluator", "ps")


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """The cluster as `TF_CONFIG` describes it (one process, no cluster if empty).

    Args:
        cluster: Mapping of task type to its list of `"host:port"` addresses.
        task_type: This process's task type, or `None` outside a cluster.
        task_index: This process's index within its task type.
    """

    cluster: Mapping[str, Sequence[str]] = dataclasses.field(
        default_factory=dict
    )
    task_type: Optional[str] = None
    task_index: int = 0

    @property
    def num_workers(self) -> int:
        """Training processes: the chief plus the workers (1 outside a cluster)."""
        count = sum(len(self.cluster.get(t, ())) for t in _TRAINING_TASK_TYPES)
        return max(count, 1)

    @property
    def worker_index(self) -> int:
        """This process's rank among the training workers, chief first."""
        if self.task_type == "worker" and "chief" in self.cluster:
            return self.task_index + len(self.cluster["chief"])
        if self.task_type in _TRAINING_TASK_TYPES:
            return self.task_index
        return 0

    @property
    def is_chief(self) -> bool:
        """Whether this process writes shared output (logs, checkpoints)."""
        if self.task_type is None:
            return True
        if self.task_type == "chief":
            return True
        return (
            self.task_type == "worker"
            and "chief" not in self.cluster
            and self.task_index == 0
        )


def parse_tf_config(value: Optional[str] = None) -> ClusterInfo:
    """Parses and validates a `TF_CONFIG` string.

    Args:
        value: The JSON text. Defaults to `None`, which reads the `TF_CONFIG`
            environment variable; unset or empty means no cluster.

    Returns:
        A `ClusterInfo`.

    Raises:
        ValueError: naming the bad field when the text is malformed.

    Example:

    >>> info = parse_tf_config(
    ...     '{"cluster": {"worker": ["localhost:1", "localhost:2"]},'
    ...     ' "task": {"type": "worker", "index": 1}}')
    >>> (info.num_workers, info.worker_index, info.is_chief)
    (2, 1, False)
    """
    if value is None:
        value = os.environ.get("TF_CONFIG", "")
    if not value.strip():
        return ClusterInfo()
    try:
        config = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"TF_CONFIG is not valid JSON ({e}): {value!r}. Set it to a JSON "
            'object such as {"cluster": {"worker": ["host1:port", '
            '"host2:port"]}, "task": {"type": "worker", "index": 0}}.'
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"TF_CONFIG must be a JSON object, got {type(config).__name__}: "
            f"{value!r}."
        )
    cluster = config.get("cluster", {})
    if not isinstance(cluster, dict):
        raise ValueError(
            f"TF_CONFIG field 'cluster' must map task types to address lists, "
            f"got {cluster!r}."
        )
    for task_type, addresses in cluster.items():
        if task_type not in _KNOWN_TASK_TYPES:
            raise ValueError(
                f"TF_CONFIG field 'cluster' has unknown task type "
                f"{task_type!r}; expected one of {list(_KNOWN_TASK_TYPES)}."
            )
        if not isinstance(addresses, list) or not addresses:
            raise ValueError(
                f"TF_CONFIG field 'cluster.{task_type}' must be a non-empty "
                f"list of 'host:port' strings, got {addresses!r}."
            )
        for address in addresses:
            _check_address(task_type, address)
    seen = {}
    for task_type, addresses in cluster.items():
        for index, address in enumerate(addresses):
            where = f"{task_type}:{index}"
            if address in seen:
                # Two tasks cannot serve on one address: the second one's
                # server fails to bind, or both wait forever for each other.
                raise ValueError(
                    f"TF_CONFIG lists address {address!r} twice ({seen[address]}"
                    f" and {where}); every task needs its own host:port."
                )
            seen[address] = where
    if len(cluster.get("chief", ())) > 1:
        raise ValueError(
            f"TF_CONFIG field 'cluster.chief' lists {len(cluster['chief'])} "
            "addresses; a cluster has at most one chief."
        )
    task = config.get("task")
    if not cluster:
        if task:
            raise ValueError(
                f"TF_CONFIG has 'task' {task!r} but no 'cluster'; add the "
                "cluster's addresses or unset TF_CONFIG."
            )
        return ClusterInfo()
    if not isinstance(task, dict):
        raise ValueError(
            f"TF_CONFIG field 'task' must be an object with 'type' and "
            f"'index', got {task!r}."
        )
    task_type = task.get("type")
    if task_type not in cluster:
        raise ValueError(
            f"TF_CONFIG field 'task.type' is {task_type!r}, which is not a "
            f"task type of the cluster ({sorted(cluster)})."
        )
    task_index = task.get("index", 0)
    if (
        isinstance(task_index, bool)
        or not isinstance(task_index, int)
        or not 0 <= task_index < len(cluster[task_type])
    ):
        raise ValueError(
            f"TF_CONFIG field 'task.index' is {task_index!r}; it must be an "
            f"integer from 0 to {len(cluster[task_type]) - 1} for task type "
            f"{task_type!r}."
        )
    return ClusterInfo(
        cluster={k: tuple(v) for k, v in cluster.items()},
        task_type=task_type,
        task_index=task_index,
    )


def _check_address(task_type: str, address) -> None:
    host, _, port = address.rpartition(":") if isinstance(address, str) else (
        "", "", "")
    if not host or not (port.isascii() and port.isdigit()
                        and 1 <= int(port) <= 65535):
        raise ValueError(
            f"TF_CONFIG field 'cluster.{task_type}' has address {address!r}; "
            "each address must be a 'host:port' string with a port from 1 to "
            "65535, e.g. 'localhost:12345'."
        )


def cluster_info() -> ClusterInfo:
    """Returns this process's `ClusterInfo`, read from `TF_CONFIG`."""
    return parse_tf_config()


def make_tf_config(
    addresses: Sequence[str], index: int, task_type: str = "worker"
) -> str:
    """Builds the `TF_CONFIG` text for one worker of an all-worker cluster.

    Args:
        addresses: `"host:port"` of every worker, in rank order.
        index: This worker's index.
        task_type: Defaults to `"worker"`.

    Example:

    >>> json.loads(make_tf_config(["localhost:1", "localhost:2"], 0))["task"]
    {'type': 'worker', 'index': 0}
    """
    text = json.dumps(
        {
            "cluster": {task_type: list(addresses)},
            "task": {"type": task_type, "index": index},
        }
    )
    parse_tf_config(text)
    return text


def strategy_kind(
    info: ClusterInfo, num_gpus: int, virtual_cpus: Optional[int], devices
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
) -> tf.distribute.Strategy:
    """Picks the `tf.distribute.Strategy` that fits this process.

    | situation | strategy |
    |---|---|
    | `TF_CONFIG` names more than one worker | `MultiWorkerMirroredStrategy` |
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

    Args:
        virtual_cpus: Defaults to `None`. If set, split the host CPU into this
            many logical devices and mirror over them: real multi-replica
            training without GPUs, for trying and testing.
        devices: Defaults to `None`. Device names to mirror over, each a
            device TensorFlow sees in this process (`ValueError` naming
            the missing ones and those that exist otherwise).
        cross_device_ops: Defaults to `None` (NCCL on GPUs, TensorFlow's choice
            otherwise). A `tf.distribute.CrossDeviceOps` for a mirrored
            strategy, e.g. `tf.distribute.HierarchicalCopyAllReduce()` on
            servers without NVLink; or a
            `tf.distribute.experimental.CommunicationOptions` for a
            multi-worker one.
        startup_timeout: Defaults to 300 seconds. How long a worker of a
            multi-worker cluster waits for every other worker to connect
            (TensorFlow alone waits forever, silently). When it runs out,
            a `RuntimeError` names the workers that never connected
            (nothing listening at their `TF_CONFIG` address). `None` waits
            without limit, as TensorFlow does. Ignored without a cluster.

    Returns:
        The strategy. Build and compile models inside `strategy.scope()`.

    Raises:
        ValueError: on a malformed `TF_CONFIG`, conflicting arguments, or
            `devices` naming a device this machine does not have.
        RuntimeError: when TensorFlow already initialised its devices and the
            chosen strategy needs to configure them, or when the workers of
            a cluster did not all connect within `startup_timeout`.

    Example:

    >>> strategy = auto_strategy(virtual_cpus=2)  # doctest: +SKIP
    >>> strategy.num_replicas_in_sync  # doctest: +SKIP
    2
    """
    if startup_timeout is not None and (
            isinstance(startup_timeout, bool)
            or not isinstance(startup_timeout, (int, float))
            or not startup_timeout > 0):
        raise ValueError(
            f"startup_timeout must be a positive number of seconds or None "
            f"(wait without limit), got {startup_timeout!r}."
        )
    from keras_mgpu import compat

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
        raise _startup_error(info, startup_timeout) from None
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(
            "Could not create MultiWorkerMirroredStrategy for worker "
            f"{info.worker_index} of {info.num_workers}: {e}. It must be "
            "created at the start of the program, before any TensorFlow op, "
            "model or other strategy: call keras_mgpu.auto_strategy() first."
        ) from e
    compat.enable_multi_worker_fit()
    return strategy


def _training_addresses(info: ClusterInfo) -> list:
    """(worker rank, "host:port") of every training task, chief first."""
    addresses = [a for t in _TRAINING_TASK_TYPES for a in info.cluster.get(t, ())]
    return list(enumerate(addresses))


def _listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)),
                                      timeout=2):
            return True
    except OSError:
        return False


def _startup_error(info: ClusterInfo, timeout: float) -> RuntimeError:
    missing = [
        f"worker {rank} ({address})"
        for rank, address in _training_addresses(info)
        if rank != info.worker_index and not _listening(address)
    ]
    if missing:
        why = (f"these workers never connected (nothing listens at their "
               f"TF_CONFIG address): {', '.join(missing)}. Start them with "
               "the same TF_CONFIG cluster, or fix the addresses.")
    else:
        why = ("every worker listens at its address, yet the cluster did not "
               "form: check that all workers were started with the same "
               "TF_CONFIG cluster, within startup_timeout of each other.")
    return RuntimeError(
        f"Worker {info.worker_index} of {info.num_workers} waited "
        f"{timeout:g} s for the cluster to start; {why} "
        "auto_strategy(startup_timeout=None) waits without limit."
    )


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


def num_replicas(strategy: Optional[tf.distribute.Strategy] = None) -> int:
    """Replicas training in sync, over all workers.

    Args:
        strategy: Defaults to `None`, the strategy of the current scope;
            outside every scope, `None` raises `ValueError` (TensorFlow
            would report 1 replica whatever strategy the program created).

    Example:

    >>> num_replicas(tf.distribute.get_strategy())
    1
    """
    return int(require_strategy(strategy, "num_replicas()").num_replicas_in_sync)


def global_batch_size(
    per_replica: int, strategy: Optional[tf.distribute.Strategy] = None
) -> int:
    """The batch size to give `fit` so each replica sees `per_replica` samples.

    Args:
        per_replica: Samples per replica per step, a positive integer.
        strategy: Defaults to `None`, the strategy of the current scope;
            outside every scope, `None` raises `ValueError` (TensorFlow
            would report 1 replica whatever strategy the program created).

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
    return per_replica * int(require_strategy(
        strategy, f"global_batch_size({per_replica})").num_replicas_in_sync)


def num_workers() -> int:
    """Training worker processes in the cluster (1 without `TF_CONFIG`)."""
    return cluster_info().num_workers


def worker_index() -> int:
    """This process's worker rank, chief first (0 without `TF_CONFIG`)."""
    return cluster_info().worker_index


def is_chief() -> bool:
    """Whether this process is the chief: the one that writes shared output."""
    return cluster_info().is_chief


def is_multi_worker(strategy: Optional[tf.distribute.Strategy] = None) -> bool:
    """Whether `strategy` spans several worker processes."""
    if strategy is None:
        strategy = tf.distribute.get_strategy()
    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and num_workers() > 1
    )


def local_variable(value, dtype: tf.DType) -> tf.Variable:
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
