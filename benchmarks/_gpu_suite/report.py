"""The suite's Markdown report (gpu_suite.md), from the JSON payload.

Standard library only, like everything the suite's parent process imports.
"""

from . import ACCUM_STEPS


def fmt_s(seconds: float) -> str:
    """Seconds for people: 450, 22.5, 0.0025."""
    return format(max(seconds, 0.0), ".3g")


def mib(value) -> str:
    """Bytes as whole MiB, or n/a."""
    return "n/a" if value is None else f"{value / 2**20:,.0f}"


def _cell(value, spec: str = "", missing: str = "n/a") -> str:
    if value is None:
        return missing
    if isinstance(value, float) and spec:
        return format(value, spec)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: list, rows: list) -> list:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def _md_machine(results: dict) -> list:
    report = results.get("doctor") or {}
    lines = [f"Driver: {results.get('driver_version') or 'n/a'}"
             + (f" ({results['driver_reason']})"
                if results.get("driver_reason") else ""), ""]
    gpus = report.get("gpus") or []
    if gpus:
        lines += _table(["index", "GPU", "memory MiB", "compute capability",
                         "PCI bus", "visible to TensorFlow"],
                        [[_cell(g.get("index")), _cell(g.get("name")),
                          _cell(g.get("memory_mib")),
                          _cell(".".join(map(str, g["compute_capability"]))
                                if g.get("compute_capability") else None),
                          _cell(g.get("pci_bus_id")),
                          _cell(g.get("visible_to_tensorflow"))]
                         for g in gpus])
    topo = report.get("interconnect")
    if topo:
        lines += [f"Interconnect: {topo.get('kind')}", ""]
        lines += _table([""] + list(topo.get("gpus", [])),
                        [[_cell(gpu)] + [_cell(c) for c in row] for gpu, row
                         in zip(topo.get("gpus", []), topo.get("matrix", []))])
    for finding in report.get("findings", []):
        lines.append(f"- {finding.get('level')}: {finding.get('message')}")
    return lines + [""]


def _md_gpu_tests(results: dict) -> list:
    lines = [f"`{' '.join(results.get('command', []))}`", ""]
    if results.get("mode") == "collect-only":
        lines += [f"Collected only (dry run): {results.get('collected')} "
                  "tests marked gpu.", ""]
    else:
        lines += _table(["collected", "passed", "failed", "skipped",
                         "errors", "pytest s"],
                        [[_cell(results.get(k), ".1f") for k in
                          ("collected", "passed", "failed", "skipped",
                           "errors", "duration_s")]])
    for failure in results.get("failures", []):
        lines.append(f"- FAILED `{failure['test']}`: "
                     f"{_cell(failure['message'])}")
    return lines + [""]


def _md_resnet(results: dict) -> list:
    lines = [f"{results.get('model')} ({results.get('model_params', 0):,} "
             f"parameters); trained: {results.get('trained')} "
             f"({results.get('trained_params', 0):,} parameters), image "
             f"{results.get('image_size')}, batch {results.get('batch_size')}"
             f", {results.get('steps')} steps x {results.get('repeats')} "
             f"timed epochs (median) after {results.get('warmup_steps')} "
             f"warm-up steps, on {results.get('device')}; TensorFloat-32: "
             f"{_cell(results.get('tensor_float_32'))}.", ""]
    lines += _table(
        ["policy", "jit_compile", "examples/s", "x float32", "peak MiB",
         "memory x float32", "status"],
        [[_cell(c["policy"]), _cell(c["jit_compile"]),
          _cell(c.get("examples_per_s"), ",.1f"),
          _cell(c.get("speedup"), ".2f"), mib(c.get("peak_memory_bytes")),
          _cell(c.get("memory_ratio"), ".2f"),
          _cell(c["status"] + (f": {c['error']}" if c.get("error")
                               else ""))]
         for c in results.get("configs", [])])
    if results.get("memory_reason"):
        lines += [f"Peak memory n/a: {results['memory_reason']}.", ""]
    return lines


def _md_logical(results: dict) -> list:
    lines = [f"{len(results.get('devices', []))} logical "
             f"{results.get('device_kind')} devices: "
             f"{', '.join(results.get('devices', []))}"
             + (f", {results['memory_limit_mib']} MiB each"
                if results.get("memory_limit_mib") else "") + ".", ""]
    exact = results.get("exactness") or {}
    if exact:
        lines += [f"Exactness: {exact.get('micro_batches')} micro-batches of "
                  f"{exact.get('micro_batch')}, accum_steps="
                  f"{exact.get('accum_steps')} on 2 replicas, against the "
                  f"big-batch step on one device (tolerance "
                  f"{exact.get('tolerance')}).", ""]
        lines += _table(["optimizer", "TensorFloat-32", "optimizer steps",
                         "reference moved", "max abs weight diff"],
                        [[_cell(r["optimizer"]),
                          _cell(r["tensor_float_32"]),
                          _cell(r["optimizer_steps"]),
                          _cell(r["reference_moved"], ".3g"),
                          _cell(r["max_abs_weight_diff"], ".3g")]
                         for r in exact.get("runs", [])])
    counts = results.get("all_reduce") or {}
    if counts:
        executed = counts.get("executed", {})
        lines += [f"All-reduces run (eagerly) over "
                  f"{counts.get('micro_batches')} micro-batches "
                  f"(accum_steps={counts.get('accum_steps')}); expected: 1 "
                  "per optimizer step.", ""]
        lines += _table(["", "all-reduces run", "optimizer steps",
                         "per optimizer step"],
                        [[name, _cell(row.get("all_reduces")),
                          _cell(row.get("optimizer_steps")),
                          _cell(row.get("per_optimizer_step"), ".2f")]
                         for name, row in executed.items()])
    return lines


