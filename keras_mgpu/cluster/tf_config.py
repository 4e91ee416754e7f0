"""The cluster this process belongs to, as `TF_CONFIG` describes it.

This is the only module of keras-mgpu that reads `TF_CONFIG`. Everything else
asks `keras_mgpu.strategy`, which builds on it.

Worker numbering: a cluster has an optional `"chief"` task and zero or more
`"worker"` tasks. The training workers are numbered chief first, so with a
chief, `chief:0` is worker 0 and `worker:i` is worker `i + 1`; without one,
`worker:i` is worker `i`. The chief is worker 0. Evaluator and parameter
server tasks are not training workers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from typing import Mapping, Optional, Sequence

# TensorFlow's error when a worker cannot listen on its cluster address.
GRPC_START_FAILED = "Could not start gRPC server"
"""TensorFlow's error text when a worker cannot listen on its cluster
address (a port taken): `launch` starts such an attempt again."""

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
    seen: dict[str, str] = {}
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
