"""`keras-mgpu doctor`: what this machine offers for multi-GPU training, and advice.

`collect()` gathers a report (a JSON-ready dict) and `format_report()` renders
it as text. Everything that talks to the machine can be injected, so the GPU
parts are tested on CPU-only machines with recorded `nvidia-smi` output:

- `nvidia_smi_runner(args) -> str | None`: runs `nvidia-smi` with `args` and
  returns its stdout, or `None` when nvidia-smi is missing or fails;
- `tf_devices`: the devices TensorFlow sees, as dicts (see `tf_devices()`);
- `env`: the environment (`TF_CONFIG`, `CUDA_VISIBLE_DEVICES`, ...);
- `jax_devices`: on Keras's JAX backend, the devices JAX sees, named as
  `keras.distribution.list_devices()` names them.

JSON schema (`keras-mgpu doctor --json`), schema id `keras-mgpu-doctor/1`:

    {"schema": "keras-mgpu-doctor/1",
     "ok": bool,                      # no finding of level "error"
     "software": {name: version or "not installed"},
     "keras_backend": str,
     "tensorflow_build": {"cuda": bool, "cuda_version": str|null,
                          "cudnn_version": str|null},
     "env": {"CUDA_VISIBLE_DEVICES": str|null, "KERAS_BACKEND": str|null},
     "devices": [{"name": str, "type": "CPU"|"GPU"|...}],   # TensorFlow's
     "gpus": [{"index": int, "name": str|null, "memory_mib": int|null,
               "compute_capability": [int, int]|null,
               "pci_bus_id": str|null, "visible_to_tensorflow": bool}],
     "nvidia_smi": bool,              # whether nvidia-smi answered
     "interconnect": null | {"gpus": [str], "matrix": [[str]],
                             "kind": "nvlink"|"mixed"|"pcie"|"single",
                             "pcie_links": [str]},
     "cluster": {"tf_config_set": bool, "valid": bool, "error": str|null,
                 "num_workers": int, "task_type": str|null,
                 "task_index": int, "worker_index": int, "is_chief": bool,
                 "cluster": {task_type: [address]}},
     "strategy": {"kind": str|null,   # auto_strategy()'s pick: TensorFlow's
                                      # strategy_kind(), or "data_parallel"
                                      # (keras.distribution, on JAX)
                  "description": str,
                  "processes": int},  # the processes it trains in
     "mixed_precision": {"policy": str, "reason": str},
     "findings": [{"level": "error"|"warning"|"info", "code": str,
                   "message": str, "advice": str}]}
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any, Mapping, Optional, Sequence

from keras_mgpu import backend
from keras_mgpu import mixed_precision
from keras_mgpu import strategy as strategy_lib
# Running and parsing nvidia-smi has its own module; `_doctor.<name>` keeps
# naming it.
from keras_mgpu._doctor_nvidia_smi import PCIE_LINKS  # noqa: F401
from keras_mgpu._doctor_nvidia_smi import QUERY_ARGS
from keras_mgpu._doctor_nvidia_smi import QUERY_ARGS_OLD
from keras_mgpu._doctor_nvidia_smi import QUERY_FIELDS  # noqa: F401
from keras_mgpu._doctor_nvidia_smi import TOPO_ARGS
from keras_mgpu._doctor_nvidia_smi import NvidiaSmiRunner
from keras_mgpu._doctor_nvidia_smi import parse_gpu_query
from keras_mgpu._doctor_nvidia_smi import parse_topology
from keras_mgpu._doctor_nvidia_smi import run_nvidia_smi
from keras_mgpu._version import __version__
from keras_mgpu.cluster.slurm import cluster_task

# Feature (the pip extra of the same name) -> display names it needs; defined
# with the argument parser, which must not import TensorFlow.
from keras_mgpu._args import FEATURES

SCHEMA = "keras-mgpu-doctor/1"

# Display name -> distribution names to try, first installed wins. Never
# imported: importing wandb or TensorBoard plugins is slow and has side effects.
OPTIONAL_PACKAGES = {
    "KerasTuner": ("keras-tuner",),
    "xprof": ("xprof", "tensorboard-plugin-profile"),
    "TensorBoard": ("tensorboard",),
    "wandb": ("wandb",),
}
NOT_INSTALLED = "not installed"


# --- Probing the machine -------------------------------------------------------


def package_version(names: Sequence[str]) -> str:
    """The version of the first installed distribution in `names`, never importing it.

    Example:

    >>> package_version(["surely-not-a-package-xyz"])
    'not installed'
    """
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return NOT_INSTALLED


def tf_devices() -> list[dict[str, Any]]:
    """TensorFlow's physical devices, with name and compute capability of GPUs.

    Lists physical devices only, so it does not initialise TensorFlow's
    runtime (logical CPUs can still be configured afterwards).
    """
    import tensorflow as tf

    devices = []
    for device in tf.config.list_physical_devices():
        entry: dict[str, Any] = {"name": device.name,
                                 "type": device.device_type}
        if device.device_type == "GPU":
            try:
                details = tf.config.experimental.get_device_details(device)
            except Exception:  # noqa: BLE001 - details are best effort
                details = {}
            entry["device_name"] = details.get("device_name")
            cc = details.get("compute_capability")
            entry["compute_capability"] = list(cc) if cc else None
        devices.append(entry)
    return devices


def tf_build() -> dict[str, Any]:
    import tensorflow as tf

    info = tf.sysconfig.get_build_info()
    return {
        "cuda": bool(info.get("is_cuda_build", tf.test.is_built_with_cuda())),
        "cuda_version": info.get("cuda_version"),
        "cudnn_version": info.get("cudnn_version"),
    }


# --- The report ---------------------------------------------------------------


def _finding(level: str, code: str, message: str, advice: str = "") -> dict:
    return {"level": level, "code": code, "message": message, "advice": advice}


def _strategy_description(kind: Optional[str], num_gpus: int,
                          num_workers: int, source: Optional[str]) -> str:
    descriptions: dict[Optional[str], str] = {
        "multi_worker": f"MultiWorkerMirroredStrategy over {num_workers} "
                        "workers (each mirroring over its local GPUs)",
        "mirrored": f"MirroredStrategy over {num_gpus} GPUs with NCCL "
                    "all-reduce",
        "one_device": "OneDeviceStrategy",
        "default": "the default strategy (one device: "
                   + ("GPU:0)" if num_gpus else "the CPU)"),
    }
    return descriptions.get(kind, f"none: fix {_source_name(source)} first")


def _source_name(source: Optional[str]) -> str:
    return "the SLURM step's variables" if source == "SLURM step" else (
        "TF_CONFIG")


def _data_parallel_description(processes, devices: Sequence[str]) -> str:
    """What `auto_strategy()` sets on Keras's JAX backend."""
    here = (f"{len(devices)} device(s)"
            + (f" ({', '.join(devices)})" if len(devices) <= 8 else ""))
    if processes.count == 1:
        return f"keras.distribution.DataParallel over {here}, 1 process"
    return (f"keras.distribution.DataParallel over the devices of "
            f"{processes.count} JAX processes (jax.distributed, coordinator "
            f"{processes.coordinator}; this is process "
            f"{processes.process_id}, with {here})")


