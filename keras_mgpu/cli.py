"""The `keras-mgpu` command: `doctor` checks a machine, `bench` measures scaling.

    keras-mgpu doctor [--json] [--need tuner,profile,wandb]
    keras-mgpu bench [--model resnet|mlp] [--replicas 1,2,4]
                     [--precision float32,mixed] [--accum 1,4]
                     [--steps 20] [--batch-size 64] [--json PATH]
                     [--plot out.png]

Also runnable as `python -m keras_mgpu.cli ...`. The JSON formats are
documented in `keras_mgpu._doctor` and `keras_mgpu._bench`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from keras_mgpu import _bench
from keras_mgpu import _doctor

EXIT_OK = 0
EXIT_FINDING_ERROR = 1
EXIT_USAGE = 2


def _list_type(parse, *args):
    """Wraps a list parser so argparse reports its message (naming the value)."""

    def parse_arg(text: str):
        try:
            return parse(text, *args)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse_arg


def _positive_int(what: str):
    def parse_arg(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(
                f"{what}: {text!r} is not a positive integer.")
        return value

    return parse_arg


def _features(text: str) -> list[str]:
    if text.strip() == "all":
        return sorted(_doctor.FEATURES)
    return _bench.parse_choice_list(text, "--need", sorted(_doctor.FEATURES))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `keras-mgpu` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="keras-mgpu",
        description="Check a machine for multi-GPU Keras training (doctor) "
                    "and measure data-parallel scaling (bench).")
    sub = parser.add_subparsers(dest="command", metavar="{doctor,bench}")
    sub.required = True

    doctor = sub.add_parser(
        "doctor", help="versions, devices, interconnect, cluster, advice",
        description="Report versions, devices, GPU interconnect, the "
                    "TF_CONFIG cluster and the strategy auto_strategy() "
                    "would pick, with findings and advice. Exits 1 when a "
                    "finding is an error.")
    doctor.add_argument("--json", action="store_true",
                        help="print the report as JSON")
    doctor.add_argument("--need", type=_list_type(_features),
                        default=[], metavar="FEATURES",
                        help="features you need, comma-separated: "
                             "tuner,profile,wandb (or all); a missing "
                             "package for one is an error")
    # Recorded nvidia-smi output instead of running it (tests, bug reports).
    doctor.add_argument("--nvidia-smi-topo", metavar="FILE",
                        help=argparse.SUPPRESS)
    doctor.add_argument("--nvidia-smi-query", metavar="FILE",
                        help=argparse.SUPPRESS)
    doctor.add_argument("--assume-tf-sees-smi-gpus", action="store_true",
                        help=argparse.SUPPRESS)

    bench = sub.add_parser(
        "bench", help="examples/s and scaling efficiency at 1..N replicas",
        description="Train a synthetic workload at each replica count (one "
                    "process each) and report examples/s, scaling "
                    "efficiency, the mixed-precision speed-up and memory. "
                    "Without GPUs the replicas are logical CPU devices: the "
                    "figures show mechanics, not GPU performance.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bench.add_argument("--model", choices=_bench.MODELS, default="resnet",
                       help="workload: a ResNet-style ConvNet or an MLP")
    bench.add_argument("--replicas", default="1,2",
                       type=_list_type(_bench.parse_int_list, "--replicas", 1,
                                       _bench.MAX_REPLICAS),
                       help="replica counts, comma-separated")
    bench.add_argument("--precision", default="float32",
                       type=_list_type(_bench.parse_choice_list,
                                       "--precision", _bench.PRECISIONS),
                       help="comma-separated: float32, mixed (the policy "
                            "choose_policy picks for the GPUs), or a forced "
                            "mixed_bfloat16 / mixed_float16")
    bench.add_argument("--accum", default="1",
                       type=_list_type(_bench.parse_int_list, "--accum", 1),
                       help="gradient accumulation steps, comma-separated; "
                            "1 = plain fit, N > 1 = GradientAccumulationModel")
    bench.add_argument("--steps", type=_positive_int("--steps"), default=20,
                       help="timed steps (micro-batches) per repeat")
    bench.add_argument("--repeats", type=_positive_int("--repeats"),
                       default=3, help="timed repeats; the median counts")
    bench.add_argument("--warmup-steps", type=_positive_int("--warmup-steps"),
                       default=3, help="untimed steps that trace the step")
    bench.add_argument("--batch-size", type=_positive_int("--batch-size"),
                       default=64, help="examples per replica per step")
    bench.add_argument("--timeout", type=_positive_int("--timeout"),
                       default=1800, help="seconds allowed per replica count")
    bench.add_argument("--json", metavar="PATH",
                       help="write the results as JSON here ('-': stdout, "
                            "instead of the table)")
    bench.add_argument("--plot", metavar="PNG",
                       help="write a chart of throughput and efficiency")
    bench.set_defaults(subparser=bench)
    bench.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    bench.add_argument("--_out", help=argparse.SUPPRESS)
    bench.add_argument("--_policies", help=argparse.SUPPRESS)
    return parser


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

    from keras_mgpu import mixed_precision

    # Physical devices only: listing them leaves TensorFlow uninitialised.
    gpus = tf.config.list_physical_devices("GPU")
    if gpus and max(args.replicas) > len(gpus):
        parser.error(f"--replicas: {max(args.replicas)} replicas requested "
                     f"but only {len(gpus)} GPU(s) are visible.")
    try:
        policies = _bench.resolve_precisions(
            args.precision, mixed_precision.gpu_compute_capabilities())
    except ValueError as e:
        parser.error(str(e))
    to_stdout = args.json == "-"
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if to_stdout \
        else print
    if not gpus:
        log(f"NOTE: {_bench.CPU_NOTE}")
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
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        log(f"Wrote {args.json}")
    if args.plot:
        _bench.plot(payload, args.plot)
        log(f"Wrote {args.plot}")
    return EXIT_OK


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs `keras-mgpu` with `argv` (default: the command line); the exit code.

    Example:

    >>> main(["bench", "--replicas", "0"])  # doctest: +SKIP
    usage: keras-mgpu bench ...
    keras-mgpu bench: error: argument --replicas: --replicas: 0 is out of range...
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return run_doctor(args)
    return run_bench(args, args.subparser)


if __name__ == "__main__":
    sys.exit(main())
