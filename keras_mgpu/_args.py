"""`keras-mgpu`'s command line, without TensorFlow: the parser and its checks.

The argument parser, the constants and the list parsers it checks values
with, importing only the standard library: `keras-mgpu --help` and a
mistyped argument answer before TensorFlow (3-8 s) is imported. Imported by
`keras_mgpu.cli`, `_bench`, `_doctor` and the launcher (`keras_mgpu.cluster`);
it imports none of them.
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Callable, Mapping, Optional, Sequence

MODELS = ("resnet", "mlp")
PRECISIONS = ("float32", "mixed", "mixed_bfloat16", "mixed_float16")
MAX_REPLICAS = 64
# Upper bounds of bench's counts, far beyond any useful run: a larger value
# would otherwise reach TensorFlow or the OS and fail there (OverflowError
# in a child process) after the earlier replica counts had run.
MAX_STEPS = 1_000_000  # --steps, --warmup-steps, --accum
MAX_REPEATS = 1_000
MAX_BATCH_SIZE = 1_048_576
MAX_TIMEOUT = 7 * 24 * 3600
MAX_WORKERS = 1024  # launch --workers
# Seconds `launch`'s workers have to exit after a stop signal, within the
# 120 s before the end at which SLURM's `--signal=TERM@120` sends one.
DEFAULT_GRACE_PERIOD = 90.0
MAX_RESTARTS = 1_000_000
# Feature (the pip extra of the same name) -> the display names of the
# packages it needs (keys of `keras_mgpu._doctor.OPTIONAL_PACKAGES`).
FEATURES = {
    "tuner": ("KerasTuner",),
    "profile": ("TensorBoard", "xprof"),
    "wandb": ("wandb",),
}

# --- Argument values ----------------------------------------------------------


def parse_int_list(text: str, what: str, low: int = 1,
                   high: Optional[int] = None) -> list[int]:
    """Comma-separated integers, each in [low, high]; errors name the bad value.

    Args:
        text: The argument, e.g. `"1,2,4"`.
        what: The option's name for error messages, e.g. `"--replicas"`.
        low: Defaults to 1. The smallest value allowed.
        high: Defaults to `None`, no upper bound. The largest value allowed.

    Returns:
        The distinct values, sorted.

    Example:

    >>> parse_int_list("2,1,2", "--replicas")
    [1, 2]
    >>> parse_int_list("1,x", "--replicas")
    Traceback (most recent call last):
    ...
    ValueError: --replicas: 'x' is not an integer (in '1,x'); expected \
comma-separated integers such as 1,2,4.
    """
    values = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = int(part)
        except ValueError:
            raise ValueError(
                f"{what}: {part!r} is not an integer (in {text!r}); expected "
                "comma-separated integers such as 1,2,4."
            ) from None
        if value < low or (high is not None and value > high):
            bound = f"from {low} to {high}" if high is not None else (
                f"at least {low}")
            raise ValueError(f"{what}: {value} is out of range; each value "
                             f"must be {bound}.")
        values.append(value)
    return sorted(set(values))


def parse_choice_list(text: str, what: str,
                      choices: Sequence[str]) -> list[str]:
    """Comma-separated names from `choices`, in order, without repeats.

    Args:
        text: The argument, e.g. `"float32,mixed"`.
        what: The option's name for error messages, e.g. `"--precision"`.
        choices: The names allowed.

    Returns:
        The names in the order given, each once.

    Example:

    >>> parse_choice_list("float32,mixed", "--precision", PRECISIONS)
    ['float32', 'mixed']
    >>> parse_choice_list("fp64", "--precision", PRECISIONS)
    Traceback (most recent call last):
    ...
    ValueError: --precision: unknown value 'fp64'; choose from float32, \
