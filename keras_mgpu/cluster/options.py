"""What a local cluster run starts its workers with, checked before the
first worker starts: the command for a target (a command line, a script,
a function run by a small bootstrap) and every option of `launch` and
`run_local_workers`."""

from __future__ import annotations

import json
import math
import numbers
import os
import signal
import sys
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

from keras_mgpu._checks import (
    is_flag,
    is_integer,
    is_nonempty_path,
    is_positive_integer,
)
from keras_mgpu.cluster.processes import check_open_files
from keras_mgpu._args import check_program

# The file a function target's JSON result is written to, and a script's.
RESULT_ENV = "KERAS_MGPU_RESULT"
"""The environment variable naming the file a worker's JSON result is
written to (a function target's return value, or a script's own)."""

Target = Union[str, Sequence[str], Callable[..., Any]]
"""What `launch` and `run_local_workers` run in each worker: a script path
or `"module:function"` string, a command line (a list of strings) or a
module-level function."""


def _command(target: Target, kwargs: Mapping[str, Any], args: Sequence[str]):
    if isinstance(target, (list, tuple)):
        # A command line, run as given (`keras-mgpu launch -- python ...`).
        if not target or not all(isinstance(a, str) for a in target):
            raise TypeError(
                f"A command target must be a non-empty list of strings, got "
                f"{target!r}, e.g. ['python', 'train.py', '--epochs', '2'].")
        if kwargs or args:
            raise ValueError(
                f"kwargs and args are for a function or script target, but "
                f"{list(target)!r} is a command line: put its arguments in "
                "the list.")
        return list(target)
    if callable(target):
        module = getattr(target, "__module__", None)
        qualname = getattr(target, "__qualname__", None)
        if module == "__main__":
            raise ValueError(
                f"Cannot run {target!r} in a worker: it is defined in "
                "__main__. Move it into an importable module, or pass the "
                "path of a script."
            )
        if not module or not qualname or "<" in qualname:
            # A lambda, a nested function or a partial has no name a worker
            # could import; it would fail only once every worker started.
            raise ValueError(
                f"Cannot run {target!r} in a worker: only a module-level "
                "function can be imported there. Define it at the top level "
                "of an importable module, or pass the path of a script."
            )
        target = f"{module}:{qualname}"
    if not isinstance(target, str):
        raise TypeError(
            f"target must be a script path, a 'module:function' string or a "
            f"module-level function, got {target!r}."
        )
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise FileNotFoundError(f"No script at {target!r}.")
        if kwargs:
            raise ValueError(
                f"kwargs are for a function target, but {target!r} is a "
                f"script (got kwargs={dict(kwargs)!r}). Pass command-line "
                "arguments with args=[...] instead."
            )
        return [sys.executable, target, *args]
    if ":" not in target:
        raise ValueError(
            f"target {target!r} is neither a '.py' script nor a "
            "'module:function' string."
        )
    if args:
        raise ValueError(
            f"args are for a script target, but {target!r} is a function "
            f"(got args={list(args)!r}). Pass its arguments with "
            "kwargs={...} instead."
        )
    try:
        encoded = json.dumps(dict(kwargs))
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"kwargs must be JSON-serialisable, as they reach each worker as "
            f"JSON ({e}); got {dict(kwargs)!r}. Pass lists, numbers and "
            "strings (e.g. array.tolist()) or paths to files."
        ) from None
    # The function's module is importable here: the worker, the same
    # interpreter, searches where this process does (given to the
    # bootstrap, not to PYTHONPATH, which every process the worker starts
    # would inherit).
    search_path = json.dumps([p for p in sys.path if p])
    return [sys.executable, "-c", _BOOTSTRAP, target, encoded, search_path]


def check_timeout(value, name: str, hint: str = "") -> None:
    # A string would fail only in the wait, after every worker started; NaN
    # or inf would never time out.
    if (not isinstance(value, numbers.Real) or isinstance(value, bool)
            or not math.isfinite(value) or value <= 0):
        raise ValueError(
            f"{name} must be a positive, finite number of seconds, got "
            f"{value!r}.{hint}")


def worker_count(num_workers) -> int:
    if not is_positive_integer(num_workers):
        raise ValueError(
            f"num_workers must be a positive integer, got {num_workers!r}."
        )
    return int(num_workers)


def worker_setup(target, num_workers: int, kwargs, args, env, cwd,
                  labels) -> tuple:
    """Checks what every cluster run starts its workers with; returns (the
    command, the labels, each worker's extra environment)."""
    if cwd is not None:
        if not is_nonempty_path(cwd):
            raise TypeError(
                f"cwd must be a directory path or None, got {cwd!r}."
            )
        if not os.path.isdir(cwd):
            raise FileNotFoundError(
                f"cwd {os.fspath(cwd)!r} is not a directory. Create it, or "
                "pass an existing one."
            )
    command = _command(target, _check_kwargs(kwargs), _check_args(args))
    labels = _check_labels(labels, num_workers)
    # A bad environment fails Popen for one worker after the others started.
    extras = [_check_env(env(i) if callable(env) else env, i, env)
              for i in range(num_workers)]
    # Popen would fail only once the launcher had started (the supervisor
    # imports TensorFlow), with a traceback.
    check_program(command, cwd, {**os.environ, **extras[0]})
    check_open_files(num_workers)
    return command, labels, extras