def collect(
    *,
    nvidia_smi_runner: Optional[NvidiaSmiRunner] = None,
    devices: Optional[Sequence[Mapping[str, Any]]] = None,
    env: Optional[Mapping[str, str]] = None,
    need: Sequence[str] = (),
    jax_devices: Optional[Sequence[str]] = None,
) -> dict[str, Any]:
    """Collects the doctor's report. Creates no strategy and runs no TF op.

    On Keras's JAX backend it lists JAX's devices (unless given), which
    starts JAX: a program that joins a cluster afterwards
    (`auto_strategy()`) cannot. Run `keras-mgpu doctor` on its own.

    Args:
        nvidia_smi_runner: Defaults to `None`, which runs the real
            `nvidia-smi` when present. A callable taking the argument list
            and returning stdout or `None`.
        devices: Defaults to `None`, TensorFlow's physical devices
            (`tf_devices()`). Dicts with `name`, `type`, and for GPUs
            `device_name` and `compute_capability`.
        env: Defaults to `None`, `os.environ`.
        need: Defaults to `()`. Features (`"tuner"`, `"profile"`, `"wandb"`)
            the user needs: a missing package for one is an error, for the
            others it is only information.
        jax_devices: Defaults to `None`, `keras.distribution.list_devices()`
            on Keras's JAX backend. Device names such as `"gpu:0"`;
            ignored on TensorFlow.

    Returns:
        The report, a JSON-ready dict (schema in the module docstring).

    Example:

    >>> report = collect(nvidia_smi_runner=lambda args: None,
    ...                  devices=[{"name": "/physical_device:CPU:0",
    ...                            "type": "CPU"}], env={})
    >>> report["strategy"]["kind"], [f["code"] for f in report["findings"]][:1]
    ('default', ['no_gpu'])
    """
    import keras
    import tensorflow as tf

    runner = run_nvidia_smi if nvidia_smi_runner is None else nvidia_smi_runner
    on_jax = keras.backend.backend() == "jax"
    if on_jax and jax_devices is None:
        jax_devices = keras.distribution.list_devices()
    env = os.environ if env is None else env
    devices = [dict(d) for d in (tf_devices() if devices is None else devices)]
    unknown = sorted(set(need) - set(FEATURES))
    if unknown:
        raise ValueError(
            f"Unknown feature(s) {unknown} in need; choose from "
            f"{sorted(FEATURES)}."
        )
    findings: list[dict] = []

    software = {
        "Python": platform.python_version(),
        "TensorFlow": tf.__version__,
        "Keras": keras.__version__,
        "keras-mgpu": __version__,
    }
    for display, names in OPTIONAL_PACKAGES.items():
        software[display] = package_version(names)

    # GPUs: TensorFlow's view, completed (memory, bus id) by nvidia-smi's.
    query_text = runner(list(QUERY_ARGS))
    if query_text is None:
        query_text = runner(list(QUERY_ARGS_OLD))
    smi_gpus = parse_gpu_query(query_text) if query_text else []
    topo_text = runner(list(TOPO_ARGS))
    interconnect = None
    if topo_text:
        try:
            interconnect = parse_topology(topo_text)
        except ValueError as e:
            findings.append(_finding(
                "warning", "topology_unreadable", str(e),
                "Run `nvidia-smi topo -m` yourself to see the links."))
    tf_gpus = [d for d in devices if d.get("type") == "GPU"]
    gpus: list[dict[str, Any]] = []
    for i, device in enumerate(tf_gpus):
        smi = smi_gpus[i] if i < len(smi_gpus) else {}
        gpus.append({
            "index": i,
            "name": device.get("device_name") or smi.get("name"),
            "memory_mib": smi.get("memory_mib"),
            "compute_capability": (device.get("compute_capability")
                                   or smi.get("compute_capability")),
            "pci_bus_id": smi.get("pci_bus_id"),
            "visible_to_tensorflow": True,
        })
    for smi in smi_gpus[len(tf_gpus):]:
        gpus.append({**smi, "visible_to_tensorflow": False})

    # The cluster, and what auto_strategy() would pick (the pure selection),
    # from where it reads it: TF_CONFIG, else an `srun` step's variables.
    tf_config = env.get("TF_CONFIG", "")
    source = "TF_CONFIG" if tf_config.strip() else None
    kind, info, error, processes = None, None, None, None
    try:
        task = cluster_task(env)
    except ValueError as e:
        source, error = "SLURM step", e
    else:
        if task is not None:
            tf_config, source = task.tf_config, "SLURM step"
    if error is None:
        try:
            info = strategy_lib.parse_tf_config(tf_config)
        except ValueError as e:
            error = e
    cluster: dict[str, Any] = {"tf_config_set": source is not None,
                               "source": source, "valid": error is None,
                               "error": None if error is None else str(error)}
    if error is not None:
        cluster.update(num_workers=1, task_type=None, task_index=0,
                       worker_index=0, is_chief=True, cluster={})
        findings.append(_finding(
            "error", "tf_config_invalid", f"TF_CONFIG is malformed: {error}",
            "Fix or unset TF_CONFIG: auto_strategy() raises this same error."
        ) if source == "TF_CONFIG" else _finding(
            "error", "slurm_invalid",
            f"The SLURM step's variables place no cluster: {error}",
            "Fix them, or set TF_CONFIG: auto_strategy() raises this same "
            "error."))
    else:
        assert info is not None  # parsed without an error
        cluster.update(num_workers=info.num_workers, task_type=info.task_type,
                       task_index=info.task_index,
                       worker_index=info.worker_index, is_chief=info.is_chief,
                       cluster={k: list(v) for k, v in info.cluster.items()})
        if on_jax:
            try:
                processes = backend.distribution().processes_of(
                    info, "TF_CONFIG" if source == "TF_CONFIG"
                    else "the SLURM step")
            except ValueError as e:
                findings.append(_finding(
                    "error", "jax_task_unsupported", str(e),
                    "auto_strategy() raises this same error."))
            else:
                kind = "data_parallel"
        else:
            kind = strategy_lib.strategy_kind(info, len(tf_gpus), None, None)
        if cluster["tf_config_set"] and info.num_workers == 1:
            findings.append(_finding(
                "info", "tf_config_single_worker",
                "TF_CONFIG is set but names a single training worker, so "
                "auto_strategy() ignores it and trains locally.",
                "Unset TF_CONFIG, or list every worker in cluster.worker."))
    if kind == "data_parallel":
        # Only on JAX, whose devices were listed and processes placed.
        assert jax_devices is not None and processes is not None
        strategy = {"kind": kind,
                    "description": _data_parallel_description(
                        processes, list(jax_devices)),
                    "processes": processes.count}
    else:
        strategy = {"kind": kind,
                    "description": _strategy_description(
                        kind, len(tf_gpus), cluster["num_workers"], source),
                    "processes": (cluster["num_workers"]
                                  if kind == "multi_worker" else 1)}

    ccs = [tuple(g["compute_capability"]) if g["compute_capability"] else None
           for g in gpus if g["visible_to_tensorflow"]]
    policy, reason = mixed_precision.choose_policy(ccs)

    # Findings.
    # On JAX, JAX's devices train; TensorFlow's still feed tf.data.
    jax_accelerators = [d for d in jax_devices or ()
                        if not d.startswith("cpu:")]
    if on_jax and smi_gpus and not jax_accelerators:
        assert jax_devices is not None  # listed above, on JAX
        findings.append(_finding(
            "warning", "gpus_invisible_to_jax",
            f"nvidia-smi lists {len(smi_gpus)} GPU(s) but JAX sees none "
            f"(only {', '.join(jax_devices)})"
            + (f"; CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}"
               if "CUDA_VISIBLE_DEVICES" in env else "") + ".",
            "Install JAX with CUDA (`pip install 'jax[cuda12]'`) and check "
            "CUDA_VISIBLE_DEVICES and the driver version."))
    if not tf_gpus:
        if smi_gpus:
            findings.append(_finding(
                "warning", "gpus_invisible_to_tensorflow",
                f"nvidia-smi lists {len(smi_gpus)} GPU(s) but TensorFlow sees "
                "none" + ("" if tf_build()["cuda"] else
                          " (this TensorFlow is not a CUDA build)")
                + (f"; CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}"
                   if "CUDA_VISIBLE_DEVICES" in env else "") + ".",
                "Install TensorFlow with CUDA (`pip install "
                "'tensorflow[and-cuda]'`) and check CUDA_VISIBLE_DEVICES and "
                "the driver version."))
        elif not jax_accelerators:
            findings.append(_finding(
                "info", "no_gpu",
                "No GPU visible: training runs on the CPU, "
                + (f"{len(jax_devices or ())} replica(s), one per CPU device "
                   "JAX sees." if on_jax else "one replica."),
                "To exercise multi-replica code without GPUs, split the CPU "
                "into logical devices: keras_mgpu.auto_strategy("
                + ("virtual_cpus=N) gives a real DataParallel over N CPU "
                   "devices (call it first in the program, before any JAX "
                   "computation)" if on_jax else
                   "virtual_cpus=N) gives a real MirroredStrategy over N "
                   "logical CPUs (call it first in the program, before any "
                   "TF op)")
                + ". It shows the mechanics, not GPU speed."))
    if interconnect and len(interconnect["gpus"]) >= 4 and (
        interconnect["kind"] == "pcie"
    ):
        findings.append(_finding(
            "warning", "pcie_only",
            f"{len(interconnect['gpus'])} GPUs linked over PCIe only ("
            f"{', '.join(interconnect['pcie_links'])}; no NVLink): NCCL's "
            "ring all-reduce is bound by the slowest PCIe/SMP hop, so scaling "
            "will suffer for large models.",
            "Prefer NVLink machines for many GPUs"
            + (" (on JAX, XLA chooses the all-reduce)." if on_jax else
               ", or use hierarchical all-reduce: keras_mgpu.auto_strategy("
               "cross_device_ops=tf.distribute.HierarchicalCopyAllReduce()); "
               "benchmark both with `keras-mgpu bench`.")
            + " Gradient accumulation (GradientAccumulationModel) also cuts "
            "all-reduces."))
    elif interconnect and interconnect["kind"] == "mixed":
        findings.append(_finding(
            "info", "nvlink_partial",
            "Some GPU pairs use NVLink, others PCIe: all-reduce runs at the "
            "speed of the PCIe hops.",
            "Mirror over a set of GPUs that are all NVLink-connected "
            "(auto_strategy(devices=[...])) if it scales better."))
    if ccs and policy == "float32":
        findings.append(_finding(
            "warning", "mixed_precision_unsupported",
            f"Mixed precision would not help here: {reason}.",
            "Train in float32 (mixed_precision.set_policy('auto') does so); "
            "mixed precision needs compute capability 7.0+ (float16) or 8.0+ "
            "(bfloat16)."))
    elif policy == "mixed_float16":
        findings.append(_finding(
            "info", "mixed_precision_float16",
            f"Mixed precision: {policy} ({reason}).",
            "Use mixed_precision.set_policy('auto') and "
            "keras_mgpu.callbacks.LossScaleMonitor() to watch the loss "
            "scale."))
    elif policy == "mixed_bfloat16":
        findings.append(_finding(
            "info", "mixed_precision_bfloat16",
            f"Mixed precision: {policy} ({reason}).",
            "Use mixed_precision.set_policy('auto')."))
    for feature, displays in FEATURES.items():
        missing = [d for d in displays if software[d] == NOT_INSTALLED]
        if not missing:
            continue
        needed = feature in need
        findings.append(_finding(
            "error" if needed else "info", f"missing_{feature}",
            f"Feature {feature!r} "
            + ("is needed but " if needed else "is unavailable: ")
            + f"{', '.join(missing)} not installed.",
            f"pip install \"keras-mgpu[{feature}]\""))

    return {
        "schema": SCHEMA,
        "ok": not any(f["level"] == "error" for f in findings),
        "software": software,
        "keras_backend": keras.backend.backend(),
        "tensorflow_build": tf_build(),
        "env": {k: env.get(k) for k in ("CUDA_VISIBLE_DEVICES",
                                        "KERAS_BACKEND")},
        "devices": [{"name": d.get("name"), "type": d.get("type")}
                    for d in devices],
        "gpus": gpus,
        "nvidia_smi": bool(query_text or topo_text),
        "interconnect": interconnect,
        "cluster": cluster,
        "strategy": strategy,
        "mixed_precision": {"policy": policy, "reason": reason},
        "findings": findings,
    }


