"""Benchmark: cost of keras-mgpu's callbacks on real models, 2 replicas.

Times `fit` of each catalogue model (`tests/models/catalogue.py`: keras-hub
transformers, keras.applications convnets, at test size) on each Keras
backend with no callback (`plain`), `DistributedLogger(log_dir,
update_freq=100, console=False)`, `BackupAndRestore(backup_dir,
save_freq=100)` and both (the logger first); on JAX also `in-order`, a
callback doing nothing in `on_train_batch_end` (below). 2 replicas:
TensorFlow `MirroredStrategy` over 2 logical CPUs
(`keras_mgpu.auto_strategy(virtual_cpus=2)`), JAX `DataParallel` over 2 host
devices (`--xla_force_host_platform_device_count=2`). The backend is fixed
at import, so the main process runs a child per backend and model.

Each configuration has its own model (same seed; Adam,
`SparseCategoricalCrossentropy(from_logits=True)`) and its callbacks, made
once and given to each of its fits as a script calling `fit` again would
(`--fresh-callbacks`: new ones, in empty directories, every fit, which then
pays their setup too). A warm-up fit of `--warmup` batches (tracing, the
callbacks' files and threads, a first record and save) is not timed. Then
the configurations take turns fit by fit over `--rounds` rounds, the order
rotating, so that drifts in machine load touch them all alike. Nothing is
restored: a finished `BackupAndRestore` deletes its backup (its default).
With the defaults (`--steps 200`, `--freq 100`) each timed fit holds 2
records and 2 saves; `--freq` sets both frequencies lower for slow models.

A fit's time runs from before the first `on_train_begin` to after the last
`on_train_end` of its callbacks (two timing callbacks without batch hooks):
every hook and all training, not Keras's data setup before nor its teardown
after, which are the same in every configuration. That teardown is where
TensorFlow's `MirroredStrategy` over logical CPUs stalls now and then (2.5
s, sometimes 5, 10 or 20 s, after a 3 s fit on 2 busy cores); `wall_times`
in the JSON, whole `fit` calls, keep it. A ratio is a fit's time over the
same round's `plain` fit: the median over rounds, with the quartiles; a
second table gives the fastest fit over the fastest `plain` fit, as noise
only adds time. The callbacks' hooks are timed on the training thread too
(wrapped only where overridden, so Keras's dispatch is unchanged): their
share shows where an overhead goes, less work on other threads (the backup
writer, JAX's asynchronous batch ends); per hook in the JSON (`hooks`,
`warmup_hooks`).

On JAX, Keras runs batch ends on a thread pool without waiting for the
step, unless a callback overrides `on_train_batch_end` without declaring
`async_safe`. `DistributedLogger` declares it inside `fit` and keeps this
asynchronous dispatch; `BackupAndRestore` does not (a save copies the state
its batch left), so with it Keras waits for each step before dispatching
the next. `in-order` is that cost alone: the JAX ratios of
`BackupAndRestore` and `both` include it (over `in-order`: `vs_in_order`
in the JSON).

A hazard: with few cores, a JAX `fit` with asynchronous dispatch over forced
host devices can deadlock: one device's step waits in the all-reduce
rendezvous while the pool thread that should launch the other device's part
waits on an XLA semaphore, and after 40 s XLA aborts the process
("Termination timeout for all reduce ... only 1 of them arrived"). Seen
with gpt2, `plain`, 2 cores, in about 1 of 10 runs of three 1000-step fits.
It never resolves: a terminate timeout of 200 s
(`--xla_cpu_collective_call_terminate_timeout_seconds`) only delays the
abort; `jax_cpu_enable_async_dispatch=False` and
`--xla_cpu_multi_thread_eigen=false` do not avoid it; fits with in-order
batch ends have not shown it. So a child that dies is rerun (`--retries`);
a configuration that kills it again is dropped for that model and the rest
measured without it (against `in-order` if `plain` is dropped, marked).
Every abort is listed under the table and in the JSON.

Run from the repository root (`--merge`: one table from several runs):

    .venv/bin/python benchmarks/model_overhead.py --models gpt2,bert,llama
    .venv/bin/python benchmarks/model_overhead.py --models convnexttiny \\
        --steps 10 --freq 5 --warmup 5 --json /tmp/convnext.json
    .venv/bin/python benchmarks/model_overhead.py --merge a.json,b.json

This file is the parent: it runs the children, retries them, sums up and
prints the table; a child's own code is `_model_overhead_child.py`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from _model_overhead_child import (BACKUP, BOTH, CONFIGS, IN_ORDER, LOGGER,
                                   PLAIN, ROOT)
from _model_overhead_child import run as run_child

FREQ = 100  # update_freq and save_freq by default, in batches


def _environment(backend: str) -> dict:
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    if backend == "jax":
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " "
                            "--xla_force_host_platform_device_count=2").strip()
    return env


def _why(rc, stderr: str) -> str:
    if "Termination timeout" in stderr:
        return "XLA all-reduce rendezvous timeout (deadlock): aborted"
    return "killed after --timeout" if rc is None else f"exit status {rc}"


def measure(backend: str, name: str, args) -> dict:
    """Runs children for one model until it is measured: its result, with
    the aborts seen, or {"failed": why}."""
    configs = [c for c in CONFIGS
               if c != IN_ORDER or (backend == "jax" and args.in_order)]
    aborts = []
    while True:
        fd, progress = tempfile.mkstemp(prefix="model_overhead_",
                                        suffix=".jsonl")
        os.close(fd)
        command = [sys.executable, os.path.abspath(__file__), "--child",
                   backend, "--models", name, "--configs", ",".join(configs),
                   "--progress", progress]
        for option in ("steps", "warmup", "freq", "rounds", "batch", "dir"):
            if getattr(args, option) is not None:
                command += [f"--{option}", str(getattr(args, option))]
        command += ["--fresh-callbacks"] if args.fresh_callbacks else []
        start = time.perf_counter()
        with tempfile.TemporaryFile("w+") as stderr:
            try:
                rc = subprocess.run(command, env=_environment(backend),
                                    cwd=ROOT, stderr=stderr,
                                    timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = None
            stderr.seek(0)
            text = stderr.read()
        with open(progress) as f:
            records = [json.loads(line) for line in f if line.strip()]
        os.remove(progress)
        result = next((r["result"] for r in records if "result" in r), None)
        if rc == 0 and result is not None:
            result.update(aborts=aborts, configs=configs,
                          wall_s=time.perf_counter() - start)
            return result
        fits = [r for r in records if "fit" in r]
        if not fits:  # died before training: not the hazard, show why
            print(f"{backend} {name}: the child failed ({_why(rc, text)}):\n"
                  + text[-6000:], file=sys.stderr)
            return {"failed": _why(rc, text), "aborts": aborts}
        aborts.append({"config": fits[-1]["fit"], "round": fits[-1]["round"],
                       "why": _why(rc, text)})
        tail = [line for line in text.splitlines()
                if not line.startswith(("I0000", "WARNING: All log"))][-4:]
        print(f"{backend} {name}: the child died in {aborts[-1]}; last "
              "lines of its stderr:\n  " + "\n  ".join(
                  line[:300] for line in tail), file=sys.stderr)
        if sum(a["config"] == aborts[-1]["config"] for a in aborts) \
                > args.retries:
            configs.remove(aborts[-1]["config"])
            if not {PLAIN, IN_ORDER} & set(configs) or len(configs) < 2:
                return {"failed": "aborted again and again", "aborts": aborts}


def _quartiles(values) -> list:
    import numpy as np

    return [float(v) for v in np.percentile(values, [25, 50, 75])]


def summarize(result: dict) -> dict:
    """Paired ratios against `plain` (or `in-order` without it)."""
    times, hooks = result["times"], result["hooks"]
    base = PLAIN if PLAIN in times else IN_ORDER

    def over(config, reference):
        return _quartiles([t / b for t, b in zip(times[config],
                                                   times[reference])])

    out = {"base": base,
           "base_ms_per_step": 1000 * _quartiles(times[base])[1]
           / result["steps"],
           "ratios": {c: over(c, base) for c in times},
           "best": {c: min(times[c]) / min(times[base]) for c in times},
           "hook_share": {c: _quartiles([sum(h.values()) / t for h, t in zip(
               hooks[c], times[c])]) for c in times}}
    if IN_ORDER in times:
        out["vs_in_order"] = {c: over(c, IN_ORDER) for c in (BACKUP, BOTH)
                              if c in times}
    return out


def _same(results: dict, key: str) -> str:
    """A setting of the runs, or its values joined where they differ."""
    return "/".join(sorted({str(r.get(key)) for per in results.values()
                            for r in per.values()}))


def table(results: dict, models, backends) -> str:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    os.environ.setdefault("KERAS_BACKEND", "numpy")  # _timing imports Keras
    from _timing import markdown_table

    shown = (LOGGER, BACKUP, BOTH, IN_ORDER)
    header = ("model", "backend", "steps/freq", "plain ms/step",
              *(f"{c} x plain" for c in shown), "in hooks: DL / B&R / both")
    rows, best, notes, versions = [], [], [], {}
    for name in models:
        for backend in backends:
            result = results.get(backend, {}).get(name)
            if result is None:
                continue
            versions.update(result.get("versions", {}))
            notes += [f"{name} on {backend}: `{a['config']}` died in "
                      + (f"round {a['round'] + 1}" if a["round"] >= 0
                         else "the warm-up") + f" ({a['why']})"
                      for a in result.get("aborts", [])]
            if "failed" in result:
                rows.append((name, backend, "", result["failed"],
                             *[""] * 5))
                continue
            summary = result["summary"]
            mark = "" if summary["base"] == PLAIN else " †"

            def cell(config, key="ratios"):
                if config not in summary[key]:
                    return "—"
                q1, median, q3 = summary[key][config]
                if key == "hook_share":
                    return f"{100 * median:.1f}%"
                return f"{median:.3f} ({q1:.3f}–{q3:.3f}){mark}"

            best.append((name, backend, *(
                f"{summary['best'][c]:.3f}{mark}" if c in summary["best"]
                else "—" for c in shown)))
            rows.append((name, backend, f"{result['steps']}/{result['freq']}",
                         f"{summary['base_ms_per_step']:.1f}{mark}",
                         *(cell(c) for c in shown), " / ".join(
                             cell(c, "hook_share")
                             for c in (LOGGER, BACKUP, BOTH))))
    lines = [
        f"Machine: {os.cpu_count()} CPUs, {platform.platform()}; "
        f"{datetime.date.today().isoformat()}; "
        + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())),
        "2 replicas (TensorFlow: MirroredStrategy over 2 logical CPUs; JAX: "
        f"DataParallel over 2 host devices); global batch "
        f"{_same(results, 'batch')}; {_same(results, 'rounds')} rounds; "
        "callbacks: " + _same(results, "callbacks") + "; "
        "steps/freq: batches per timed fit / update_freq and save_freq. "
        "Ratios: median (quartiles) over rounds of a fit's time over the "
        "same round's plain fit. In hooks: median share of the fit spent in "
        "the callbacks' hooks on the training thread.", "",
        markdown_table(header, rows, text_columns={0, 1}),
        "\nThe fastest fit of each configuration over the fastest plain fit "
        "(noise only adds time: on a shared machine the steadier figure):\n",
        markdown_table(("model", "backend", *shown), best,
                       text_columns={0, 1})]
    if any("†" in " ".join(row) for row in rows):
        lines.append("\n† `plain` was dropped after repeated aborts: "
                     "against `in-order` instead.")
    if notes:
        lines.append("\nAborted child processes:\n"
                     + "\n".join(f"- {n}" for n in notes))
    return "\n".join(lines)


def _dump(path: str, argv, results: dict) -> None:
    with open(path, "w") as f:
        json.dump({"argv": argv, "cpus": os.cpu_count(),
                   "platform": platform.platform(),
                   "date": datetime.datetime.now().isoformat(
                       timespec="seconds"), "results": results}, f, indent=1)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="all",
                        help="comma-separated catalogue names, or all")
    parser.add_argument("--backends", default="tensorflow,jax")
    parser.add_argument("--steps", type=int, default=2 * FREQ,
                        help="batches per timed fit")
    parser.add_argument("--warmup", type=int, default=FREQ,
                        help="batches of the untimed first fit")
    parser.add_argument("--freq", type=int, default=FREQ,
                        help="update_freq and save_freq, in batches")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16,
                        help="global batch size")
    parser.add_argument("--retries", type=int, default=1, help="reruns of "
                        "a model whose child dies in the same configuration")
    parser.add_argument("--no-in-order", dest="in_order",
                        action="store_false", help="no JAX in-order fits")
    parser.add_argument("--fresh-callbacks", action="store_true",
                        help="new callbacks for every fit, not one set "
                        "per configuration")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds per child process")
    parser.add_argument("--dir", help="where logs and backups go (default: "
                        "a temporary directory)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--merge", help="comma-separated JSON files of "
                        "earlier runs: one table of them all, nothing run")
    for hidden in ("--child", "--configs", "--progress"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_child(args)
        return {}

    results, argvs = {}, []
    if args.merge:  # later files win
        for path in args.merge.split(","):
            with open(path) as f:
                run = json.load(f)
            argvs.append(run["argv"])
            for backend, per_model in run["results"].items():
                results.setdefault(backend, {}).update(per_model)
        backends = list(results)
        models = list(dict.fromkeys(m for per in results.values()
                                    for m in per))
    else:
        if args.models == "all":  # read without importing Keras here
            import ast

            with open(os.path.join(ROOT, "tests/models/catalogue.py")) as f:
                args.models = ",".join(
                    node.args[0].value for node in ast.walk(ast.parse(
                        f.read())) if isinstance(node, ast.Call)
                    and getattr(node.func, "id", None) == "Entry")
        models, backends = args.models.split(","), args.backends.split(",")
        argvs = sys.argv[1:] if argv is None else argv
        for backend in backends:
            for name in models:
                print(f"{backend} {name} ...", flush=True)
                result = measure(backend, name, args)
                result.update(steps=args.steps, freq=args.freq,
                              batch=args.batch, rounds=args.rounds,
                              warmup=args.warmup, callbacks=(
                                  "new for each fit" if args.fresh_callbacks
                                  else "made once, reused by each fit"))
                if "failed" not in result:
                    result["summary"] = summarize(result)
                    print(f"{backend} {name}: " + ", ".join(
                        f"{c} {r[1]:.3f}" for c, r in
                        result["summary"]["ratios"].items())
                        + f" ({result['wall_s']:.0f} s)", flush=True)
                results.setdefault(backend, {})[name] = result
                if args.json:  # after each model: a partial run is kept
                    _dump(args.json, argvs, results)
    print("\n" + table(results, models, backends))
    if args.json:
        _dump(args.json, argvs, results)
    return results


if __name__ == "__main__":
    main()