def check_options(timeout, marker, kill_workers, num_workers, kill_signal,
                   check) -> set:
    """Checks the scalar options; returns the indices to kill on `marker`."""
    check_timeout(timeout, "timeout", " Pass a number, e.g. timeout=300: "
                   "every cluster run has a deadline, so a hung worker "
                   "cannot hang the caller.")
    if marker is not None:
        if not isinstance(marker, str):
            raise TypeError(
                f"kill_when_printed must be a str (text a worker prints) or "
                f"None, got {marker!r}."
            )
        if not marker:
            raise ValueError(
                "kill_when_printed must be non-empty text, got '': every "
                "output contains it, so the workers would be killed at once."
            )
    to_kill = set(range(num_workers))
    if kill_workers is not None:
        if marker is None:
            raise ValueError(
                f"kill_workers={kill_workers!r} needs kill_when_printed: "
                "the workers are killed when that text is printed. Pass "
                "both, or neither."
            )
        if (isinstance(kill_workers, (str, bytes, Mapping))
                or not isinstance(kill_workers, Iterable)):
            raise TypeError(
                f"kill_workers must be a list of worker indices, got "
                f"{kill_workers!r}."
            )
        indices = list(kill_workers)
        bad = [i for i in indices
               if not is_integer(i) or not 0 <= i < num_workers]
        if bad:
            raise ValueError(
                f"kill_workers must hold worker indices from 0 to "
                f"{num_workers - 1} (num_workers={num_workers}), got "
                f"{kill_workers!r}."
            )
        to_kill = {int(i) for i in indices}
    if not is_integer(kill_signal) or kill_signal not in signal.valid_signals():
        # Signal 0 only probes a process: the workers would not be killed.
        raise ValueError(
            f"kill_signal must be a signal this platform knows, e.g. "
            f"signal.SIGTERM or signal.SIGKILL, got {kill_signal!r}."
        )
    if not is_flag(check):
        raise TypeError(
            f"check must be True or False, got {check!r} (a non-empty string "
            "such as 'false' would count as True)."
        )
    return to_kill


def _check_labels(labels, num_workers: int) -> list:
    if labels is None:
        return [f"worker {i}" for i in range(num_workers)]
    if (isinstance(labels, (str, bytes)) or not isinstance(labels, Sequence)
            or len(labels) != num_workers
            or not all(isinstance(label, str) for label in labels)):
        raise TypeError(
            f"labels must be a list of {num_workers} strings (one name per "
            f"worker), got {labels!r}."
        )
    return list(labels)


def _check_kwargs(kwargs) -> Mapping[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(
            isinstance(k, str) for k in kwargs):
        raise TypeError(
            f"kwargs must be a mapping of argument names to values, got "
            f"{kwargs!r}."
        )
    return kwargs


def _check_args(args) -> list:
    # A string would be spread into one argument per character.
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(
            f"args must be a list of command-line arguments, got {args!r}. "
            "Split it, e.g. args=['--epochs', '2']."
        )
    bad = [a for a in args if not isinstance(a, (str, os.PathLike))]
    if bad:
        raise TypeError(
            f"args must all be strings, got {bad!r} in {list(args)!r}. "
            "Convert them, e.g. str(2)."
        )
    return list(args)


def _check_env(extra, index: int, env) -> dict:
    if extra is None:
        return {}
    what = f"env({index})" if callable(env) else "env"
    if not isinstance(extra, Mapping):
        raise TypeError(
            f"{what} must be a mapping of variable names to values, got "
            f"{extra!r}."
        )
    bad = {k: v for k, v in extra.items()
           if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise TypeError(
            f"{what} must map strings to strings, got {bad!r}. Convert the "
            "values, e.g. {'CUDA_VISIBLE_DEVICES': str(index)}."
        )
    return dict(extra)


# Runs in the worker: imports only the target's module (not keras_mgpu, so a
# worker starts fast), calls it, and commits its JSON result atomically.
_BOOTSTRAP = """
import importlib, json, os, sys
sys.path += [p for p in json.loads(sys.argv[3]) if p not in sys.path]
module_name, _, qualname = sys.argv[1].partition(":")
fn = importlib.import_module(module_name)
for part in qualname.split("."):
    fn = getattr(fn, part)
result = fn(**json.loads(sys.argv[2]))
path = os.environ.get("%s")
if path:
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
""" % RESULT_ENV