mixed, mixed_bfloat16, mixed_float16.
    """
    names = [p.strip() for p in text.split(",")]
    for name in names:
        if name not in choices:
            raise ValueError(f"{what}: unknown value {name!r}; choose from "
                             f"{', '.join(choices)}.")
    return list(dict.fromkeys(names))


def _list_type(parse: Callable[..., list], *args) -> Callable[[str], list]:
    """Wraps a list parser so argparse reports its message (naming the value)."""

    def parse_arg(text: str) -> list:
        try:
            return parse(text, *args)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse_arg


def _positive_int(what: str, high: int, low: int = 1
                  ) -> Callable[[str], int]:
    def parse_arg(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            kind = "a positive integer" if low == 1 else f"an integer >= {low}"
            raise argparse.ArgumentTypeError(
                f"{what}: {text!r} is not {kind}.")
        if value > high:
            raise argparse.ArgumentTypeError(
                f"{what}: {value} is out of range; it must be from {low} to "
                f"{high}.")
        return value

    return parse_arg


def check_output_path(path: str, what: str, stem: str = "bench") -> None:
    """Refuses an output file that could not be written, before any work.

    The file's directory must exist and the file must be creatable or
    writable there; nothing is left behind by the check.

    Args:
        path: The file to write.
        what: The option's name for error messages, e.g. `"--json"`.
        stem: Defaults to `"bench"`. The command's name, for the file name
            suggested in a directory `path`.

    Raises:
        ValueError: naming the path, the reason and what to do.

    Example:

    >>> check_output_path("/nonexistent/dir/out.json", "--json")
    Traceback (most recent call last):
    ...
    ValueError: --json: cannot write '/nonexistent/dir/out.json': the \
