"""`keras_mgpu.auto_strategy()` on Keras's JAX backend: a `DataParallel`
over every device, of every process of the cluster `TF_CONFIG` or a SLURM
step describes, joined with `jax.distributed` first."""

from __future__ import annotations

import math
import random
import socket
import time
from typing import Any, NamedTuple, Optional, Sequence

import jax
import keras
import numpy as np
from jax.experimental import multihost_utils

from keras_mgpu import strategy as strategy_lib
from keras_mgpu._checks import is_positive_int
from keras_mgpu.cluster import ClusterInfo
from keras_mgpu.cluster.slurm import SlurmTask
from keras_mgpu.cluster.slurm import gpu_share
from keras_mgpu.cluster.tf_config import _TRAINING_TASK_TYPES
from keras_mgpu.cluster.tf_config import _listening
from keras_mgpu.cluster.tf_config import _training_addresses


# JAX takes its init timeout in whole seconds; "no limit" is the largest
# that its coordination client accepts.
_NO_TIMEOUT = 2**31 - 1


class Processes(NamedTuple):
    """The `jax.distributed` cluster `auto_strategy()` joins: how many
    processes, this one's id (its worker rank, chief first), and the
    coordinator's `"host:port"` (worker 0's cluster address; None for one
    process)."""

    # Shadows tuple.count, the field's public name.
    count: int  # type: ignore[assignment]
    process_id: int
    coordinator: Optional[str]


def processes_of(info: ClusterInfo, source: str = "TF_CONFIG") -> Processes:
    """The JAX processes `auto_strategy()` makes of the cluster `info`
    describes: one per training worker, worker 0 the coordinator. A
    cluster of one worker (or none) is a single process.

    Args:
        info: The cluster, as `keras_mgpu.cluster.parse_tf_config` reads it.
        source: Where `info` came from, for the error (`"TF_CONFIG"` or
            `"the SLURM step"`).

    Raises:
        ValueError: `info` makes this process an evaluator or parameter
            server, which `jax.distributed` has no place for.

    Example:

    >>> from keras_mgpu.cluster import parse_tf_config
    >>> processes_of(parse_tf_config(
    ...     '{"cluster": {"chief": ["h0:7"], "worker": ["h1:7"]},'
    ...     ' "task": {"type": "worker", "index": 0}}'))
    Processes(count=2, process_id=1, coordinator='h0:7')
    """
    if info.num_workers < 2:
        return Processes(1, 0, None)
    if info.task_type not in _TRAINING_TASK_TYPES:
        raise ValueError(
            f"{source} makes this process the cluster's "
            f"{info.task_type!r} task, but on Keras's JAX backend every "
            "process of a cluster trains (jax.distributed has no evaluator "
            "or parameter-server tasks). Run it without TF_CONFIG, where "
            "auto_strategy() uses its local devices, or set "
            "KERAS_BACKEND=tensorflow.")
    return Processes(info.num_workers, info.worker_index,
                     _training_addresses(info)[0][1])


def auto_distribution(
    info: ClusterInfo,
    task: Optional[SlurmTask],
    *,
    virtual_cpus: Optional[int],
    devices: Optional[Sequence[str]],
    cross_device_ops: Any,
    startup_timeout: Optional[float],
) -> keras.distribution.DataParallel:
    """`keras_mgpu.auto_strategy()` on Keras's JAX backend: joins the
    cluster `info` describes (`task`: the SLURM step's, where it came from
    one) with `jax.distributed`, then sets and returns a `DataParallel`
    over every device of every process (or over `devices`, or
    `virtual_cpus` CPU devices, in one process). Its arguments are
    `auto_strategy()`'s."""
    if cross_device_ops is not None:
        raise ValueError(
            f"auto_strategy(cross_device_ops={cross_device_ops!r}): on "
            "Keras's JAX backend XLA chooses how devices all-reduce, so "
            "there is nothing to pass it to. Leave it None, or set "
            "KERAS_BACKEND=tensorflow to use tf.distribute's.")
    # The argument checks TensorFlow's selection makes, worded alike.
    strategy_lib.strategy_kind(info, 0, virtual_cpus, devices)
    source = "TF_CONFIG" if task is None else "the SLURM step"
    cluster = processes_of(info, source)
    if cluster.count > 1:
        _join(cluster, task, source, startup_timeout)
    elif (virtual_cpus is not None or devices is not None) and (
            # Asked only where it can be more than 1: asking starts JAX.
            jax.distributed.is_initialized() and jax.process_count() > 1):
        raise ValueError(
            f"auto_strategy(virtual_cpus={virtual_cpus!r}, "
            f"devices={devices!r}) picks devices of this process, but it "
            f"is one of {jax.process_count()} JAX processes, which train "
            "over all their devices together. Drop these arguments.")
    names = _device_names(virtual_cpus, devices)
    current = keras.distribution.distribution()
    if current is not None:
        if (isinstance(current, keras.distribution.DataParallel)
                and _mesh_names(current) == names):
            return current
        raise RuntimeError(
            f"auto_strategy() would set a DataParallel over "
            f"{_describe(names)}, but keras.distribution already has "
            f"{_describe_distribution(current)} set. Keep training under "
            "that one (keras_mgpu reads it from "
            "keras.distribution.distribution(); skip auto_strategy()), or "
            "unset it first: keras.distribution.set_distribution(None).")
    if jax.process_count() > 1:
        _agree_on_seed()
    distribution = keras.distribution.DataParallel(devices=names)
    keras.distribution.set_distribution(distribution)
    return distribution