# --- Text output -------------------------------------------------------------


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(str(c).ljust(w) for c, w in zip(r, widths))
            .rstrip() for r in rows]


def format_report(report: Mapping[str, Any]) -> str:
    """Renders a report from `collect()` as readable text."""
    out = ["keras-mgpu doctor", "", "Software"]
    software = dict(report["software"])
    software["Keras"] += f" (backend: {report['keras_backend']})"
    build = report["tensorflow_build"]
    software["TensorFlow"] += (
        f" (CUDA {build['cuda_version']}, cuDNN {build['cudnn_version']})"
        if build["cuda"] else " (CPU-only build)")
    out += _table(list(software.items()))
    out += ["", "Devices (TensorFlow)"]
    out += _table([(d["type"], d["name"]) for d in report["devices"]])
    out += ["", "GPUs" + ("" if report["nvidia_smi"] else
                          " (nvidia-smi not found)")]
    if report["gpus"]:
        rows = [("#", "name", "memory", "compute cap.", "TensorFlow")]
        for g in report["gpus"]:
            cc = g["compute_capability"]
            rows.append((
                str(g["index"]), g["name"] or "?",
                f"{g['memory_mib'] / 1024:.0f} GiB" if g["memory_mib"]
                else "?",
                f"{cc[0]}.{cc[1]}" if cc else "?",
                "visible" if g["visible_to_tensorflow"] else "NOT visible",
            ))
        out += _table(rows)
    else:
        out.append("  none")
    topo = report["interconnect"]
    if topo:
        out += ["", f"Interconnect (nvidia-smi topo -m): {topo['kind']}"]
        out += _table([[""] + topo["gpus"]]
                      + [[g] + row for g, row in zip(topo["gpus"],
                                                     topo["matrix"])])
        out.append("  NV# = # bonded NVLinks; PIX/PXB = PCIe switch; "
                   "PHB = PCIe host bridge; NODE/SYS = across host bridges "
                   "/ CPU sockets")
    cluster = report["cluster"]
    out += ["", f"Cluster ({cluster.get('source') or 'TF_CONFIG'})"]
    if not cluster["tf_config_set"]:
        out.append("  not set, and no SLURM step of 2 or more tasks: a "
                   "single process")
    elif not cluster["valid"]:
        out.append("  INVALID (see findings)")
    else:
        out += _table([
            ("workers", str(cluster["num_workers"])),
            ("this task", f"{cluster['task_type']}:{cluster['task_index']} "
                          f"(rank {cluster['worker_index']}"
                          f"{', chief' if cluster['is_chief'] else ''})"),
        ] + [(k, ", ".join(v)) for k, v in cluster["cluster"].items()])
    out += ["", f"auto_strategy() would pick: "
                f"{report['strategy']['description']}",
            f"Mixed precision ('auto'): {report['mixed_precision']['policy']}"]
    out += ["", "Findings"]
    if not report["findings"]:
        out.append("  none")
    for f in report["findings"]:
        out.append(f"  [{f['level']}] {f['message']}")
        if f["advice"]:
            out.append(f"      -> {f['advice']}")
    return "\n".join(out)
