"""The cluster of a SLURM job step, read from the `SLURM_*` variables `srun`
sets: what `auto_strategy()` uses when `TF_CONFIG` is not set.

Every task of the step is a worker, numbered by `SLURM_PROCID`. Tasks are
placed on the step's nodes in blocks, in node order (SLURM's default
distribution): the node list and the tasks per node give every worker's
host. Each worker listens on a port derived from the job id and its rank
on its node, so that two jobs sharing a node rarely collide and no port
is fixed (TensorFlow's own `SlurmClusterResolver` uses 8888 and up, and
fails on nodes without GPUs). Standard library only.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
from typing import Mapping, Optional

from keras_mgpu.cluster.tf_config import make_tf_config

# Ports: a block of _PORTS_PER_JOB from _FIRST_PORT, chosen by the job id.
_FIRST_PORT = 20000
_PORTS_PER_JOB = 64
_JOB_BLOCKS = 600  # up to 58399, below the usual ephemeral range


@dataclasses.dataclass(frozen=True)
class SlurmTask:
    """This process as a task of a SLURM job step.

    Args:
        tf_config: The `TF_CONFIG` text of the step's cluster, this task's
            rank as its worker index.
        rank: `SLURM_PROCID`.
        local_rank: `SLURM_LOCALID`, its rank on its node.
        local_tasks: Tasks of the step on its node.
        gpus_bound: Whether SLURM gives each task its own GPUs
            (`--gpus-per-task`): then their sharing is SLURM's.
    """

    tf_config: str
    rank: int
    local_rank: int
    local_tasks: int
    gpus_bound: bool


def slurm_task(environ: Optional[Mapping[str, str]] = None
               ) -> Optional[SlurmTask]:
    """This process's task of a SLURM job step of 2 or more tasks, or None.

    Only a step (`srun`) counts: a batch script's own process (no
    `SLURM_STEP_NUM_TASKS`) is not a worker.

    Args:
        environ: Defaults to `None`, `os.environ`.

    Raises:
        ValueError: naming the variable that cannot be read, or a task
            distribution other than SLURM's block one.

    Example:

    >>> task = slurm_task({
    ...     "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3",
    ...     "SLURM_LOCALID": "1", "SLURM_JOB_ID": "1234",
    ...     "SLURM_STEP_NODELIST": "gpu[07-08]",
    ...     "SLURM_STEP_TASKS_PER_NODE": "2(x2)"})
    >>> import json
    >>> json.loads(task.tf_config)
    {'cluster': {'worker': ['gpu07:22176', 'gpu07:22177', 'gpu08:22176', \
'gpu08:22177']}, 'task': {'type': 'worker', 'index': 3}}
    """
    env = os.environ if environ is None else environ
    if "SLURM_STEP_NUM_TASKS" not in env:
        return None
    tasks = _int(env, "SLURM_STEP_NUM_TASKS")
    if tasks < 2:
        return None
    distribution = env.get("SLURM_DISTRIBUTION", "")
    if distribution and not distribution.startswith("block"):
        raise ValueError(
            f"SLURM_DISTRIBUTION={distribution!r}: keras-mgpu places a "
            "step's tasks on its nodes in blocks (SLURM's default), so it "
            "cannot tell where the other tasks run. Drop --distribution, or "
            "set TF_CONFIG yourself.")
    nodes = expand_hostlist(_get(env, "SLURM_STEP_NODELIST"))
    per_node = expand_tasks_per_node(_get(env, "SLURM_STEP_TASKS_PER_NODE"))
    if len(nodes) != len(per_node) or sum(per_node) != tasks:
        raise ValueError(
            f"SLURM_STEP_NODELIST ({len(nodes)} nodes) and "
            f"SLURM_STEP_TASKS_PER_NODE ({per_node}) do not place "
            f"SLURM_STEP_NUM_TASKS={tasks} tasks.")
    rank = _int(env, "SLURM_PROCID")
    if not 0 <= rank < tasks:
        raise ValueError(f"SLURM_PROCID={rank} is not a task of the "
                         f"{tasks} of the step.")
    port = job_port(_int(env, "SLURM_JOB_ID"))
    addresses, node_of = [], []
    for node, count in zip(nodes, per_node):
        if count > _PORTS_PER_JOB:
            raise ValueError(
                f"{count} tasks on node {node}: keras-mgpu gives a job "
                f"{_PORTS_PER_JOB} ports per node. Run fewer tasks per node "
                "(one per GPU), or set TF_CONFIG yourself.")
        addresses += [f"{node}:{port + i}" for i in range(count)]
        node_of += [count] * count
    return SlurmTask(
        tf_config=make_tf_config(addresses, rank), rank=rank,
        local_rank=_int(env, "SLURM_LOCALID"), local_tasks=node_of[rank],
        gpus_bound="SLURM_GPUS_PER_TASK" in env)


def cluster_task(environ: Optional[Mapping[str, str]] = None
                 ) -> Optional[SlurmTask]:
    """The SLURM step's task `auto_strategy()` builds the cluster from:
    `slurm_task()` where `TF_CONFIG` is not set (it comes first), else
    None.

    Raises:
        ValueError: as `slurm_task`.
    """
    env = os.environ if environ is None else environ
    if env.get("TF_CONFIG", "").strip():
        return None
    return slurm_task(env)


def job_port(job_id: int) -> int:
    """The first port of a job's block (a task's is this plus its rank on
    its node)."""
    return _FIRST_PORT + (job_id % _JOB_BLOCKS) * _PORTS_PER_JOB


def gpu_share(local_rank: int, local_tasks: int, num_gpus: int
              ) -> Optional[range]:
    """Which of its node's `num_gpus` GPUs a task uses: an equal, disjoint
    share per task on the node; None where there is nothing to split (no
    GPUs, or one task).

    Raises:
        ValueError: the GPUs cannot be split equally among the tasks.

    Example:

    >>> gpu_share(1, 4, 8)
    range(2, 4)
    """
    if num_gpus == 0 or local_tasks == 1:
        return None
    if num_gpus % local_tasks:
        raise ValueError(
            f"{local_tasks} tasks of this SLURM step share this node's "
            f"{num_gpus} GPUs, which do not split equally among them. Run "
            "one task per GPU (--ntasks-per-node equal to the GPUs), or "
            "give each its own with --gpus-per-task.")
    share = num_gpus // local_tasks
    return range(local_rank * share, (local_rank + 1) * share)


def expand_hostlist(text: str) -> list:
    """SLURM's compressed host list as host names, in order.

    The hosts are counted before they are expanded: a list of more than
    `MAX_HOSTS` is refused, as is any malformed range, by name.

    Raises:
        ValueError: naming the malformed part, or the count over the limit.

    Example:

    >>> expand_hostlist("gpu[01-02,07],login,rack[1-2]-n[1-2]")
    ['gpu01', 'gpu02', 'gpu07', 'login', 'rack1-n1', 'rack1-n2', \
'rack2-n1', 'rack2-n2']
    """
    items = [_parse_item(item, text) for item in _top_level_items(text)]
    count = sum(math.prod(getattr(choices, "size", 1) for choices in item)
                for item in items)
    _check_count(count, "hosts", f"SLURM_STEP_NODELIST={text!r}")
    return ["".join(parts) for item in items
            for parts in itertools.product(*item)]


def expand_tasks_per_node(text: str) -> list:
    """`SLURM_STEP_TASKS_PER_NODE` (`"2(x3),1"`) as one count per node,
    counted before it is expanded (at most `MAX_HOSTS` nodes).

    Example:

    >>> expand_tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
    """
    runs = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise ValueError(
                f"SLURM_STEP_TASKS_PER_NODE={text!r}: {item!r} is not a "
                "count such as 2 or 2(x3).")
        runs.append((int(match.group(1)), int(match.group(2) or 1)))
    _check_count(sum(repeat for _, repeat in runs), "nodes",
                 f"SLURM_STEP_TASKS_PER_NODE={text!r}")
    return [count for count, repeat in runs for _ in range(repeat)]


# More nodes than any SLURM cluster has; a list longer than this is a
# corrupt variable, which expanded would exhaust memory.
MAX_HOSTS = 65536
"""The most nodes a SLURM host list may expand to; a longer one is refused
as corrupt."""


def _check_count(count: int, what: str, where: str) -> None:
    if count > MAX_HOSTS:
        raise ValueError(
            f"{where} names {count} {what}, more than the {MAX_HOSTS} "
            "keras-mgpu accepts: check the variable, or set TF_CONFIG "
            "yourself.")


def _top_level_items(text: str) -> list:
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            break  # a "]" before its "[", or brackets inside brackets
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    if depth or any(not item.strip() for item in items):
        raise ValueError(f"SLURM_STEP_NODELIST={text!r} is not a host list "
                         "such as node[01-04],login.")
    return [item.strip() for item in items]


def _parse_item(item: str, text: str) -> list:
    """One host pattern as its parts' choices, unexpanded: a literal is
    one choice, a bracket a `range` of numbers (formatted lazily)."""
    parts, end = [], 0
    for match in re.finditer(r"\[([^\[\]]*)\]|[^\[\]]+", item):
        if match.start() != end:
            break
        end = match.end()
        body = match.group(1)
        parts.append([match.group(0)] if body is None
                     else _Numbers(body, item, text))
    if end != len(item):
        raise ValueError(f"SLURM_STEP_NODELIST={text!r}: {item!r} is not a "
                         "host pattern such as node[01-04].")
    return parts


class _Numbers:
    """A bracket's numbers (`01-04,07`), zero-padded as written."""

    def __init__(self, body: str, item: str, text: str):
        self._ranges: list[tuple[int, int, int]] = []
        for part in body.split(","):
            match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
            if match is not None:
                low = int(match.group(1))
                high = int(match.group(2) or low)
            if match is None or high < low:
                raise ValueError(
                    f"SLURM_STEP_NODELIST={text!r}: [{part}] in {item!r} is "
                    "not a number or an ascending range such as 01-04.")
            self._ranges.append((low, high, len(match.group(1))))

    @property
    def size(self) -> int:
        # Not `__len__`, which cannot return more than `sys.maxsize`.
        return sum(high - low + 1 for low, high, _ in self._ranges)

    def __iter__(self):
        for low, high, width in self._ranges:
            for n in range(low, high + 1):
                yield str(n).zfill(width)


def _get(env: Mapping[str, str], name: str) -> str:
    value = env.get(name)
    if not value:
        raise ValueError(f"{name} is not set: keras-mgpu reads a SLURM "
                         "step's cluster from the variables srun sets.")
    return value


def _int(env: Mapping[str, str], name: str) -> int:
    value = _get(env, name)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer.") from None
