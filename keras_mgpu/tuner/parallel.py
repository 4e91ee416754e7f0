"""KerasTuner's parallel search on one host: the plan of the chief's and the
workers' environments, and `launch`, which runs them as processes."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import sys
from typing import Any, Mapping, Optional, Sequence, TextIO, Union

import tensorflow as tf

from keras_mgpu import compat
from keras_mgpu import launcher
from keras_mgpu._checks import is_integer
from keras_mgpu.tuner.options import _positive_int


def plan_workers(
    devices: Sequence[str] = (),
    devices_per_trial: int = 1,
    num_workers: Optional[int] = None,
    *,
    oracle_port: int,
    oracle_ip: str = "127.0.0.1",
) -> list:
    """Plans the environment of the chief and of each tuning worker.

    The chief (first) holds KerasTuner's oracle, sees no GPU, and is told
    the workers' tuner ids (`KERAS_MGPU_TUNER_IDS`), so it waits for each
    of them before it exits. Worker `i` (tuner id `tuner{i}`) gets device
    group `i`: `devices_per_trial` consecutive entries of `devices`, as its
    `CUDA_VISIBLE_DEVICES`.
    Without devices, workers run on the CPU (`CUDA_VISIBLE_DEVICES=-1`).

    Args:
        devices: Defaults to `()`. GPU ids (e.g. `["0", "1", ...]`), one
            per entry, each once.
        devices_per_trial: Defaults to 1. GPUs per trial; must divide
            `len(devices)`.
        num_workers: Defaults to `None`: one per device group (1 without
            devices). Fewer leaves groups unused; more is an error.
        oracle_port: The chief oracle's TCP port, 1 to 65535.
        oracle_ip: Defaults to `"127.0.0.1"`. The chief's host name or IP
            address.

    Returns:
        One environment dict per process, chief first.

    Example:

    >>> envs = plan_workers([str(i) for i in range(8)], 2, oracle_port=8000)
    >>> [(e["KERASTUNER_TUNER_ID"], e["CUDA_VISIBLE_DEVICES"]) for e in envs]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('chief', '-1'), ('tuner0', '0,1'), ('tuner1', '2,3'),
     ('tuner2', '4,5'), ('tuner3', '6,7')]
    """
    devices = _device_ids(devices)
    devices_per_trial = _positive_int("devices_per_trial", devices_per_trial)
    _check_oracle_address(oracle_ip, oracle_port)
    if num_workers is not None:
        num_workers = _positive_int("num_workers", num_workers)
    if devices:
        if len(devices) % devices_per_trial:
            raise ValueError(
                f"devices_per_trial={devices_per_trial} does not divide the "
                f"{len(devices)} devices {devices}: "
                f"{len(devices) % devices_per_trial} would sit idle. Use a "
                f"divisor of {len(devices)}, or pass the devices to use."
            )
        groups = [
            ",".join(devices[i:i + devices_per_trial])
            for i in range(0, len(devices), devices_per_trial)
        ]
        if num_workers is not None:
            if num_workers > len(groups):
                raise ValueError(
                    f"num_workers={num_workers} needs {num_workers} device "
                    f"groups of {devices_per_trial}, but only {len(groups)} "
                    f"fit in {len(devices)} devices."
                )
            groups = groups[:num_workers]
    else:
        groups = ["-1"] * (num_workers or 1)
    common = {
        "KERASTUNER_ORACLE_IP": oracle_ip,
        "KERASTUNER_ORACLE_PORT": str(oracle_port),
        # Trials are independent single-host jobs, not one TF cluster.
        "TF_CONFIG": "{}",
    }
    tuner_ids = [f"tuner{i}" for i in range(len(groups))]
    # The chief waits for each of them (compat.enable_tuner_state_fix).
    envs = [{**common, "KERASTUNER_TUNER_ID": "chief",
             "CUDA_VISIBLE_DEVICES": "-1",
             compat.TUNER_IDS_ENV: ",".join(tuner_ids)}]
    for tuner_id, group in zip(tuner_ids, groups):
        envs.append({**common, "KERASTUNER_TUNER_ID": tuner_id,
                     "CUDA_VISIBLE_DEVICES": group})
    return envs


def _device_ids(devices) -> list:
    """`devices` as `CUDA_VISIBLE_DEVICES` entries, or a `ValueError` naming
    the one that is not a single device id."""
    if isinstance(devices, (str, bytes)):
        raise TypeError(
            f"devices must be a list of GPU ids such as ['0', '1'], got the "
            f"string {devices!r}."
        )
    ids = [str(d) for d in devices]
    for device in ids:
        if not device or any(c == "," or c.isspace() for c in device):
            raise ValueError(
                f"devices must hold one GPU id per entry (an index such as "
                f"'0' or a UUID such as 'GPU-...'), got {device!r} in {ids!r}."
            )
    repeated = sorted({d for d in ids if ids.count(d) > 1})
    if repeated:
        raise ValueError(
            f"devices lists {repeated} more than once ({ids!r}): two trials "
            "would share a GPU. List each GPU once."
        )
    return ids


# A host name (RFC 1123 labels) or an IPv4 address; IPv6 via `ipaddress`.
_HOST_NAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\Z")


def _check_oracle_address(ip, port) -> None:
    """Refuses what would reach KerasTuner's environment unchecked: a port
    that is not a TCP port, a host that is not a host name or address."""
    if not is_integer(port) or not 1 <= port <= 65535:
        raise ValueError(
            f"oracle_port must be a TCP port, an integer from 1 to 65535, "
            f"got {port!r}. keras_mgpu.launcher.free_ports(1)[0] gives a "
            "free one."
        )
    valid = isinstance(ip, str) and bool(_HOST_NAME.match(ip))
    if isinstance(ip, str) and not valid:
        try:
            ipaddress.ip_address(ip)
            valid = True
        except ValueError:
            pass
    if not valid:
        raise ValueError(
            f"oracle_ip must be the chief's host name or IP address, e.g. "
            f"'127.0.0.1' or 'node-0.cluster', got {ip!r}."
        )


def local_gpus() -> list:
    """Ids of this host's GPUs as `CUDA_VISIBLE_DEVICES` would name them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = len(tf.config.list_physical_devices("GPU"))
    if visible is not None and visible.strip() not in ("", "-1"):
        return [d.strip() for d in visible.split(",")][:count]
    return [str(i) for i in range(count)]