directory '/nonexistent/dir' does not exist. Create it, or choose another path.
    """
    if os.path.isdir(path):
        example = os.path.join(path, stem + (".png" if what == "--plot"
                                             else ".json"))
        raise ValueError(
            f"{what}: {path!r} is a directory; give a file path in it, e.g. "
            f"{example!r}.")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(
            f"{what}: cannot write {path!r}: the directory {folder!r} does "
            "not exist. Create it, or choose another path.")
    existed = os.path.lexists(path)
    try:
        # Opened for appending: an existing file is not truncated yet.
        with open(path, "ab"):
            pass
    except OSError as e:
        raise ValueError(
            f"{what}: cannot write {path!r}: {e.strerror or e}. Choose a "
            "writable path.") from None
    if not existed:
        os.remove(path)


def _seconds(what: str, allow_zero: bool = False) -> Callable[[str], float]:
    def parse_arg(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        # NaN fails every comparison: caught by the `not`.
        if (value is None or not 0 <= value <= MAX_TIMEOUT
                or (value == 0 and not allow_zero)):
            low = "0" if allow_zero else "more than 0"
            raise argparse.ArgumentTypeError(
                f"{what}: {text!r} is not a number of seconds from {low} "
                f"to {MAX_TIMEOUT}.")
        return value

    return parse_arg


def _features(text: str) -> list[str]:
    if text.strip() == "all":
        return sorted(FEATURES)
    return parse_choice_list(text, "--need", sorted(FEATURES))


# --- The parser ------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `keras-mgpu` and its subcommands.

    Returns:
        An `argparse.ArgumentParser`; its namespaces have `command`
        (`"doctor"`, `"bench"`, `"launch"` or `"goodput"`) and, for all but
        `doctor`, `subparser` (the subcommand's parser, for errors found
        later, once TensorFlow is imported).

    Example:

    >>> args = build_parser().parse_args(["bench", "--replicas", "4,1"])
    >>> args.command, args.replicas, args.precision
    ('bench', [1, 4], ['float32'])
    """
    parser = argparse.ArgumentParser(
        prog="keras-mgpu",
        description="Check a machine for multi-GPU Keras training (doctor), "
                    "measure data-parallel scaling (bench), run a "
                    "training command as a supervised local cluster "
                    "(launch) and show where a training job's time went "
                    "over its restarts (goodput).")
    sub = parser.add_subparsers(dest="command",
                                metavar="{doctor,bench,launch,goodput}")
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
    bench.add_argument("--model", choices=MODELS, default="resnet",
                       help="workload: a ResNet-style ConvNet or an MLP")
    bench.add_argument("--replicas", default="1,2",
                       type=_list_type(parse_int_list, "--replicas", 1,
                                       MAX_REPLICAS),
                       help="replica counts, comma-separated")
    bench.add_argument("--precision", default="float32",
                       type=_list_type(parse_choice_list, "--precision",
                                       PRECISIONS),
                       help="comma-separated: float32, mixed (the policy "
                            "choose_policy picks for the GPUs), or a forced "
                            "mixed_bfloat16 / mixed_float16")
    bench.add_argument("--accum", default="1",
                       type=_list_type(parse_int_list, "--accum", 1,
                                       MAX_STEPS),
                       help="gradient accumulation steps, comma-separated; "
                            "1 = plain fit, N > 1 = GradientAccumulationModel")
    bench.add_argument("--steps", type=_positive_int("--steps", MAX_STEPS), default=20,
                       help="timed steps (micro-batches) per repeat")
    bench.add_argument("--repeats", type=_positive_int("--repeats", MAX_REPEATS),
                       default=3, help="timed repeats; the median counts")
    bench.add_argument("--warmup-steps", type=_positive_int("--warmup-steps", MAX_STEPS),
                       default=3, help="untimed steps that trace the step")
    bench.add_argument("--batch-size", type=_positive_int("--batch-size", MAX_BATCH_SIZE),
                       default=64, help="examples per replica per step")
    bench.add_argument("--timeout", type=_positive_int("--timeout", MAX_TIMEOUT),
                       default=1800, help="seconds allowed per replica count")
    bench.add_argument("--json", metavar="PATH",
                       help="write the results as JSON here ('-': stdout, "
                            "instead of the table); checked before the "
                            "benchmark runs")
    bench.add_argument("--plot", metavar="PNG",
                       help="write a chart of throughput and efficiency "
                            "(the extension names the format); checked "
                            "before the benchmark runs")
    bench.set_defaults(subparser=bench)
    bench.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    bench.add_argument("--_out", help=argparse.SUPPRESS)
    bench.add_argument("--_policies", help=argparse.SUPPRESS)

    launch = sub.add_parser(
        "launch", help="run N workers of a command, restarted when one dies",
        usage="keras-mgpu launch --workers N [--min-workers M] "
              "[--max-restarts R] [options] "
              "-- COMMAND [ARGS ...]",
        description="Start N local workers of COMMAND, each with its "
                    "TF_CONFIG on free localhost ports and KERAS_MGPU_ATTEMPT "
                    "(1, 2, ...) in its environment; show their output, each "
                    "line after its worker's label. When a worker dies by a "
                    "signal or exits with a restart code, stop the others "
                    "and start all N again on fresh ports, up to "
                    "--max-restarts times. Exits 0 when every worker "
                    "finished, else with the last failure's status.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    launch.add_argument("--workers", required=True,
                        type=_positive_int("--workers", MAX_WORKERS),
                        help="worker processes")
    launch.add_argument("--min-workers", default=None,
                        type=_positive_int("--min-workers", MAX_WORKERS),
                        metavar="M",
                        help="the fewest workers a restart may go on with: "
                             "a worker that failed in 2 attempts in a row "
                             "is left out of the next while more than M "
                             "are left; SIGUSR1 to the launcher starts "
                             "every worker again (default: --workers, none "
                             "left out)")
    launch.add_argument("--max-restarts", default=0,
                        type=_positive_int("--max-restarts", MAX_RESTARTS,
                                           low=0),
                        help="restarts of every worker after a worker died")
    launch.add_argument("--restart-exit-codes", default=None,
                        type=_list_type(parse_int_list,
                                        "--restart-exit-codes", 1, 255),
                        metavar="CODES",
                        help="exit codes that are worth a restart, "
                             "comma-separated (default: 137,138,143; a "
                             "death by a signal always is)")
    launch.add_argument("--backoff", default=1.0,
                        type=_seconds("--backoff", allow_zero=True),
                        help="seconds before the first restart, doubling "
                             "for each next one (at most 60)")
    launch.add_argument("--hang-timeout", default=None,
                        type=_seconds("--hang-timeout"), metavar="SECONDS",
                        help="stop and restart the workers when "
                             "--progress-file has not changed for this long")
    launch.add_argument("--progress-file", default=None, metavar="PATH",
                        help="a file the workers rewrite as they train, e.g. "
                             "BackupAndRestore's BACKUP_DIR/LOCK.json (its "
                             "heartbeat: at most every 30 s)")
    launch.add_argument("--timeout", default=None,
                        type=_seconds("--timeout"), metavar="SECONDS",
                        help="seconds for all attempts together (default: "
                             "no limit)")
    launch.add_argument("--grace-period", default=DEFAULT_GRACE_PERIOD,
                        type=_seconds("--grace-period"), metavar="SECONDS",
                        help="on a SIGTERM, SIGHUP or Ctrl-C, passed on to "
                             "the workers as SIGTERM (a BackupAndRestore "
                             "saves and exits), seconds before what still "
                             "runs is killed: within SLURM's "
                             "--signal=TERM@120")
    launch.add_argument("program", nargs=argparse.REMAINDER,
                        metavar="-- COMMAND [ARGS ...]",
                        help="the program each worker runs")
    launch.set_defaults(subparser=launch)

    goodput = sub.add_parser(
        "goodput", help="a training job's wall time by category, over its "
                        "restarts",
        description="Read LOG_DIR/metrics.jsonl, written by "
                    "DistributedLogger, and show how the job's wall time, "
                    "over all its attempts (restarts), splits into "
                    "productive training, input wait, compile, startup, "
                    "restore, checkpoint, evaluation, training redone "
                    "after a restart, time between attempts and other; "
                    "goodput is the productive share. Exits 2 when "
                    "LOG_DIR has no such records.")
    goodput.add_argument("log_dir", metavar="LOG_DIR",
                         help="the DistributedLogger's log_dir (a folder, "
                              "or a gs:// URL)")
    goodput.add_argument("--json", metavar="PATH",
                         help="write the report as JSON here ('-': "
                              "stdout, instead of the table)")
    goodput.add_argument("--plot", metavar="PNG",
                         help="write a chart of each attempt's time (the "
                              "extension names the format)")
    goodput.set_defaults(subparser=goodput)
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses `keras-mgpu`'s arguments and checks what bench or goodput
    will write.

    Everything is checked before any work starts: a bad value, or a
    `--json`/`--plot` file that could not be written, exits with code 2
    and a message naming it, as argparse does.

    Args:
        argv: Defaults to `None`, the command line (`sys.argv[1:]`).

    Returns:
        The namespace of `build_parser()`.

    Example:

    >>> parse_args(["bench", "--json", "/"])  # doctest: +SKIP
    usage: keras-mgpu bench ...
    keras-mgpu bench: error: --json: '/' is a directory; give a file path \
