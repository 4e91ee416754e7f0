"""Running and parsing `nvidia-smi` for `keras-mgpu doctor`.

The parsers read recorded output as well as live output, so the doctor's GPU
parts are tested on CPU-only machines.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any, Callable, Optional, Sequence

NvidiaSmiRunner = Callable[[Sequence[str]], Optional[str]]

QUERY_FIELDS = "index,name,memory.total,compute_cap,pci.bus_id"
QUERY_ARGS = (f"--query-gpu={QUERY_FIELDS}", "--format=csv")
# Drivers before R510 do not know `compute_cap`; TensorFlow still reports it.
QUERY_ARGS_OLD = ("--query-gpu=index,name,memory.total,pci.bus_id",
                  "--format=csv")
TOPO_ARGS = ("topo", "-m")

PCIE_LINKS = ("PIX", "PXB", "PHB", "NODE", "SYS", "SOC")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_nvidia_smi(args: Sequence[str], timeout: float = 20.0) -> Optional[str]:
    """Runs `nvidia-smi args`; its stdout, or `None` if missing or failing."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True,
                              timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _cells(line: str) -> list[str]:
    line = _ANSI.sub("", line.rstrip("\n"))
    if "\t" in line:
        return [c.strip() for c in line.split("\t")]
    return line.split()


def parse_topology(text: str) -> Optional[dict[str, Any]]:
    """Parses `nvidia-smi topo -m` into GPU names and the GPU-to-GPU link matrix.

    NIC rows and the affinity columns are ignored.

    Returns:
        `None` when no GPU matrix is found, else `{"gpus": [...], "matrix":
        [[...]], "kind": ..., "pcie_links": [...]}`. `kind` is `"nvlink"`
        (every pair over NVLink), `"mixed"`, `"pcie"` (no NVLink at all) or
        `"single"` (one GPU).

    Example:

    >>> topo = parse_topology("\\tGPU0\\tGPU1\\tCPU Affinity\\n"
    ...                       "GPU0\\t X \\tNV4\\t0-7\\n"
    ...                       "GPU1\\tNV4\\t X \\t0-7\\n")
    >>> topo["matrix"], topo["kind"]
    ([['X', 'NV4'], ['NV4', 'X']], 'nvlink')
    """
    lines = text.splitlines()
    header_at = None
    for i, line in enumerate(lines):
        if "GPU0" in _cells(line) and not _cells(line)[0].startswith("GPU"):
            header_at = i
            break
    if header_at is None:
        return None
    gpus = [c for c in _cells(lines[header_at]) if re.fullmatch(r"GPU\d+", c)]
    matrix: list[list[str]] = []
    for line in lines[header_at + 1:]:
        cells = _cells(line)
        if not cells or not cells[0]:
            if matrix:
                break
            continue
        if not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        row = cells[1:1 + len(gpus)]
        if len(row) < len(gpus):
            raise ValueError(
                f"nvidia-smi topo -m row {cells[0]} has {len(row)} GPU "
                f"columns, expected {len(gpus)}: {line!r}"
            )
        matrix.append(row)
    if len(matrix) != len(gpus):
        raise ValueError(
            f"nvidia-smi topo -m lists {len(gpus)} GPU columns but "
            f"{len(matrix)} GPU rows."
        )
    pairs = [matrix[i][j] for i in range(len(gpus))
             for j in range(len(gpus)) if i != j]
    nvlink = [p for p in pairs if p.startswith("NV")]
    if not pairs:
        kind = "single"
    elif len(nvlink) == len(pairs):
        kind = "nvlink"
    elif nvlink:
        kind = "mixed"
    else:
        kind = "pcie"
    pcie_links = sorted({p for p in pairs if p in PCIE_LINKS})
    return {"gpus": gpus, "matrix": matrix, "kind": kind,
            "pcie_links": pcie_links}


def parse_gpu_query(text: str) -> list[dict[str, Any]]:
    """Parses `nvidia-smi --query-gpu=... --format=csv` (with or without header).

    Without a header the fields are taken to be `QUERY_FIELDS`.

    Example:

    >>> parse_gpu_query("index, name, memory.total [MiB], compute_cap\\n"
    ...                 "0, NVIDIA A100-SXM4-80GB, 81920 MiB, 8.0\\n")
    [{'index': 0, 'name': 'NVIDIA A100-SXM4-80GB', 'memory_mib': 81920, \
'compute_capability': [8, 0], 'pci_bus_id': None}]
    """
    rows = [line for line in text.splitlines() if line.strip()]
    if not rows:
        return []
    fields = QUERY_FIELDS.split(",")
    if rows[0].lstrip().startswith("index"):
        fields = [re.sub(r"\s*\[.*\]$", "", f.strip()) for f in
                  rows[0].split(",")]
        rows = rows[1:]
    gpus: list[dict[str, Any]] = []
    for row in rows:
        values = dict(zip(fields, (v.strip() for v in row.split(","))))
        memory = re.match(r"(\d+)", values.get("memory.total", ""))
        cc = re.fullmatch(r"(\d+)\.(\d+)", values.get("compute_cap", ""))
        index = values.get("index", "")
        gpus.append({
            "index": int(index) if index.isdigit() else len(gpus),
            "name": values.get("name") or None,
            "memory_mib": int(memory.group(1)) if memory else None,
            "compute_capability": ([int(cc.group(1)), int(cc.group(2))]
                                   if cc else None),
            "pci_bus_id": values.get("pci.bus_id") or None,
        })
    return gpus