def launch(
    target: launcher.Target,
    *,
    devices: Optional[Sequence[str]] = None,
    devices_per_trial: int = 1,
    num_workers: Optional[int] = None,
    kwargs: Optional[Mapping[str, Any]] = None,
    args: Sequence[str] = (),
    timeout: float = 3600.0,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[str] = None,
    kill_when_printed: Optional[str] = None,
    kill_workers: Optional[Sequence[int]] = None,
    echo: Union[bool, TextIO] = True,
) -> list:
    """Runs a tuning program as a chief plus one worker per device group.

    The same `target` runs in every process; KerasTuner's environment
    variables (`KERASTUNER_TUNER_ID`, `KERASTUNER_ORACLE_IP`,
    `KERASTUNER_ORACLE_PORT`) make `tuner.search()` serve the oracle on the
    chief and run trials on the workers. Each worker's
    `CUDA_VISIBLE_DEVICES` is its device group, so `keras_mgpu.auto_strategy()`
    in it mirrors over that group: with 8 GPUs, `devices_per_trial=2` runs 4
    trials of 2 GPUs at a time, `devices_per_trial=1` runs 8 of 1. Waits with
    a timeout and kills every process on any failure
    (`keras_mgpu.launcher.run_local_workers`): the `WorkerError` names the
    process that failed first and how (exit code or signal), and marks the
    others as stopped by the launcher (`WorkerResult.stopped`). Each line a
    process prints is shown as it comes, after its tuner id
    (`[chief] ...`, `[tuner0] ...`).

    Args:
        target: A script path, a `"module:function"` string or a
            module-level function (see `run_local_workers`).
        devices: Defaults to `None`: this host's GPUs (`local_gpus()`).
        devices_per_trial: Defaults to 1.
        num_workers: Defaults to `None`: one per device group (1 on a host
            without GPUs).
        kwargs: Defaults to `None`. Keyword arguments of a function target.
        args: Defaults to `()`. Command-line arguments of a script target.
        timeout: Defaults to 3600. Seconds for the whole search.
        env: Defaults to `None`. Extra environment for every process.
        cwd: Defaults to `None`, the current directory.
        kill_when_printed: Defaults to `None`. See `run_local_workers`.
        kill_workers: Defaults to `None`. Process indices to kill (0 is the
            chief).
        echo: Defaults to `True`: the processes' output goes to
            `sys.stdout` as it comes, each line after its tuner id. `False`
            shows nothing (the output is in the results); a text stream gets
            the lines instead.

    Returns:
        One `keras_mgpu.launcher.WorkerResult` per process, chief first.

    Example:

    >>> launch("tune.py", devices_per_trial=2)  # doctest: +SKIP
    """
    if devices is None:
        devices = local_gpus()
    port = launcher.free_ports(1)[0]
    envs = plan_workers(devices, devices_per_trial, num_workers,
                        oracle_port=port)
    extra = dict(env or {})
    stream: Optional[TextIO]
    if echo is True:
        stream = sys.stdout
    elif echo is False:
        stream = None
    elif not callable(getattr(echo, "write", None)):
        raise TypeError(
            f"echo must be True, False or a text stream (with write), got "
            f"{echo!r}."
        )
    else:
        stream = echo
    return launcher.run_local_workers(
        target, len(envs), kwargs=kwargs, args=args, timeout=timeout,
        env=lambda i: {**extra, **envs[i]}, cwd=cwd,
        kill_when_printed=kill_when_printed, kill_workers=kill_workers,
        kill_signal=signal.SIGKILL, echo=stream,
        labels=[e["KERASTUNER_TUNER_ID"] for e in envs],
    )