def _md_overheads(results: dict) -> list:
    lines = [f"{results.get('model')} ({results.get('params', 0):,} "
             f"parameters), batch {results.get('batch_size')}, "
             f"{results.get('steps_per_epoch')} steps per epoch (in-step "
             f"mode: one per {ACCUM_STEPS} micro-batches; ms/step is per "
             "micro-batch), "
             f"{results.get('rounds')} rounds of one fit of "
             f"{results.get('epochs_per_fit')} epochs per configuration "
             f"(first untimed), jit_compile=False, on "
             f"{results.get('device')}.", ""]
    lines += _table(["configuration", "epoch s", "ms/step", "examples/s"],
                    [[_cell(c["name"]), _cell(c["epoch_s"], ".3f"),
                      _cell(c["step_ms"], ".2f"),
                      _cell(c["examples_per_s"], ",.0f")]
                     for c in results.get("configs", [])])
    lines += _table(["ratio", "median", "quartiles"],
                    [[_cell(r["name"]), _cell(r["median"], ".3f"),
                      f"{_cell(r['q1'], '.3f')}-{_cell(r['q3'], '.3f')}"]
                     for r in results.get("ratios", [])])
    backup = results.get("backup") or {}
    if backup:
        lines += [f"BackupAndRestore: {backup.get('saves')} saves, "
                  f"{_cell(backup.get('stall_ms'), '.1f')} ms median stall "
                  "of the training thread per save.", ""]
    return lines


_MD_PARTS = {"machine": _md_machine, "gpu_tests": _md_gpu_tests,
             "resnet50": _md_resnet, "logical_gpus": _md_logical,
             "overheads": _md_overheads}


def format_markdown(payload: dict) -> str:
    """The report: the machine, a line per part, then each part's figures."""
    machine = payload.get("machine") or {}
    gpus = machine.get("gpus") or []
    lines = ["# keras-mgpu GPU suite", "",
             f"Mode: {payload['mode']}; {payload['date']}; budget "
             f"{fmt_s(payload['budget_s'])} s, took "
             f"{fmt_s(payload['seconds'])} s; schema {payload['schema']}.",
             ""]
    if payload["mode"] == "dry-run":
        lines += ["Dry run: every part on the CPU at tiny sizes. It shows "
                  "the code runs, not GPU performance.", ""]
    lines += _table(
        ["GPU", "memory MiB", "compute capability", "driver", "CUDA / cuDNN",
         "interconnect", "TensorFlow", "Keras", "keras-mgpu", "CPUs"],
        [[_cell(", ".join(sorted({g.get("name") or "?" for g in gpus}))
                + (f" x{len(gpus)}" if len(gpus) > 1 else "")
                if gpus else None, missing="none"),
          _cell(gpus[0].get("memory_mib") if gpus else None),
          _cell(".".join(map(str, gpus[0]["compute_capability"]))
                if gpus and gpus[0].get("compute_capability") else None),
          _cell(machine.get("driver_version")),
          f"{_cell(machine.get('cuda_version'))} / "
          f"{_cell(machine.get('cudnn_version'))}",
          _cell(machine.get("interconnect")), _cell(machine.get("tensorflow")),
          _cell(machine.get("keras")), _cell(machine.get("keras_mgpu")),
          _cell(machine.get("cpu_count"))]])
    if machine.get("reason"):
        lines += [f"GPU fields n/a: {machine['reason']}.", ""]
    lines += _table(["part", "status", "seconds", "budget s", "note"],
                    [[name, entry["status"], fmt_s(entry["seconds"]),
                      fmt_s(entry["budget_s"]),
                      _cell((entry["note"] or "").splitlines()[0]
                            if entry["note"] else "", missing="")]
                     for name, entry in payload["parts"].items()])
    for name, entry in payload["parts"].items():
        lines += [f"## {name}", "", f"Status: {entry['status']}.", ""]
        if entry["note"]:
            lines += ["```", entry["note"], "```", ""]
        if entry["results"]:
            lines += _MD_PARTS[name](entry["results"])
    return "\n".join(lines).rstrip() + "\n"