def _join(cluster: Processes, task: Optional[SlurmTask], source: str,
          startup_timeout: Optional[float]) -> None:
    """Joins `cluster` with `jax.distributed`, or checks that this process
    already did (a second `auto_strategy()`, or the user's own call)."""
    where = (f"process {cluster.process_id} of {cluster.count} "
             f"(from {source})")
    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) != (
                cluster.count, cluster.process_id):
            raise RuntimeError(
                f"jax.distributed is already initialized, as process "
                f"{jax.process_index()} of {jax.process_count()}, but "
                f"auto_strategy() would make this {where}: a process "
                "cannot leave its cluster. Drop the earlier "
                "jax.distributed.initialize() (or "
                "keras.distribution.initialize()) and let auto_strategy() "
                f"join, or make {source} describe the cluster it joined; "
                "or skip auto_strategy() and set "
                "keras.distribution.set_distribution("
                "keras.distribution.DataParallel()) yourself.")
        return
    deadline = (None if startup_timeout is None
                else time.monotonic() + startup_timeout)
    # JAX would end the process (SIGABRT when the coordinator never
    # answers, often SIGSEGV when its port is taken), naming no address:
    # both are checked here first.
    if cluster.process_id == 0:
        _check_coordinator_port(cluster, where, source)
    else:
        _wait_for_coordinator(cluster, source, startup_timeout, deadline)
    timeout = (_NO_TIMEOUT if deadline is None
               else max(1, math.ceil(deadline - time.monotonic())))
    local_device_ids, detection = _local_devices(task)
    try:
        jax.distributed.initialize(
            coordinator_address=cluster.coordinator,
            num_processes=cluster.count, process_id=cluster.process_id,
            local_device_ids=local_device_ids,
            cluster_detection_method=detection,
            initialization_timeout=timeout)
    except RuntimeError as e:
        if "before any JAX calls" in str(e):
            raise RuntimeError(
                f"auto_strategy() must join the cluster of {source} as "
                f"{where} before JAX starts its devices, and this process "
                "already ran JAX (a computation, jax.devices(), a model or "
                "a keras.distribution distribution). Call "
                "keras_mgpu.auto_strategy() first in the program.") from None
        if "Failed to start RPC server" in str(e):
            raise _port_taken(cluster, where, source) from None
        raise


def _check_coordinator_port(cluster: Processes, where: str,
                            source: str) -> None:
    # The coordinator listens on every address at the port, as this
    # socket tries to (SO_REUSEADDR, as gRPC: only a listener is in the
    # way, not a connection closing).
    # Joined clusters have several processes, so a coordinator.
    assert cluster.coordinator is not None
    port = int(cluster.coordinator.rpartition(":")[2])
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            raise _port_taken(cluster, where, source) from None


def _port_taken(cluster: Processes, where: str, source: str) -> RuntimeError:
    return RuntimeError(
        f"auto_strategy(): {where} serves jax.distributed's coordinator at "
        f"{cluster.coordinator} (worker 0's address in {source}), but that "
        "port cannot be listened on; another process holds it. Free it, or "
        "give worker 0 another port.")


def _wait_for_coordinator(cluster: Processes, source: str,
                          startup_timeout: Optional[float],
                          deadline: Optional[float]) -> None:
    # Joined clusters have several processes, so a coordinator.
    assert cluster.coordinator is not None
    while not _listening(cluster.coordinator):
        if deadline is not None and time.monotonic() >= deadline:
            raise RuntimeError(
                f"Process {cluster.process_id} of {cluster.count} waited "
                f"{startup_timeout:g} s for jax.distributed's coordinator "
                f"at {cluster.coordinator} (worker 0's address in "
                f"{source}); nothing listens there. Start worker 0 with "
                "the same cluster, or fix its address. "
                "auto_strategy(startup_timeout=None) waits without limit.")
        time.sleep(0.2)


