"""The `keras-mgpu` command: `doctor` checks a machine, `bench` measures
scaling, `launch` runs a supervised local cluster, `goodput` shows where a
job's time went.

    keras-mgpu doctor [--json] [--need tuner,profile,wandb]
    keras-mgpu bench [--model resnet|mlp] [--replicas 1,2,4]
                     [--precision float32,mixed] [--accum 1,4]
                     [--steps 20] [--batch-size 64] [--json PATH]
                     [--plot out.png]
    keras-mgpu launch --workers N [--max-restarts R] -- COMMAND [ARGS ...]
    keras-mgpu goodput LOG_DIR [--json PATH] [--plot out.png]

The `keras-mgpu` console script is `main` here, also run by `python -m
keras_mgpu`: it parses the arguments (`keras_mgpu._args`, standard library
only) and then imports TensorFlow (quietly) for `doctor` and `bench` only:
`launch` supervises its workers without it, `goodput` reads a local log
without it, and `--help` or a bad value answers at once.
The JSON formats are documented in `keras_mgpu._doctor`,
`keras_mgpu._bench` and `keras_mgpu.goodput.report`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from keras_mgpu import launcher
# build_parser is also this module's name for the parser, as before.
from keras_mgpu._args import build_parser  # noqa: F401
from keras_mgpu._args import parse_args
from keras_mgpu.quiet import quiet_tensorflow

EXIT_OK = 0
EXIT_FINDING_ERROR = 1
EXIT_USAGE = 2


def _file_runner(topo: Optional[str], query: Optional[str]):
    texts = {}
    for key, path in (("topo", topo), ("query", query)):
        if path is not None:
            with open(path) as f:
                texts[key] = f.read()

    def runner(args: Sequence[str]) -> Optional[str]:
        return texts.get("topo" if args and args[0] == "topo" else "query")

    return runner


def run_doctor(args: argparse.Namespace) -> int:
    from keras_mgpu import _doctor

    runner = None
    devices = None
    if args.nvidia_smi_topo or args.nvidia_smi_query:
        runner = _file_runner(args.nvidia_smi_topo, args.nvidia_smi_query)
        if args.assume_tf_sees_smi_gpus and args.nvidia_smi_query:
            devices = [{"name": "/physical_device:CPU:0", "type": "CPU"}] + [
                {"name": f"/physical_device:GPU:{g['index']}", "type": "GPU",
                 "device_name": g["name"],
                 "compute_capability": g["compute_capability"]}
                for g in _doctor.parse_gpu_query(runner(["--query-gpu"]))]
    report = _doctor.collect(nvidia_smi_runner=runner, devices=devices,
                             need=args.need)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_doctor.format_report(report))
    return EXIT_OK if report["ok"] else EXIT_FINDING_ERROR


def _bench_child(args: argparse.Namespace) -> int:
    from keras_mgpu import _bench

    output = _bench.run_child(
        replicas=args.replicas[0], model_name=args.model,
        policies=json.loads(args._policies), accum=args.accum,
        batch_size=args.batch_size, steps=args.steps, repeats=args.repeats,
        warmup_steps=args.warmup_steps)
    with open(args._out + ".tmp", "w") as f:
        json.dump(output, f)
    os.replace(args._out + ".tmp", args._out)
    return EXIT_OK


def run_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args._child:
        return _bench_child(args)
    import tensorflow as tf

    from keras_mgpu import _bench
    from keras_mgpu import mixed_precision

    # Physical devices only: listing them leaves TensorFlow uninitialised.
    gpus = tf.config.list_physical_devices("GPU")
    if gpus and max(args.replicas) > len(gpus):
        parser.error(f"--replicas: {max(args.replicas)} replicas requested "
                     f"but only {len(gpus)} GPU(s) are visible.")
    try:
        policies = _bench.resolve_precisions(
            args.precision, mixed_precision.gpu_compute_capabilities())
        if args.plot:
            _bench.check_plot_format(args.plot)
    except (ValueError, ImportError) as e:
        parser.error(str(e))
    to_stdout = args.json == "-"
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if to_stdout \
        else print
    settings = {
        "model": args.model, "replicas": args.replicas,
        "precisions": args.precision, "accum": args.accum,
        "batch_size": args.batch_size, "steps": args.steps,
        "repeats": args.repeats, "warmup_steps": args.warmup_steps,
    }
    try:
        outputs = _bench.run_children(settings, policies, args.timeout, log)
    except RuntimeError as e:
        print(f"keras-mgpu bench: error: {e}", file=sys.stderr)
        return EXIT_FINDING_ERROR
    payload = _bench.combine(settings, policies, outputs, bool(gpus))
    _bench.validate(payload)
    if to_stdout:
        print(json.dumps(payload, indent=2))
    else:
        print()
        print(_bench.format_table(payload))
    if args.json and not to_stdout:
        try:
            with open(args.json, "w") as f:
                json.dump(payload, f, indent=2)
        except OSError as e:
            # Checked before the run, yet gone since: the results are
            # printed rather than lost.
            print(json.dumps(payload, indent=2))
            print(f"keras-mgpu bench: error: could not write --json "
                  f"{args.json!r} ({e}); the results are printed above.",
                  file=sys.stderr)
            return EXIT_FINDING_ERROR
        log(f"Wrote {args.json}")
    if args.plot:
        try:
            _bench.plot(payload, args.plot)
        except OSError as e:
            kept = "the --json output" if args.json else "the table above"
            print(f"keras-mgpu bench: error: could not write --plot "
                  f"{args.plot!r} ({e}); the results are in {kept}.",
                  file=sys.stderr)
            return EXIT_FINDING_ERROR
        log(f"Wrote {args.plot}")
    return EXIT_OK


def run_launch(args: argparse.Namespace) -> int:
    """`keras-mgpu launch`: the workers' output on stdout, one line per
    attempt that ended on stderr; the exit code."""
    codes = args.restart_exit_codes
    try:
        result = launcher.launch(
            args.program, args.workers, min_workers=args.min_workers,
            max_restarts=args.max_restarts,
            restart_exit_codes=(launcher.LAUNCH_RESTART_EXIT_CODES
                                if codes is None else codes),
            backoff=args.backoff, hang_timeout=args.hang_timeout,
            progress_file=args.progress_file, timeout=args.timeout,
            grace_period=args.grace_period, echo=sys.stdout,
            report=sys.stderr)
    except launcher.LaunchError as e:
        # Its first line went to the report already.
        details = str(e).partition("\n")[2]
        if details:
            print(details, file=sys.stderr)
        return e.exit_code
    except launcher.WorkerError as e:  # the --timeout ran out
        print(f"keras-mgpu launch: {e}", file=sys.stderr)
        return EXIT_FINDING_ERROR
    restarts = result.restarts
    print(f"keras-mgpu launch: all {len(result.results)} workers finished "
          f"after {restarts} restart{'' if restarts == 1 else 's'}.",
          file=sys.stderr)
    return EXIT_OK


def run_goodput(args: argparse.Namespace) -> int:
    """`keras-mgpu goodput`: the table (or JSON) on stdout; the exit code."""
    from keras_mgpu.goodput import plot as goodput_plot
    from keras_mgpu.goodput import report

    if args.plot:
        try:
            goodput_plot.check_plot_format(args.plot)
        except (ValueError, ImportError) as e:
            args.subparser.error(str(e))
    if "://" in args.log_dir:
        # Read through TensorFlow's file systems: its start-up lines hidden.
        quiet_tensorflow()
    try:
        job = report.read_job(args.log_dir)
    except (OSError, ValueError) as e:
        print(f"keras-mgpu goodput: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    to_stdout = args.json == "-"
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if to_stdout \
        else print
    print(job.to_json() if to_stdout else job.table())
    if args.json and not to_stdout:
        try:
            with open(args.json, "w") as f:
                f.write(job.to_json() + "\n")
        except OSError as e:
            print(f"keras-mgpu goodput: error: could not write --json "
                  f"{args.json!r} ({e}).", file=sys.stderr)
            return EXIT_FINDING_ERROR
        log(f"Wrote {args.json}")
    if args.plot:
        try:
            goodput_plot.plot(job, args.plot)
        except OSError as e:
            print(f"keras-mgpu goodput: error: could not write --plot "
                  f"{args.plot!r} ({e}).", file=sys.stderr)
            return EXIT_FINDING_ERROR
        log(f"Wrote {args.plot}")
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    """Runs the command `args` names (parsed by `build_parser()`); the exit code.

    Args:
        args: The namespace `build_parser().parse_args(...)` returned.

    Returns:
        0 on success, 1 when `doctor` found an error, `bench` failed or
        `goodput` could not write a file; 2 when `goodput` found no log to
        read; for `launch`, the status of the failure it gave up on.

    Example:

    >>> run(build_parser().parse_args(["doctor", "--json"]))  # doctest: +SKIP
    0
    """
    if args.command == "launch":
        return run_launch(args)
    if args.command == "goodput":
        return run_goodput(args)
    quiet_tensorflow()
    if args.command == "doctor":
        return run_doctor(args)
    return run_bench(args, args.subparser)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs `keras-mgpu` with `argv`; returns the exit code.

    The arguments are checked before TensorFlow is imported, so `--help` and
    a bad value answer at once; `doctor` and `bench` then import TensorFlow
    with `quiet_tensorflow()`, `launch` never does, `goodput` only for a
    log dir at a URL (`gs://...`).

    Args:
        argv: Defaults to `None`, the command line (`sys.argv[1:]`).

    Returns:
        0 when the command succeeded, 1 when `doctor` found an error or
        `bench` failed, 2 when `goodput` found no log to read. Argument
        errors exit with 2 (`SystemExit`), as argparse does.

    Example:

    >>> main(["bench", "--replicas", "0"])  # doctest: +SKIP
    usage: keras-mgpu bench ...
    keras-mgpu bench: error: argument --replicas: --replicas: 0 is out of \
range; each value must be from 1 to 64.
    """
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