in it, e.g. '/bench.json'.
    """
    args = build_parser().parse_args(argv)
    if args.command == "launch":
        _check_launch(args)
    if (args.command == "bench" and not args._child
            or args.command == "goodput"):
        outputs = [(what, path) for what, path in (("--json", args.json),
                                                   ("--plot", args.plot))
                   if path is not None and not (what == "--json"
                                                and path == "-")]
        try:
            for what, path in outputs:
                check_output_path(path, what, args.command)
        except ValueError as e:
            args.subparser.error(str(e))
        if (len(outputs) == 2 and os.path.realpath(args.json)
                == os.path.realpath(args.plot)):
            args.subparser.error(
                f"--json and --plot name the same file {args.json!r}: the "
                "chart would overwrite the results. Give each its own path.")
    return args


def _check_launch(args: argparse.Namespace) -> None:
    if args.program and args.program[0] == "--":
        args.program = args.program[1:]
    if not args.program:
        args.subparser.error(
            "no command to run: put it after '--', e.g. keras-mgpu launch "
            "--workers 2 -- python train.py")
    try:
        check_program(args.program)
    except OSError as e:
        args.subparser.error(str(e))
    if args.min_workers is not None and args.min_workers > args.workers:
        args.subparser.error(
            f"--min-workers {args.min_workers} is more than --workers "
            f"{args.workers}: give at most as many as --workers.")
    if (args.hang_timeout is None) != (args.progress_file is None):
        args.subparser.error(
            "--hang-timeout and --progress-file go together: the workers "
            "are restarted when that file has not changed for that long. "
            "Pass both, or neither.")


def check_program(command: Sequence[str], cwd: Optional[str] = None,
                  env: Optional[Mapping[str, str]] = None) -> None:
    """Checks that a worker's command line names a program that can run,
    before any worker starts (where the workers' `Popen` looks: `PATH`
    of `env`, or a path relative to `cwd`).

    Raises:
        FileNotFoundError: no such program.
        PermissionError: it is not an executable file.
    """
    program = command[0]
    if os.sep not in program:
        search = (env if env is not None else os.environ).get("PATH")
        if shutil.which(program, path=search) is None:
            raise FileNotFoundError(
                f"the command {program!r} is not found on PATH. Give its "
                "path, or install it (a Python script: put python before "
                "it).")
        return
    path = os.path.join(cwd or os.getcwd(), program)
    if not os.path.exists(path):
        raise FileNotFoundError(f"the command {program!r} does not exist.")
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise PermissionError(
            f"the command {program!r} is not an executable file. Make it "
            "one (chmod +x), or run it with its interpreter (python "
            f"{program}).")