def _local_devices(task: Optional[SlurmTask]) -> tuple:
    """`jax.distributed.initialize`'s `local_device_ids` and
    `cluster_detection_method` for this process: every device it sees,
    except where the tasks of a SLURM step on a node see the same GPUs.
    There each takes an equal share of those TensorFlow counts (JAX cannot
    count them before it joins), as on TensorFlow; where TensorFlow sees
    none, JAX's own choice under SLURM, one GPU per task."""
    if task is None or task.gpus_bound or task.local_tasks == 1:
        # Else JAX reads the SLURM variables and narrows to one GPU.
        return None, "deactivate"
    import tensorflow as tf

    share = gpu_share(task.local_rank, task.local_tasks,
                      len(tf.config.list_physical_devices("GPU")))
    if share is None:
        return None, None
    return list(share), "deactivate"


def _device_names(virtual_cpus: Optional[int],
                  devices: Optional[Sequence[str]]) -> list:
    """Names (`"cpu:0"`, as `keras.distribution.list_devices()` gives
    them) of the devices the distribution spans."""
    if virtual_cpus is not None:
        return _cpu_devices(virtual_cpus)
    available = keras.distribution.list_devices()
    if devices is None:
        return available
    if "cpu:0" not in available:
        available += keras.distribution.list_devices("cpu")
    names = [_device_name(name, devices) for name in devices]
    missing = [name for name, key in zip(devices, names)
               if key not in available]
    if missing:
        raise ValueError(
            f"auto_strategy(devices={list(devices)!r}): JAX has no device "
            f"{', '.join(map(repr, missing))}; it sees "
            f"{', '.join(available)}. Name devices from that list, or "
            "leave devices=None to use every device.")
    if len(set(names)) != len(names):
        raise ValueError(
            f"auto_strategy(devices={list(devices)!r}) names a device "
            "twice; name each once.")
    return names


def _device_name(name: str, devices: Sequence[str]) -> str:
    # TensorFlow's spellings ("/gpu:0", "/device:GPU:0") too, so that one
    # call works on both backends.
    if name.startswith("/"):
        import tensorflow as tf

        try:
            spec = tf.DeviceSpec.from_string(name)
        except ValueError as e:
            spec, error = None, e
        if spec is not None and spec.device_type and spec.task in (None, 0):
            return f"{spec.device_type.lower()}:{spec.device_index or 0}"
        raise ValueError(
            f"auto_strategy(devices={list(devices)!r}): {name!r} does not "
            "name a device of this process"
            + (f" ({error})" if spec is None else "")
            + ". Use names such as 'gpu:0' or '/gpu:0'.")
    kind, _, index = name.partition(":")
    # Keras reads a name without an index as device 0.
    index = index or "0"
    return f"{kind.lower()}:{int(index) if index.isdigit() else index}"


def _cpu_devices(n: int) -> list:
    if not is_positive_int(n):
        raise ValueError(
            f"virtual_cpus must be a positive integer, got {n!r}.")
    try:
        # JAX's counterpart of splitting TensorFlow's CPU into logical
        # devices; it too must come before the first computation.
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # JAX already started: its CPU devices are what there is.
    names = keras.distribution.list_devices("cpu")
    if len(names) < n:
        raise RuntimeError(
            f"Cannot split the CPU into {n} devices: JAX has already "
            f"started its devices ({len(names)} CPU device(s)). Call "
            "keras_mgpu.auto_strategy(virtual_cpus=...) at the start of the "
            "program, before any JAX computation or model, or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n}.")
    return names[:n]


def _mesh_names(distribution) -> list:
    return [d if isinstance(d, str) else f"{d.platform}:{d.id}"
            for d in distribution.device_mesh.devices.flatten().tolist()]


def _describe(names: Sequence[str]) -> str:
    return (f"{len(names)} device(s) ({', '.join(names[:4])}"
            + (", ..." if len(names) > 4 else "") + ")")


def _describe_distribution(distribution) -> str:
    return (f"a {type(distribution).__name__} over "
            f"{_describe(_mesh_names(distribution))}")


def _agree_on_seed() -> None:
    """Gives every process one random seed unless they share one already.

    Each process initializes the replicated variables on its own devices
    from its own random stream; JAX refuses values that differ among the
    processes (`device_put`: "not the same on each process"), so without
    one seed an unseeded model cannot even be built.
    `keras.distribution.initialize` agrees a seed likewise where none was
    set. A seed set with
    `keras.utils.set_random_seed` seeds Python's `random` alike in every
    process: their next draws (taken without consuming them) then match,
    and the user's seed stays.
    """
    state = random.getstate()
    draw = random.randint(1, 2**31 - 1)
    random.setstate(state)
    draws = np.asarray(multihost_utils.process_allgather(
        np.asarray(draw, np.int64))).reshape(-1)
    if len(set(draws.tolist())) > 1:
        keras.utils.set_random_seed(int(draws[0]))
