"""Every use of Keras and TensorFlow private internals, in one place.

Each workaround is decided by what the installed Keras does, not by a
version range that could switch it off while the bug is still there: a
private name is looked up where it is first used (`KerasInternalsError`,
naming the Keras version, when it is missing or has another shape), and a
Keras outside the tested range (`TESTED_KERAS`) gets one warning
(`UntestedKerasWarning`) that says what is unverified on it. The version is
read when it is needed, so tests can simulate another Keras.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import os
import threading
import warnings
import weakref
from typing import Optional

import keras
import numpy as np
from packaging.version import Version


@dataclasses.dataclass(frozen=True)
class VersionRange:
    """Keras versions from `low` to `high`, both included, and `nightlies`.

    Args:
        low: The oldest version, e.g. `"3.10.0"`.
        high: The newest version, e.g. `"3.15.1"`.
        nightlies: Development versions outside the range that are
            included one by one, e.g. `("3.16.0.dev2026102704",)`.
            Defaults to none.

    Example:

    >>> VersionRange("3.10.0", "3.15.1").contains("3.12.0")
    True
    """

    low: str
    high: str
    nightlies: tuple = ()

    def contains(self, version) -> bool:
        """Whether `version` (a string or `Version`) lies in the range or
        is one of its nightlies."""
        version = _parse(str(version))
        return (_parse(self.low) <= version <= _parse(self.high)
                or version in map(_parse, self.nightlies))

    def __str__(self) -> str:
        nightlies = "".join(f" and the nightly {v}" for v in self.nightlies)
        return f"{self.low} to {self.high}{nightlies}"


@functools.lru_cache(maxsize=64)
def _parse(version: str) -> Version:
    # Checked on every private lookup (per logger record, say): parse once.
    return Version(version)


# What the suite has been run on (docs/compatibility.md, noxfile.py): the
# oldest pair's Keras, the newest release, and the newest keras-nightly the
# noxfile's `nightly` environment passed on.
TESTED_KERAS = VersionRange("3.10.0", "3.15.1",
                            nightlies=("3.16.0.dev2026102704",))

@dataclasses.dataclass(frozen=True)
class Workaround:
    """One thing keras-mgpu does through a private Keras, TensorFlow or
    KerasTuner name, and why: one record each, shown as the table of
    docs/compatibility.md (`workarounds_table()`).

    Args:
        name: What it is for, as `KerasInternalsError` and
            `UntestedKerasWarning` name it.
        upstream: The upstream issue, pull request or source it answers.
        works_around: What is missing or wrong upstream.
        applied: When keras-mgpu applies it.
        remove_when: The condition under which it can go.

    Example:

    >>> any(w.name.startswith("the multi-worker fit fix")
    ...     for w in WORKAROUNDS)
    True
    """

    name: str
    upstream: str
    works_around: str
    applied: str
    remove_when: str


_RECORDS = []


def _workaround(name: str, **fields) -> str:
    _RECORDS.append(Workaround(name=name, **fields))
    return name


_KERAS = "https://github.com/keras-team/keras"
_KERAS_TF = f"{_KERAS}/blob/v3.15.1/keras/src/backend/tensorflow"
_TUNER_SRC = ("https://github.com/keras-team/keras-tuner/blob/v1.4.8/"
              "keras_tuner/src/engine")
_MULTI_WORKER_FIX = _workaround(
    "the multi-worker fit fix (keras-team/keras#20585)",
    upstream=f"{_KERAS}/issues/20585",
    works_around="`fit`, `evaluate` and `predict` fail under "
    "MultiWorkerMirroredStrategy: the symbolic build reduces the first "
    "batch across workers, and scalar logs are reduced with `axis=0`",
    applied="by `auto_strategy()` and `GradientAccumulationModel` on a "
    "multi-worker strategy; acts only there",
    remove_when="keras-team/keras#20585 is fixed: "
    "`test_stock_keras_multi_worker_fit_still_needs_the_workaround` fails")
_MULTI_STEP_FIX = _workaround(
    "the steps_per_execution fix for several replicas",
    upstream=f"{_KERAS}/issues/19246",
    works_around="Keras's multi-step loop runs each step in a `tf.cond` "
    "inside a `tf.while_loop`, which fails on more than one replica "
    "(`You must feed a value for placeholder tensor .../while/cond/"
    "Placeholder`)",
    applied="by `auto_strategy()` and `GradientAccumulationModel`; acts "
    "where `steps_per_execution > 1` on more than one replica",
    remove_when="Keras's own loop runs on two replicas: "
    "`test_steps_per_execution_on_two_replicas_matches_one` passes with "
    "the fix off")
_EXACT_CLIPPING = _workaround(
    "exact gradient clipping under a strategy (clipping the all-reduced "
    "gradient)",
    upstream=f"{_KERAS}/pull/19969",
    works_around="Keras's TensorFlow optimizer clips each replica's "
    "gradient before the all-reduce (since keras-team/keras#19467 and "
    "#19969), so a clipped step differs from one device's",
    applied="by `auto_strategy()`; acts for an optimizer that clips, on "
    "more than one replica",
    remove_when="Keras clips the all-reduced gradient: "
    "`test_stock_keras_still_clips_each_replica` fails")
_ACCUMULATION = _workaround(
    "GradientAccumulationModel's train step and optimizer hooks",
    upstream=f"{_KERAS}/issues/20582",
    works_around="Keras's own `gradient_accumulation_steps` fails under "
    "a strategy and all-reduces every micro-batch; accumulating needs "
    "Keras's loss, loss tracker, all-reduce and LossScaleOptimizer branches, "
    "which have no public API",
    applied="by `GradientAccumulationModel`",
    remove_when="Keras accumulates exactly under a strategy with one "
    "all-reduce per optimizer step (keras-team/keras#20582)")
_MIXED = _workaround(
    "the mixed-precision audit",
    upstream=f"{_KERAS}/blob/v3.15.1/keras/src/layers/layer.py",
    works_around="Keras has no public way to list a layer's own "
    "variables, sublayers, autocasting or a tensor's producing layer",
    applied="by `keras_mgpu.mixed_precision.audit`, `FP32OutputHead` and "
    "`LossScaleMonitor`",
    remove_when="Keras exposes those (no upstream issue yet)")
_BACKUP = _workaround(
    "BackupAndRestore's resume hooks",
    upstream=f"{_KERAS}/blob/v3.15.1/keras/src/saving/saving_lib.py",
    works_around="`fit` can only be started at an epoch through "
    "`model._initial_epoch`; weights can be neither snapshotted to host "
    "memory without a file nor loaded from bytes; callbacks cannot see "
    "their `CallbackList`",
    applied="by `BackupAndRestore` and its presets",
    remove_when="`Model.load_weights` accepts a file object and Keras "
    "exposes a mid-epoch resume (no upstream issue yet)")
_STREAM = _workaround(
    "BackupAndRestore's resume of a data stream kept across epochs",
    upstream=f"{_KERAS_TF}/trainer.py",
    works_around="with `steps_per_epoch`, `fit` keeps one data iterator "
    "across epochs and counts the batches it handed out, with no public "
    "position to resume from",
    applied="by `BackupAndRestore` where the data outlives an epoch",
    remove_when="Keras exposes the epoch iterator's position (no upstream "
    "issue yet)")
_TELEMETRY = _workaround(
    "the training runtime's sample count",
    upstream=f"{_KERAS_TF}/trainer.py",
    works_around="the number of samples trained on is kept only in the "
    "loss tracker's private `count`",
    applied="by the training runtime (every callback of keras-mgpu)",
    remove_when="Keras reports samples seen (no upstream issue yet)")
_INPUT_WAIT = _workaround(
    "the training runtime's input-wait timing",
    upstream=f"{_KERAS_TF}/trainer.py",
    works_around="Keras fetches batches inside its compiled train "
    "function, where a callback can neither time the fetch nor count the "
    "batches of a call where the data ends",
    applied="by the training runtime, with input timing on or "
    "`steps_per_execution > 1`",
    remove_when="Keras reports input wait and batches per call (no "
    "upstream issue yet)")
_SUMMARIES = _workaround(
    "DistributedLogger's recording of the model's summaries",
    upstream="https://github.com/tensorflow/tensorflow/blob/v2.21.0/"
    "tensorflow/python/ops/summary_ops_v2.py",
    works_around="`tf.summary`'s default writer can only be set with a "
    "flush of the writer on every exit",
    applied="by `DistributedLogger` around each train step",
    remove_when="TensorFlow sets a default writer without a flush (no "
    "upstream issue yet)")
_STARTUP_DEADLINE = _workaround(
    "auto_strategy(startup_timeout=...)",
    upstream="https://github.com/tensorflow/tensorflow/blob/v2.21.0/"
    "tensorflow/python/distribute/collective_all_reduce_strategy.py",
    works_around="MultiWorkerMirroredStrategy waits forever for a worker "
    "that never starts",
    applied="by `auto_strategy(startup_timeout=...)` under a multi-worker "
    "`TF_CONFIG`",
    remove_when="the strategy takes a registration deadline (no upstream "
    "issue yet)")
_TUNER = _workaround(
    "the tuner's learning-rate scaling",
    upstream=f"{_KERAS}/blob/v3.15.1/keras/src/optimizers/base_optimizer.py",
    works_around="an optimizer's schedule is kept only in `_learning_rate`",
    applied="by `StrategyAwareHyperModel` when it scales the learning rate",
    remove_when="Keras exposes the schedule (no upstream issue yet)")
_TUNER_STATE = _workaround(
    "the tuner's oracle-state fix (KerasTuner's ongoing trials)",
    upstream=f"{_TUNER_SRC}/oracle.py",
    works_around="KerasTuner 1.4.8 saves `oracle.json` before it takes an "
    "ended trial out of `ongoing_trials`, so a rerun trains a finished "
    "trial again",
    applied="by `StrategyAwareHyperModel` and `keras_mgpu.tuner.launch`",
    remove_when="KerasTuner saves in the other order: "
    "`test_kerastuner_still_saves_an_ended_trial_as_ongoing` fails")
_TUNER_BEST = _workaround(
    "the resumed trial's best checkpoint (KerasTuner's SaveBestEpoch)",
    upstream=f"{_TUNER_SRC}/tuner_utils.py",
    works_around="KerasTuner's `SaveBestEpoch` starts each `fit` at "
    "-inf/inf, so a resumed trial would take its first resumed epoch as "
    "the best",
    applied="by `StrategyAwareHyperModel`'s per-trial backups",
    remove_when="KerasTuner restores `best_value` itself (no upstream "
    "issue yet)")

# Every record, in the order of docs/compatibility.md's table.
WORKAROUNDS = tuple(_RECORDS)
_WORKAROUNDS = tuple(record.name for record in WORKAROUNDS)


def workarounds_table() -> str:
    """`WORKAROUNDS` as the Markdown table docs/compatibility.md shows.

    Example:

    >>> workarounds_table().splitlines()[0]
    '| for | upstream | works around | applied | can go when |'
    """
    lines = ["| for | upstream | works around | applied | can go when |",
             "|---|---|---|---|---|"]
    for w in WORKAROUNDS:
        link = w.upstream.removeprefix("https://github.com/")
        lines.append(f"| {w.name} | [{link}]({w.upstream}) | "
                     f"{w.works_around} | {w.applied} | {w.remove_when} |")
    return "\n".join(lines)


class KerasInternalsError(RuntimeError):
    """A Keras internal that keras-mgpu relies on is missing or has changed."""


class UntestedKerasWarning(UserWarning):
    """The installed Keras is outside the versions keras-mgpu was tested on."""


def keras_version() -> Version:
    """The installed Keras version, read now (not at import).

    Example:

    >>> keras_version() >= Version("3.0")
    True
    """
    return _parse(keras.__version__)


_warned_versions = set()


def warn_if_untested() -> bool:
    """Warns once per Keras version outside `TESTED_KERAS`; returns whether
    this Keras is untested.

    Example:

    >>> warn_if_untested() == (not TESTED_KERAS.contains(keras_version()))
    True
    """
    version = keras.__version__
    if TESTED_KERAS.contains(version):
        return False
    if version not in _warned_versions:
        _warned_versions.add(version)
        from keras_mgpu import __version__ as ours

        warnings.warn(
            f"keras-mgpu {ours} was tested with Keras {TESTED_KERAS}, but "
            f"Keras {version} is installed. Each Keras internal keras-mgpu "
            f"relies on is checked where it is first used (a missing or "
            f"reshaped one is refused with KerasInternalsError), but what "
            f"these do on Keras {version} is unverified: "
            f"{'; '.join(_WORKAROUNDS)}. "
            f"Run keras-mgpu's test suite on this Keras, or install "
            f"keras>={TESTED_KERAS.low},<={TESTED_KERAS.high}.",
            UntestedKerasWarning,
            stacklevel=3,
        )
    return True


def _internals_error(what: str, used_for: str) -> KerasInternalsError:
    from keras_mgpu import __version__ as ours

    return KerasInternalsError(
        f"keras-mgpu needs {what} for {used_for}, but Keras "
        f"{keras.__version__} does not have it. keras-mgpu {ours} was tested "
        f"with Keras {TESTED_KERAS}: install "
        f"keras>={TESTED_KERAS.low},<={TESTED_KERAS.high}, or a keras-mgpu "
        f"release that supports Keras {keras.__version__}."
    )


_MISSING = object()


def _lookup(owner, name: str):
    # The one read of a private name (tests take names away through it).
    return getattr(owner, name, _MISSING)


def _import_module(path: str):
    # The one import of a private module (tests take modules away here).
    return importlib.import_module(path)


def _require(owner, name: str, used_for: str, params=None):
    """`owner.name`, checked: raises `KerasInternalsError` if it is missing,
    or (with `params`) if its leading parameters are not `params`."""
    warn_if_untested()
    qualname = f"`{_owner_name(owner)}.{name}`"
    value = _lookup(owner, name)
    if value is _MISSING:
        raise _internals_error(qualname, used_for)
    if params is not None:
        try:
            found = tuple(inspect.signature(value).parameters)[: len(params)]
        except (TypeError, ValueError):
            found = None
        if found != tuple(params):
            raise _internals_error(
                f"{qualname} with parameters {tuple(params)} (found {found})",
                used_for,
            )
    return value


def _owner_name(owner) -> str:
    return getattr(owner, "__name__", None) or type(owner).__name__


def _require_module(path: str, used_for: str):
    """The private module `path` (e.g. `keras.src.saving.saving_lib`),
    checked: a Keras, TensorFlow or KerasTuner that moved it gets
    `KerasInternalsError`, not an `ImportError` from deep inside a fit."""
    warn_if_untested()
    try:
        return _import_module(path)
    except ImportError:
        raise _internals_error(f"the module `{path}`", used_for) from None


_TF_TRAINER = "keras.src.backend.tensorflow.trainer"
_SAVING_LIB = "keras.src.saving.saving_lib"


def trainer_class(used_for: str = _MULTI_STEP_FIX) -> type:
    """Keras's TensorFlow trainer: the class of `_TF_TRAINER` that
    `keras.Model` derives from (`TensorFlowTrainer` up to Keras 3.15,
    `Trainer` since keras-team/keras#23397).

    Example:

    >>> issubclass(keras.Model, trainer_class())
    True
    """
    module = _require_module(_TF_TRAINER, used_for)
    for cls in keras.Model.__mro__:
        if cls.__module__ == module.__name__:
            return cls
    raise _internals_error(
        f"a trainer class of `{_TF_TRAINER}` among `keras.Model`'s bases",
        used_for)


# --- Keras functions keras-mgpu runs a copy of -------------------------------
# A copy is right only for the original it was copied from, so the original
# is checked before the copy runs: its shape (its syntax tree without
# docstrings, comments or layout, hashed) must be one of those below. A
# Keras whose original changed is refused (`KerasInternalsError`) until the
# copy is checked against the new original and its shape added here.
# `python -m keras_mgpu.compat` prints the installed Keras's shapes.

# shape -> the variant of the original the copy knows, by function.
_KNOWN_SHAPES = {
    # The multi-step loop (`enable_multi_step_fit`) and the train function
    # the runtime's twin re-creates (`instrumented_train_function`). Up to
    # 3.15 every batch is fetched inside `multi_step_on_iterator`; in the
    # 3.16 nightlies (whose `steps_per_execution` paths keras-team/keras#23179
    # and #23305 change) a one-step call fetches its batch on the host.
    "_make_function": {
        "77e5711252cfdcbe": "graph_fetch",  # 3.10.0 to 3.11.3
        "86a5dfca54cf6ca3": "graph_fetch",  # 3.12.0 to 3.15.1
        "9c7b75ec53a7c04d": "host_fetch_one_step",  # 3.16.0.dev2026102704
    },
    # The symbolic build `enable_multi_worker_fit` does on one replica.
    "_maybe_symbolic_build": {
        "e69d77e6d0785be0": "reduce_first_batch",  # 3.10.0
        "fd64b7a638fde084": "reduce_first_batch",  # 3.11.0 to 3.16 nightly
    },
    # `weights_layout`/`weights_file` and `load_weights_file`: what these do
    # for a `.weights.h5` file, without the file.
    "save_weights_only": {
        "8f0c31d2d4fdf80f": "h5_store",  # 3.10.0 to 3.14.1
        "76642524f44a30e8": "h5_store",  # 3.15.0 to 3.16 nightly
    },
    "load_weights_only": {
        "efcd49864c49a7a2": "h5_store",  # 3.10.0 to 3.14.1
        "b254a1d3be333bcd": "h5_store",  # 3.15.0 to 3.15.1
        "9bac267aa6720ead": "h5_store",  # 3.16.0.dev2026102704
    },
}


@functools.lru_cache(maxsize=16)
def _shape_of(function) -> str:
    """A hash of `function`'s source as Python parses it: the same for the
    same code whatever its comments, docstrings, layout or Python version."""
    import ast
    import textwrap

    source = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
    return _shape_of_tree(ast.parse(source).body[0])


def _shape_of_tree(tree) -> str:
    import ast
    import hashlib

    def without_docstring(body):
        if (body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            return body[1:]
        return body

    def dump(node):
        if isinstance(node, list):
            return [dump(item) for item in node]
        if not isinstance(node, ast.AST):
            return repr(node)
        fields = []
        for name in node._fields:
            # Fields some Python versions add or fill in: not the code's.
            if name in ("type_params", "type_comment", "kind"):
                continue
            value = getattr(node, name, None)
            if name == "body" and isinstance(
                    node, (ast.FunctionDef, ast.AsyncFunctionDef,
                           ast.ClassDef)):
                value = without_docstring(value)
            fields.append((name, dump(value)))
        return [type(node).__name__, fields]

    return hashlib.sha256(repr(dump(tree)).encode()).hexdigest()[:16]


def _copied_originals() -> dict:
    """`{name: (owner, used_for)}` of every Keras function in
    `_KNOWN_SHAPES`."""
    saving_lib = _saving_lib()
    return {
        "_make_function": (trainer_class(), _MULTI_STEP_FIX),
        "_maybe_symbolic_build": (trainer_class(), _MULTI_WORKER_FIX),
        "save_weights_only": (saving_lib, _BACKUP),
        "load_weights_only": (saving_lib, _BACKUP),
    }


def _copied_variant(owner, name: str, used_for: str) -> str:
    """The known variant of Keras's `owner.name`, which keras-mgpu runs a
    copy of; `KerasInternalsError` if its shape is not a known one."""
    function = _require(owner, name, used_for)
    # Keras's own, where keras-mgpu has put its copy in its place.
    function = getattr(function, "keras_stock", function)
    key = f"{_owner_name(owner)}.{name}"
    known = _KNOWN_SHAPES[name]
    try:
        shape = _shape_of(function)
    except (OSError, TypeError, SyntaxError):
        shape = None
    if shape not in known:
        raise _internals_error(
            f"`{key}` as keras-mgpu copied it (its code on this Keras has "
            f"shape {shape}, not one of {sorted(known)}: keras-mgpu's copy "
            "may no longer do what Keras's own does)", used_for)
    return known[shape]


# --- keras-team/keras#20585: fit under MultiWorkerMirroredStrategy ----------
# Still open (measured broken on 3.10.0 and 3.15.1). The fix replaces two
# functions of Keras's TensorFlow trainer with versions that are also right
# where the bug is gone, so it is applied whenever those functions have the
# shape it was written for, whatever the version says.

_lock = threading.Lock()
_multi_worker_fit_enabled = False


def multi_worker_fit_enabled() -> bool:
    """Whether `enable_multi_worker_fit()` has patched Keras in this process."""
    return _multi_worker_fit_enabled


def enable_multi_worker_fit() -> bool:
    """Makes `fit`, `evaluate` and `predict` work under MultiWorkerMirroredStrategy.

    Works around keras-team/keras#20585 in Keras's TensorFlow trainer:
    - the symbolic build before training reduces the first batch with
      `strategy.reduce("MEAN", batch, axis=None)`, which fails on a
      multi-worker `PerReplica` batch; only its shapes are needed, so the
      first local replica's batch is used instead, with no collective;
    - scalar logs are reduced with `strategy.reduce("MEAN", v, axis=0)`,
      which fails for a 0-d tensor; they are reduced with `axis=None`.

    Both replacements act only under a multi-worker strategy and are correct
    with or without the bug, so the patch is applied on every Keras whose
    trainer has the two functions in the expected shape; otherwise it raises
    `KerasInternalsError` naming the Keras version, before any training. It
    is idempotent and never applied by `import keras_mgpu`.

    Returns:
        `True`: the patch is active after the call.

    Example:

    >>> from keras_mgpu import compat
    >>> compat.enable_multi_worker_fit()
    True
    >>> compat.multi_worker_fit_enabled()
    True
    """
    global _multi_worker_fit_enabled
    with _lock:
        if _multi_worker_fit_enabled:
            return True
        tf_trainer = _require_module(_TF_TRAINER, _MULTI_WORKER_FIX)
        trainer = trainer_class(_MULTI_WORKER_FIX)
        original_reduce = _require(
            tf_trainer, "reduce_per_replica", _MULTI_WORKER_FIX,
            params=("values", "strategy", "reduction"))
        original_build = _require(
            trainer, "_maybe_symbolic_build",
            _MULTI_WORKER_FIX, params=("self", "iterator", "data_batch"))
        _copied_variant(trainer, "_maybe_symbolic_build", _MULTI_WORKER_FIX)
        _require(trainer, "_symbolic_build", _MULTI_WORKER_FIX,
            params=("self", "iterator", "data_batch"))
        is_multi_worker = _require(
            tf_trainer, "_collective_all_reduce_multi_worker",
            _MULTI_WORKER_FIX)
        is_per_replica = _require(
            tf_trainer, "_is_per_replica_instance", _MULTI_WORKER_FIX)
        tree = keras.tree

        def first_local(v, strategy):
            return (strategy.experimental_local_results(v)[0]
                    if is_per_replica(v) else v)

        def reduce_per_replica(values, strategy, reduction):
            if reduction not in ("auto", "mean", "sum") or not (
                is_multi_worker(strategy)
            ):
                return original_reduce(values, strategy, reduction)
            op = "SUM" if reduction == "sum" else "MEAN"

            def reduce(v):
                axis = None if first_local(v, strategy).shape.rank == 0 else 0
                return strategy.reduce(op, v, axis=axis)

            return tree.map_structure(reduce, values)

        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            # Set by the trainer's `__init__`: read on the model, before
            # anything is built or trained.
            strategy = _require(self, "_distribute_strategy",
                                _MULTI_WORKER_FIX)
            if (
                strategy is None
                or iterator is None
                or not is_multi_worker(strategy)
            ):
                return original_build(self, iterator, data_batch)
            # The epoch iterator yields (step, iterator) in Keras 3.10 and
            # (begin, end, iterator) in 3.15: the iterator comes last.
            for *_, it in iterator:
                batch = next(it)
                data_batch = tree.map_structure(
                    lambda v: first_local(v, strategy), batch)
                break
            with strategy.scope():
                self._symbolic_build(data_batch=data_batch)

        _maybe_symbolic_build.keras_stock = original_build
        tf_trainer.reduce_per_replica = reduce_per_replica
        trainer._maybe_symbolic_build = _maybe_symbolic_build
        _multi_worker_fit_enabled = True
    return True


# --- steps_per_execution on several replicas ---------------------------------
# Keras's multi-step loop runs each step inside a `tf.cond` on its end-of-data
# `Optional`, within a `tf.while_loop`; on more than one replica TensorFlow
# then fails ("You must feed a value for placeholder tensor
# .../while/cond/Placeholder"), for plain models and for every train step.
# The loop's own condition already checks that `Optional`, so the step needs
# no `tf.cond`: the replacement is Keras's loop without it.

_multi_step_fit_enabled = False


def multi_step_fit_enabled() -> bool:
    """Whether `enable_multi_step_fit()` has patched Keras in this process."""
    return _multi_step_fit_enabled


def enable_multi_step_fit() -> bool:
    """Makes `steps_per_execution > 1` work on more than one replica.

    Replaces the multi-step loop Keras's TensorFlow trainer builds for `fit`
    and `evaluate` when `steps_per_execution > 1` and the strategy has more
    than one replica (`MirroredStrategy`, `MultiWorkerMirroredStrategy`),
    where Keras's own loop fails to run. The replacement runs the same steps
    in the same order, fetches each batch only when it is about to be
    trained (no batch skipped or repeated at the end of the data, whether
    its length is known or not), and ends the epoch together on every worker
    (the distributed iterator agrees on the end of data). On one replica, or
    with `steps_per_execution=1`, Keras's own function is used unchanged.

    Applied by `keras_mgpu.auto_strategy()` and `GradientAccumulationModel`,
    never by `import keras_mgpu`. It is decided by the trainer's shape, not a
    version: a Keras whose `TensorFlowTrainer._make_function` has another
    signature gets `KerasInternalsError` here, before any training. It is
    idempotent.

    Returns:
        `True`: the patch is active after the call.

    Example:

    >>> from keras_mgpu import compat
    >>> compat.enable_multi_step_fit()
    True
    >>> compat.multi_step_fit_enabled()
    True
    """
    global _multi_step_fit_enabled
    with _lock:
        if _multi_step_fit_enabled:
            return True
        import tensorflow as tf

        tf_trainer = _require_module(_TF_TRAINER, _MULTI_STEP_FIX)
        trainer = trainer_class(_MULTI_STEP_FIX)
        original = _require(trainer, "_make_function", _MULTI_STEP_FIX,
                            params=("self", "step_function"))
        _copied_variant(trainer, "_make_function", _MULTI_STEP_FIX)
        _require(tf_trainer, "reduce_per_replica", _MULTI_STEP_FIX,
                 params=("values", "strategy", "reduction"))

        def _make_function(self, step_function):
            strategy = self.distribute_strategy
            steps = self.steps_per_execution
            if steps == 1 or strategy.num_replicas_in_sync == 1:
                return original(self, step_function)
            # Set below while the loop is traced, where an error would
            # reach the user wrapped in TensorFlow's: checked here.
            _require(tf.experimental.Optional.empty(None), "_element_spec",
                     _MULTI_STEP_FIX)

            @tf.autograph.experimental.do_not_convert
            def one_step_on_data(data):
                outputs = strategy.run(step_function, args=(data,))
                # Looked up per call: the multi-worker fix may replace it.
                return tf_trainer.reduce_per_replica(
                    outputs, strategy, reduction="auto")

            if not self.run_eagerly:
                one_step_on_data = tf.function(
                    one_step_on_data, reduce_retracing=True,
                    jit_compile=self.jit_compile)
            # Keras 3.15 turns `Optional` inputs into None; 3.10 has no such
            # step.
            autoconvert = getattr(self, "_autoconvert_optionals", None)
            if autoconvert is not None:
                one_step_on_data = autoconvert(one_step_on_data)

            @tf.autograph.experimental.do_not_convert
            def multi_step_on_iterator(iterator):
                # Its element spec is set while the loop body is traced, as
                # Keras's own loop does.
                empty = tf.experimental.Optional.empty(None)

                def cond(step, outputs, next_inputs):
                    return tf.logical_and(step < steps, next_inputs.has_value())

                def body(step, outputs, next_inputs):
                    outputs = tf.experimental.Optional.from_value(
                        one_step_on_data(next_inputs.get_value()))
                    empty._element_spec = outputs.element_spec
                    # The last step of a call fetches nothing more, so the
                    # next call starts on the next batch.
                    next_inputs = tf.cond(
                        step + 1 < steps,
                        iterator.get_next_as_optional,
                        lambda: next_inputs)
                    return step + 1, outputs, next_inputs

                _, outputs, _ = tf.while_loop(
                    cond, body,
                    [tf.constant(0), empty, iterator.get_next_as_optional()])
                outputs._element_spec = empty.element_spec
                return outputs

            if not self.run_eagerly:
                multi_step_on_iterator = tf.function(
                    multi_step_on_iterator, reduce_retracing=True)

            def function(iterator):
                if isinstance(iterator, (tf.data.Iterator,
                                         tf.distribute.DistributedIterator)):
                    optional_outputs = multi_step_on_iterator(iterator)
                    if not optional_outputs.has_value():
                        raise StopIteration
                    return optional_outputs.get_value()
                for _, data in zip(range(steps), iterator):
                    outputs = one_step_on_data(data)
                return outputs

            return function

        _make_function.keras_stock = original
        trainer._make_function = _make_function
        _multi_step_fit_enabled = True
    return True


def _tf_optimizer_class(used_for: str) -> type:
    return _require(
        _require_module("keras.src.backend.tensorflow.optimizer", used_for),
        "TFOptimizer", used_for)


# --- Gradient clipping under a strategy --------------------------------------
# In replica context Keras's TensorFlow optimizer clips (`_clip_gradients`,
# in `BaseOptimizer._backend_apply_gradients`) before it all-reduces
# (`TFOptimizer._all_reduce_sum_gradients`, in `_backend_update_step`, since
# keras-team/keras#19467 and #19969): `clipnorm`, `clipvalue` and
# `global_clipnorm` act on each replica's share of the gradient, not on the
# gradient one device would see (tf.keras 2 refused clipping under a
# strategy for this reason: tensorflow/tensorflow#33929). The fix
# all-reduces inside `_clip_gradients`, before clipping, and lets the later
# all-reduce pass those gradients through: still one all-reduce per step.
# Remove it once `test_stock_keras_still_clips_each_replica` in
# tests/test_compat.py fails, i.e. once Keras clips the all-reduced gradient
# itself.

_exact_clipping_enabled = False
# The gradients this thread has all-reduced and not yet handed to the
# optimizer's own all-reduce. Per thread: MirroredStrategy runs each
# replica's step in a thread of its own, interleaved at its merge calls.
_reduced_here = threading.local()
_CLIP_ARGUMENTS = ("clipnorm", "clipvalue", "global_clipnorm")


def exact_clipping_enabled() -> bool:
    """Whether `enable_exact_clipping()` has patched Keras in this process."""
    return _exact_clipping_enabled


def _keep_reduced(grads_and_vars):
    # Stands in for the optimizer's all-reduce where gradients arrive
    # all-reduced already (`gradients_already_reduced`).
    return list(grads_and_vars)


def _reduction_taken_over(optimizer) -> bool:
    return vars(optimizer).get("_all_reduce_sum_gradients") is _keep_reduced


def _clips(optimizer) -> bool:
    return any(getattr(optimizer, name, None) for name in _CLIP_ARGUMENTS)


def _same_tensors(a, b) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _take_reduced(grads) -> bool:
    """Whether `grads` are the ones this thread all-reduced last (and
    forgets them: each all-reduce stands in for one other)."""
    done = getattr(_reduced_here, "grads", None)
    _reduced_here.grads = None
    return done is not None and _same_tensors(done, grads)


def enable_exact_clipping() -> bool:
    """Makes `clipnorm`, `clipvalue` and `global_clipnorm` clip the
    all-reduced gradient under a strategy, as on one device.

    Keras's TensorFlow optimizer clips each replica's gradient before it
    sums them across replicas, so under `MirroredStrategy` or
    `MultiWorkerMirroredStrategy` a clipped `fit` trains differently from the
    same global batch on one device (and `global_clipnorm` bounds each
    replica's share, not the gradient). With this fix, an optimizer that
    clips, called in replica context on more than one replica, sums the
    gradients across replicas first and then clips them, and Keras's own
    all-reduce passes them through: one all-reduce per step, as before.

    Nothing changes on one replica, for an optimizer that does not clip,
    with Keras's own `gradient_accumulation_steps` (clipped inside its own
    update branch, which fails under a strategy anyway:
    keras-team/keras#20582), or where the gradients arrive all-reduced
    already (`GradientAccumulationModel` clips the all-reduced window
    gradient itself). `LossScaleOptimizer` (`mixed_float16`) clips through
    its inner optimizer, so it is covered too.

    Applied by `keras_mgpu.auto_strategy()`, never by `import keras_mgpu`.
    Call it yourself when you create your own strategy. It is decided by
    the optimizer's shape, not a version: a Keras whose
    `TFOptimizer._clip_gradients` or `_all_reduce_sum_gradients` is missing
    or has another signature gets `KerasInternalsError` here, before any
    training; where Keras all-reduces before it clips, the gradients are
    not reduced twice. It is idempotent.

    Returns:
        `True`: the patch is active after the call.

    Example:

    >>> from keras_mgpu import compat
    >>> compat.enable_exact_clipping()
    True
    >>> compat.exact_clipping_enabled()
    True
    """
    global _exact_clipping_enabled
    with _lock:
        if _exact_clipping_enabled:
            return True
        import tensorflow as tf

        TFOptimizer = _tf_optimizer_class(_EXACT_CLIPPING)
        clip = _require(TFOptimizer, "_clip_gradients", _EXACT_CLIPPING,
                        params=("self", "grads"))
        all_reduce = _require(
            TFOptimizer, "_all_reduce_sum_gradients", _EXACT_CLIPPING,
            params=("self", "grads_and_vars"))
        # Keras's own, should this process have patched them before.
        clip = getattr(clip, "keras_stock", clip)
        all_reduce = getattr(all_reduce, "keras_stock", all_reduce)

        def reduces_first(optimizer, grads):
            if not (_exact_clipping_enabled and _clips(optimizer)):
                return False
            context = tf.distribute.get_replica_context()
            return (
                context is not None
                and context.num_replicas_in_sync > 1
                and not getattr(optimizer, "gradient_accumulation_steps",
                                None)
                and not _reduction_taken_over(optimizer)
                # A Keras that all-reduced before clipping.
                and not _take_reduced(grads)
            )

        def _clip_gradients(self, grads):
            if not reduces_first(self, grads):
                return clip(self, grads)
            # Keras's own all-reduce (SUM of the per-replica gradients of
            # losses already divided by the replica count: the global mean).
            # It reads the variables only to name them in errors.
            reduced = [g for g, _ in all_reduce(self, [(g, None)
                                                       for g in grads])]
            clipped = clip(self, reduced)
            _reduced_here.grads = [g for g in clipped if g is not None]
            return clipped

        def _all_reduce_sum_gradients(self, grads_and_vars):
            grads_and_vars = list(grads_and_vars)
            grads = [g for g, _ in grads_and_vars if g is not None]
            if _exact_clipping_enabled and _take_reduced(grads):
                return grads_and_vars
            reduced = all_reduce(self, grads_and_vars)
            if _exact_clipping_enabled and _clips(self):
                # Should Keras clip after this, it clips these as they are.
                _reduced_here.grads = [g for g, _ in reduced if g is not None]
            return reduced

        _clip_gradients.keras_stock = clip
        _all_reduce_sum_gradients.keras_stock = all_reduce
        TFOptimizer._clip_gradients = _clip_gradients
        TFOptimizer._all_reduce_sum_gradients = _all_reduce_sum_gradients
        _exact_clipping_enabled = True
    return True


# --- Gradient accumulation (keras_mgpu.accumulation) -------------------------
# The train-step building blocks below are the ones Keras's own
# `TensorFlowTrainer.train_step` uses; the optimizer hooks are the
# replica-context all-reduce and the LossScaleOptimizer's two outcomes.


def check_accumulation_support() -> None:
    """Raises `KerasInternalsError` unless this Keras has everything the
    accumulation wrapper uses (checked before any model is wrapped)."""
    TFOptimizer = _tf_optimizer_class(_ACCUMULATION)
    loss_module = _require_module("keras.src.losses.loss", _ACCUMULATION)

    # Replica-local accumulators need `keras.Variable(synchronization=...)`,
    # which Keras 3.8 does not take (3.10 does).
    warn_if_untested()
    if "synchronization" not in inspect.signature(
            keras.Variable.__init__).parameters:
        raise _internals_error(
            "`keras.Variable(synchronization=...)`", _ACCUMULATION)
    _require(keras.Model, "_compute_loss", _ACCUMULATION)
    _require(loss_module, "unscale_loss_for_distribution", _ACCUMULATION)
    _require(TFOptimizer, "_all_reduce_sum_gradients", _ACCUMULATION,
             params=("self", "grads_and_vars"))
    for name in ("_stateful_handle_finite_grads",
                 "_stateful_handle_non_finite_grads"):
        _require(keras.optimizers.LossScaleOptimizer, name, _ACCUMULATION)


def compute_loss(model, x, y, y_pred, sample_weight):
    """The training loss as Keras computes it, scaled for distribution."""
    return _require(model, "_compute_loss", _ACCUMULATION)(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )


def track_loss(model, loss, batch_size) -> None:
    """Feeds `loss` to the model's `loss` metric, as Keras's train_step does."""
    loss_module = _require_module("keras.src.losses.loss", _ACCUMULATION)
    unscale = _require(loss_module, "unscale_loss_for_distribution",
                       _ACCUMULATION)
    loss_tracker(model, _ACCUMULATION).update_state(
        unscale(loss), sample_weight=batch_size
    )


@contextlib.contextmanager
def gradients_already_reduced(optimizer):
    """Stops `optimizer.apply` from all-reducing gradients in replica context.

    Keras's TF optimizer sums gradients across replicas inside `apply`. The
    accumulation wrapper has already reduced them (once, for the whole
    window), so inside this block `apply` clips, decays and updates only.
    Takes effect while tracing, which is when the all-reduce would be built.
    A Keras without the method raises rather than reducing twice.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    _require(type(inner), "_all_reduce_sum_gradients", _ACCUMULATION,
             params=("self", "grads_and_vars"))
    # `enable_exact_clipping` recognises it: no all-reduce before clipping.
    inner._all_reduce_sum_gradients = _keep_reduced
    try:
        yield
    finally:
        del inner._all_reduce_sum_gradients


def loss_scale_apply(optimizer, grads, trainable_variables) -> None:
    """LossScaleOptimizer's finite-gradient branch: unscale, apply, grow scale."""
    _require(optimizer, "_stateful_handle_finite_grads", _ACCUMULATION)(
        grads, trainable_variables)


def loss_scale_skip(optimizer) -> None:
    """LossScaleOptimizer's non-finite branch: halve the scale, skip the step."""
    _require(optimizer, "_stateful_handle_non_finite_grads", _ACCUMULATION)()


# --- Mixed precision (keras_mgpu.mixed_precision, keras_mgpu.layers) ---------
# `keras.src.backend.tensorflow.nn._get_logits` reads this attribute on a
# softmax/sigmoid output to recover its logits for the cross-entropy losses;
# `keras.activations.softmax`/`sigmoid` set it.
KERAS_LOGITS_ATTR = "_keras_logits"


def attach_logits(output, logits) -> bool:
    """Attaches `logits` to `output` so Keras's cross-entropy losses use them.

    Returns whether the attribute could be set (eager tensors of some builds
    refuse new attributes; the losses then see probabilities only).
    """
    try:
        setattr(output, KERAS_LOGITS_ATTR, logits)
    except AttributeError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def logits_recovered() -> bool:
    """Whether Keras's cross-entropy reads logits attached to probabilities.

    Measured, not assumed, once per process: a categorical cross-entropy of
    deliberately wrong probabilities carrying the right logits.
    """
    import tensorflow as tf

    @tf.function(autograph=False)
    def probe():
        logits = tf.constant([[20.0, -20.0]])
        wrong = tf.constant([[0.5, 0.5]])
        attach_logits(wrong, logits)
        return keras.losses.categorical_crossentropy([[1.0, 0.0]], wrong)

    with tf.init_scope():  # also when first asked while tracing
        return float(probe()[0]) < 1e-3  # ln(2) if the logits were ignored


def attached_logits(output):
    """The logits attached to `output` by a softmax/sigmoid, or None."""
    return getattr(output, KERAS_LOGITS_ATTR, None)


def sublayers(layer) -> list:
    """Every layer nested in `layer` (itself excluded), depth first."""
    flatten = _require(layer, "_flatten_layers", _MIXED)
    return list(flatten(include_self=False, recursive=True))


def own_variables(layer) -> list:
    """The variables created by `layer` itself, not by its sublayers."""
    return list(_require(layer, "_trainable_variables", _MIXED)) + list(
        _require(layer, "_non_trainable_variables", _MIXED)
    )


def variable_autocasts(variable) -> bool:
    """Whether `variable` is cast to the compute dtype when read in `call`."""
    return bool(_require(variable, "_autocast", _MIXED))


def producing_layer(keras_tensor):
    """The layer whose call produced a symbolic `keras_tensor`, or None."""
    if not isinstance(keras_tensor, keras.KerasTensor):
        return None
    history = _require(keras_tensor, "_keras_history", _MIXED)
    return history[0] if history else None


# --- Backup and restore (keras_mgpu.callbacks.BackupAndRestore) --------------
# Keras's `fit` starts at `model._initial_epoch` when set (its own
# BackupAndRestore uses this), and calls `model.train_function(iterator)`
# once per batch (or `steps_per_execution` batches).


def set_cluster_startup_timeout(seconds: float) -> None:
    """Makes TensorFlow's multi-worker start-up wait at most `seconds` for
    every training worker to connect, then raise `DeadlineExceededError`.

    `MultiWorkerMirroredStrategy` configures TensorFlow's coordination
    service itself, with no registration deadline: a worker whose peer
    never starts waits forever. This sets the same configuration (leader,
    chief and worker jobs), plus a registration barrier with a deadline,
    before the strategy is created; the strategy keeps a configuration it
    finds. Must run before the strategy, like the strategy itself.
    """
    import tensorflow as tf

    used_for = _STARTUP_DEADLINE
    multi_worker_util = _require_module(
        "tensorflow.python.distribute.multi_worker_util", used_for)
    context = _require_module("tensorflow.python.eager.context", used_for)
    proto = _require_module(
        "tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2",
        used_for)
    fields = proto.CoordinationServiceConfig.DESCRIPTOR.fields_by_name
    if "cluster_register_with_barrier" not in fields:
        raise _internals_error(
            "tensorflow's CoordinationServiceConfig with "
            "cluster_register_with_barrier", used_for)
    coordination_leader = _require(multi_worker_util, "coordination_leader",
                                   used_for, params=("cluster_spec",))
    ctx = _require(context, "context", used_for)()
    configure = _require(ctx, "configure_coordination_service", used_for)
    cluster_spec = (
        tf.distribute.cluster_resolver.TFConfigClusterResolver().cluster_spec()
    )
    configure(
        service_type="standalone",
        service_leader=coordination_leader(cluster_spec),
        coordinated_jobs=[
            proto.CoordinatedJob(name=job,
                                 num_tasks=cluster_spec.num_tasks(job))
            for job in ("chief", "worker") if job in cluster_spec.jobs
        ],
        cluster_register_timeout_in_ms=max(1, int(seconds * 1000)),
    )
    # Without the barrier the deadline is not enforced: the leader waits on.
    _require(ctx, "coordination_service",
             used_for).cluster_register_with_barrier = True


def set_initial_epoch(model, epoch) -> None:
    """Makes the running `fit` start at `epoch` (None: as the caller asked)."""
    _require(model, "_initial_epoch", _BACKUP)
    model._initial_epoch = epoch


def callback_siblings(callback):
    """The callbacks of the `CallbackList` driving `callback` (itself included).

    Callbacks have no reference to their list. The list is found among the
    objects referring to `callback` (Python's `gc.get_referrers`, one scan
    of the heap per call: call it once per `fit`); when several lists hold it
    (a failed `fit`'s list kept alive by its traceback), the one whose
    `params` were given to `callback` is the current one. None when no
    `CallbackList` holds it (a hand-driven callback).
    """
    import gc

    callback_list = _require(keras.callbacks, "CallbackList", _BACKUP)
    found = []
    for container in gc.get_referrers(callback):
        if not isinstance(container, list):
            continue
        for owner in gc.get_referrers(container):
            if isinstance(owner, dict):
                # An instance dict Python has materialized: its owner.
                owners = [o for o in gc.get_referrers(owner)
                          if isinstance(o, callback_list)
                          and getattr(o, "__dict__", None) is owner]
            else:
                owners = [owner]
            found.extend(o for o in owners if isinstance(o, callback_list)
                         and getattr(o, "callbacks", None) is container)
    if not found:
        return None
    current = [o for o in found if o.params is callback.params]
    return list((current or found)[-1].callbacks)


class WeightsLayout:
    """Where `model.save_weights` puts each value: the objects Keras's own
    walk of the model saves (layers, optimizer, metrics), in its order and
    with its paths, found once.

    `read()` has each of them put its values into host memory now, as
    `save_weights` would: the training thread pays only for the reads
    (device-to-host copies; collectives for replica-local variables under
    MultiWorkerMirroredStrategy, in the same order on every worker), not
    for the walk (which inspects every attribute of every layer) or the
    file, which `weights_file(snapshot)` writes later, on any thread. Valid
    while the model saves the same objects: find it again after a
    recompile.
    """

    def __init__(self, saveables: list, store_class):
        self._saveables = saveables
        self._store_class = store_class

    def read(self, into: Optional[list] = None) -> list:
        """`[(path, metadata, [(key, array), ...])]`, for `weights_file`.

        `into`: an earlier `read()` whose arrays are no longer used: the
        values are copied into them (no new host memory to allocate and
        fault in, which costs more than the copy for large models).
        """
        buffers = None if into is None else (
            array for _, _, values in into for _, array in values)
        store = self._store_class(buffers=buffers)
        for path, metadata, saveable in self._saveables:
            saveable.save_own_variables(store.make(path, metadata=metadata))
        return store.entries


def check_backup_support(model) -> None:
    """Raises `KerasInternalsError` unless this Keras has everything
    `BackupAndRestore` uses (called as a `fit` begins, before any step)."""
    _require(model, "_initial_epoch", _BACKUP)
    _save_state()
    _load_state()
    _h5_store()


def _saving_lib():
    return _require_module(_SAVING_LIB, _BACKUP)


def _save_state():
    # What `save_weights_only` does for a `.weights.h5` file.
    _copied_variant(_saving_lib(), "save_weights_only", _BACKUP)
    return _require(
        _saving_lib(), "_save_state", _BACKUP,
        params=("saveable", "weights_store", "assets_store", "inner_path",
                "visited_saveables"))


def _load_state():
    # What `load_weights_only` does for a `.weights.h5` file.
    _copied_variant(_saving_lib(), "load_weights_only", _BACKUP)
    return _require(
        _saving_lib(), "_load_state", _BACKUP,
        params=("saveable", "weights_store", "assets_store", "inner_path"))


def _h5_store():
    return _require(_saving_lib(), "H5IOStore", _BACKUP)


def weights_layout(model) -> WeightsLayout:
    """Finds where `model.save_weights` would put each of its values."""
    save_state = _save_state()
    store_class = _recording_store_class(_h5_store())
    finder = store_class(find_saveables=True)
    save_state(model, weights_store=finder, assets_store=None, inner_path="",
               visited_saveables=set())
    return WeightsLayout(finder.saveables, store_class)


def weights_file(snapshot: list) -> memoryview:
    """The bytes of the `.weights.h5` file `model.save_weights` would have
    written when `snapshot` (`WeightsLayout.read()`) was taken, made by
    Keras's own HDF5 store (in memory), so that `model.load_weights` reads
    it. A view of the buffer they were written to, not a copy."""
    import io

    buffer = io.BytesIO()
    store = _h5_store()(buffer, mode="w")
    try:
        for path, metadata, values in snapshot:
            entry = store.make(path, metadata=metadata)
            for key, value in values:
                entry[key] = value
    finally:
        store.close()
    return buffer.getbuffer()


def load_weights_file(model, data: bytes) -> None:
    """`model.load_weights` of a `.weights.h5` file given as its bytes (read
    and verified by the caller), so that exactly those bytes are loaded,
    not whatever the file on disk holds by the time it is opened again.

    What `keras.saving.saving_lib.load_weights_only` does with a path, from
    an in-memory file (upstream: keras/src/saving/saving_lib.py; remove when
    `Model.load_weights` accepts a file object).
    """
    import io

    load_state = _load_state()
    store = _h5_store()(io.BytesIO(data), mode="r")
    failed, errors = set(), {}
    try:
        load_state(model, store, None, "", visited_saveables=set(),
                   failed_saveables=failed, error_msgs=errors)
    finally:
        store.close()
    if failed:
        saveable, error = next(iter(errors.values()))
        raise ValueError(
            f"{len(errors)} objects could not be loaded from the backup's "
            f"weights, e.g. {saveable}: {error}")


@functools.lru_cache(maxsize=4)
def _recording_store_class(h5_store):
    # A subclass: Keras's walk accepts only its own store types.
    class _RecordingStore(h5_store):
        def __init__(self, find_saveables=False, buffers=None):
            # No file is set up: nothing of the parent's state is used.
            self.entries = []
            self.saveables = [] if find_saveables else None
            self._values = None
            self._buffers = iter(buffers or ())

        def __bool__(self):
            return True

        def make(self, path, metadata=None):
            if self.saveables is not None:
                # Called by `_save_state(saveable, ...)` for that object
                # (its first parameter, checked by `weights_layout`).
                saveable = inspect.currentframe().f_back.f_locals["saveable"]
                self.saveables.append((path, metadata, saveable))
            self._values = []
            self.entries.append((path, metadata, self._values))
            return self

        def __setitem__(self, key, value):
            if self.saveables is not None:
                return
            # A copy (the variables train on while the file is written),
            # into the earlier read's array where there is one: memory in
            # use already, where a new array per save is faulted in page
            # by page.
            source = np.asarray(value)
            buffer = next(self._buffers, None)
            if (buffer is not None and buffer.shape == source.shape
                    and buffer.dtype == source.dtype):
                np.copyto(buffer, source)
            else:
                buffer = np.array(source)
            self._values.append((key, buffer))

    return _RecordingStore


# --- Telemetry (keras_mgpu.runtime, read by the callbacks) -------------------
# Keras's `train_step` (and `compat.track_loss`) feeds the loss tracker with
# `sample_weight=batch_size`, so the tracker's `count` is the number of
# samples trained on since the metrics were last reset (each epoch).
class _SummaryScope:
    """Sets this thread's default `tf.summary` writer, step and recording
    condition, and puts back what was there: what `writer.as_default(step)`
    with `tf.summary.record_if(condition)` do, without the flush of the
    writer on every exit and in a few attribute writes (it is entered
    around every train step)."""

    __slots__ = ("_state", "_new", "_old")

    def __init__(self, state, writer, step, condition):
        self._state = state
        self._new = (writer, step, condition)
        self._old = None

    def __enter__(self):
        state = self._state
        self._old = (state.writer, state.step, state.is_recording)
        state.writer, state.step, state.is_recording = self._new
        return self

    def __exit__(self, *exc):
        state = self._state
        state.writer, state.step, state.is_recording = self._old
        return False


def summary_scope(writer, step, condition) -> _SummaryScope:
    """A context in which `tf.summary` calls write to `writer` at `step`
    where `condition()` holds (TensorFlow's own summary state: it has no
    public setter without a flush per use)."""
    return _SummaryScope(check_summary_support(), writer, step, condition)


def check_summary_support():
    """TensorFlow's summary state, checked: `KerasInternalsError` unless it
    has what `summary_scope` sets (called as the logger begins)."""
    summary_ops_v2 = _require_module("tensorflow.python.ops.summary_ops_v2",
                                     _SUMMARIES)
    state = _require(summary_ops_v2, "_summary_state", _SUMMARIES)
    for name in ("writer", "step", "is_recording"):
        _require(state, name, _SUMMARIES)
    return state


def loss_tracker(model, used_for: str = _TELEMETRY):
    """The compiled model's `loss` metric (a `Mean`), or None if uncompiled."""
    if not getattr(model, "compiled", False):
        return None
    return _require(model, "_loss_tracker", used_for)


def examples_count(model):
    """The variable counting samples trained on this epoch, or None.

    Summed over replicas when read in cross-replica context. None when the
    model is not compiled (Keras creates the loss tracker in `compile`).
    """
    tracker = loss_tracker(model)
    if tracker is None:
        return None
    return _require(tracker, "count", _TELEMETRY)


def examples_seen(model) -> float | None:
    """Samples `fit` has trained on this epoch, over all replicas and workers.

    Read in cross-replica context, the tracker's on-read variable is summed
    over every replica; under MultiWorkerMirroredStrategy that is a
    collective, so every worker must call this at the same point. `None`
    when the model is not compiled.
    """
    count = examples_count(model)
    if count is None:
        return None
    return float(np.asarray(keras.ops.convert_to_numpy(count)))


def check_runtime_support(model) -> None:
    """Raises `KerasInternalsError` unless this Keras has everything the
    training runtime reads of `model` and of the running `fit` (called as
    a `fit` or a hand-written loop begins, before any step)."""
    examples_count(model)
    _copied_variant(trainer_class(_INPUT_WAIT), "_make_function", _INPUT_WAIT)
    epoch_iterator = fit_epoch_iterator(model)
    if epoch_iterator is not None:
        epoch_iterator_keeps_iterator(epoch_iterator)
        epoch_iterator_count(epoch_iterator)
        _require(epoch_iterator, "_current_iterator", _STREAM)


def train_on_batch_resets_metrics() -> bool:
    """Whether Keras's `train_on_batch` resets the metrics (the loss
    tracker's sample count among them) at every call.

    Keras 3.15 does (`self.reset_metrics()` first thing); 3.10 does not, so
    there the count runs on over a hand-written loop. Read from the
    installed trainer's code, not its version. Remove when keras-mgpu no
    longer supports a Keras without the reset.
    """
    trainer = trainer_class(_TELEMETRY)
    method = inspect.unwrap(_require(trainer, "train_on_batch", _TELEMETRY))
    code = getattr(method, "__code__", None)
    if code is None:
        raise _internals_error(
            f"`{trainer.__name__}.train_on_batch`'s code", _TELEMETRY)
    return "reset_metrics" in code.co_names


# --- Tuning (keras_mgpu.tuner) -----------------------------------------------
# Keras 3 optimizers keep a schedule, if any, in `_learning_rate` (the
# public `learning_rate` evaluates it). keras-tuner 1.4 appends its private
# `tuner_utils.TunerCallback(tuner, trial)` to every trial's callbacks.


def learning_rate_schedule(optimizer):
    """The optimizer's `LearningRateSchedule`, or None for a fixed rate."""
    schedule = _require(optimizer, "_learning_rate", _TUNER)
    if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        return schedule
    return None


def learning_rate_callable(optimizer):
    """The optimizer's learning rate when it is a plain callable (a
    function, neither a number nor a schedule), else None."""
    rate = _require(optimizer, "_learning_rate", _TUNER)
    if callable(rate) and not isinstance(
        rate,
        (keras.optimizers.schedules.LearningRateSchedule, keras.Variable),
    ):
        return rate
    return None


def tuner_and_trial(callbacks):
    """(tuner, trial) from the callbacks KerasTuner passes to `fit`, or None.

    `HyperModel.fit` gets no trial; the trial id and the tuner's
    `get_trial_dir` key the per-trial backup.
    """
    for callback in callbacks:
        tuner = getattr(callback, "tuner", None)
        trial = getattr(callback, "trial", None)
        if (
            tuner is not None
            and hasattr(tuner, "get_trial_dir")
            and getattr(trial, "trial_id", None) is not None
        ):
            return tuner, trial
        if type(callback).__name__ == "TunerCallback":
            # KerasTuner's own callback, reshaped: say so rather than run
            # the search without per-trial backups.
            import keras_tuner

            raise KerasInternalsError(
                "keras-mgpu finds the trial through KerasTuner's "
                "TunerCallback(tuner, trial), but in KerasTuner "
                f"{keras_tuner.__version__} it has no `tuner` with "
                "`get_trial_dir` and `trial` with `trial_id`. Install "
                "keras-tuner 1.4.x, or pass backup=False to "
                "StrategyAwareHyperModel."
            )
    return None


# --- KerasTuner's best checkpoint (keras_mgpu.tuner) ---------------------------
# KerasTuner 1.4.8's `Tuner.run_trial` appends its private
# `tuner_utils.SaveBestEpoch` to every trial's callbacks
# (https://github.com/keras-team/keras-tuner/blob/v1.4.8/keras_tuner/src/engine/tuner_utils.py):
# it writes the trial's best checkpoint when an epoch beats `best_value`,
# which starts at -inf or inf in each fit. A trial resumed by its backup
# would take its first resumed epoch as the best, so `best_value` is saved
# with each generation. Remove when KerasTuner restores it itself (a
# resumed trial's checkpoint is then right without it: tests/test_tuner.py
# shows it).


def save_best_epoch_class() -> type:
    """KerasTuner's `SaveBestEpoch` callback class."""
    tuner_utils = _require_module("keras_tuner.src.engine.tuner_utils",
                                  _TUNER_BEST)
    return _require(tuner_utils, "SaveBestEpoch", _TUNER_BEST)


def save_best_epoch_state(callback) -> dict:
    """The state of a `SaveBestEpoch` that decides its next checkpoint."""
    return {"best_value": _require(callback, "best_value", _TUNER_BEST)}


def check_save_best_epoch(callbacks) -> None:
    """Raises `KerasInternalsError` unless each KerasTuner `SaveBestEpoch`
    among `callbacks` has the state a trial's backup saves (called as the
    trial's `fit` begins, before any step)."""
    best = save_best_epoch_class()
    for callback in callbacks:
        if isinstance(callback, best):
            save_best_epoch_state(callback)


def set_save_best_epoch_state(callback, state: dict) -> None:
    _require(callback, "best_value", _TUNER_BEST)
    callback.best_value = state["best_value"]


# --- KerasTuner's oracle state (keras_mgpu.tuner) -----------------------------
# KerasTuner 1.4.8's `Oracle.end_trial` saves `oracle.json` before it takes
# the ended trial out of `ongoing_trials`, and nothing saves the oracle after
# the last trial ends, so the file of a finished search still lists a trial
# as ongoing. `Oracle.reload` sends every ongoing trial of the file for a
# retry (`_retry_queue`): a rerun of the project trains that finished trial
# again. `tests/test_compat.py` shows whether the installed KerasTuner still
# saves in that order.

_tuner_state_fix_enabled = False

# Set by `keras_mgpu.tuner.launch` for the chief: the tuner ids of every
# worker it starts. KerasTuner's chief exits once no tuner it has heard of
# is left, so a worker that asks for its first trial after the others got
# STOPPED (on the rerun of a finished search, say) finds it gone.
TUNER_IDS_ENV = "KERAS_MGPU_TUNER_IDS"
_expecting = weakref.WeakSet()


def enable_tuner_state_fix() -> bool:
    """Keeps ended trials out of KerasTuner's retries, and out of its file.

    Wraps two methods of `keras_tuner.Oracle` (every oracle, the chief's of
    a parallel search too): `reload` no longer queues for a retry a trial
    that had ended (COMPLETED or FAILED) although the file listed it as
    ongoing, and `create_trial` saves the oracle when it answers STOPPED,
    so the file of a finished search lists no ongoing trial. A trial
    interrupted while running (RUNNING) or invalid is still retried. With
    `KERAS_MGPU_TUNER_IDS` set (`keras_mgpu.tuner.launch` sets it), the
    oracle counts those tuners as running from its first trial on, so a
    parallel chief waits until each of them got STOPPED. Right with or
    without the KerasTuner ordering, so applied whatever its version.
    Idempotent.

    Returns:
        Whether this call applied it (False if it already was).
    """
    global _tuner_state_fix_enabled
    import keras_tuner

    with _lock:
        if _tuner_state_fix_enabled:
            return False
        oracle_class = keras_tuner.Oracle
        reload = _require(oracle_class, "reload", _TUNER_STATE)
        create_trial = _require(oracle_class, "create_trial", _TUNER_STATE)
        status = keras_tuner.engine.trial.TrialStatus
        ended = (status.COMPLETED, status.FAILED)

        @functools.wraps(reload)
        def reload_without_ended_trials(self):
            reload(self)
            queue = _require(self, "_retry_queue", _TUNER_STATE)
            queue[:] = [trial_id for trial_id in queue
                        if self.trials[trial_id].status not in ended]

        def create_trial_saved_when_stopped(self, tuner_id):
            expected = os.environ.get(TUNER_IDS_ENV)
            if expected and self not in _expecting:
                _expecting.add(self)
                self.tuner_ids.update(expected.split(","))
            trial = create_trial(self, tuner_id)
            if trial.status == status.STOPPED:
                self.save()
            return trial

        oracle_class.reload = reload_without_ended_trials
        # Under the oracle's own lock, as KerasTuner's create_trial is.
        oracle_class.create_trial = keras_tuner.synchronized(
            create_trial_saved_when_stopped)
        _tuner_state_fix_enabled = True
        return True


# --- Input wait and batch count (keras_mgpu.runtime) -------------------------
# Keras's TensorFlow trainer makes `model.train_function` a plain closure
# `function(iterator)` over `multi_step_on_iterator`, a `tf.function` that
# fetches each batch inside the graph and returns an `Optional` that
# `function` unwraps (raising StopIteration when empty); in the 3.16
# nightlies `function` fetches the batch of a one-step call on the host and
# calls `one_step_on_data` itself. A callback
# can neither time an in-graph fetch from the host nor see how many batches
# a call fetched (fewer than `steps_per_execution` where the data ends), so
# the same Python step is retraced with an iterator whose fetches are timed
# and counted. `function` itself is re-created here: `_KNOWN_SHAPES` checks
# that Keras's is one of the shapes this copy follows.


def timed_train_function(train_function, seconds_waited):
    """Keras's `model.train_function`, also timing its input fetches.

    `instrumented_train_function` with only `seconds_waited`.
    """
    return instrumented_train_function(train_function,
                                       seconds_waited=seconds_waited)


def instrumented_train_function(train_function, seconds_waited=None,
                                batches_read=None):
    """Keras's `model.train_function`, also timing or counting its fetches.

    The returned function trains exactly as `train_function` does (the same
    Python step, traced once more). With `seconds_waited` (a float64
    variable) it adds the time each step was blocked fetching its batch:
    from just before the iterator's get-next op starts until its outputs
    exist, as `tf.timestamp` sees it inside the graph. With `batches_read`
    (an int64 variable) it adds 1 for each batch fetched, so the caller
    knows how many a call trained where the data ended inside it. No value
    leaves the device per step.

    Returns None when `train_function` is not Keras's compiled train function
    (e.g. `run_eagerly=True`, another callback's stand-in): then nothing can
    be timed. Raises `KerasInternalsError` when it is Keras's but made by a
    `_make_function` of a shape this was not written for.
    """
    import tensorflow as tf

    if train_function is None:
        return None
    variant = _train_function_variant(train_function)
    multi_step = _closure_value(train_function, "multi_step_on_iterator")
    python_function = getattr(multi_step, "python_function", None)
    if variant is None or python_function is None:
        # Not Keras's, or run_eagerly=True (a plain Python step): n/a.
        return None

    @tf.function(reduce_retracing=True)
    def instrumented_multi_step(iterator):
        return python_function(
            _InstrumentedIterator(iterator, seconds_waited, batches_read))

    iterator_types = (tf.data.Iterator, tf.distribute.DistributedIterator)
    if variant == "host_fetch_one_step":
        model = _closure_value(train_function, "self")
        one_step_on_data = _closure_value(train_function, "one_step_on_data")
    else:
        model = one_step_on_data = None

    def function(iterator):
        if not isinstance(iterator, iterator_types):
            return train_function(iterator)
        if model is not None and model.steps_per_execution == 1:
            optional_inputs = _InstrumentedIterator(
                iterator, seconds_waited, batches_read).get_next_as_optional()
            if not optional_inputs.has_value():
                raise StopIteration
            return one_step_on_data(optional_inputs.get_value())
        optional_outputs = instrumented_multi_step(iterator)
        if not optional_outputs.has_value():
            raise StopIteration
        return optional_outputs.get_value()

    function.keras_train_function = train_function
    return function


def _train_function_variant(train_function) -> Optional[str]:
    """The shape of the `_make_function` that made `train_function`: Keras's
    (checked against `_KNOWN_SHAPES`), keras-mgpu's multi-step loop, or None
    for a function neither made."""
    qualname = getattr(train_function, "__qualname__", "")
    if qualname.startswith("enable_multi_step_fit.<locals>"):
        return "graph_fetch"
    if getattr(train_function, "__module__", None) != _TF_TRAINER:
        return None
    return _copied_variant(trainer_class(_INPUT_WAIT), "_make_function",
                           _INPUT_WAIT)


# --- The data stream of a running `fit` (keras_mgpu.runtime) -----------------
# Keras 3.10 to 3.15 `TensorFlowTrainer.fit` holds its `TFEpochIterator` in
# the local `epoch_iterator`. With `steps_per_epoch` it hands the next epoch
# the same data iterator (`_current_iterator`) unless the data ran out, and
# counts the batches it handed out (`_steps_seen`, `steps_per_execution` per
# call) to know when a dataset of known length is used up. A resume that
# continues such a stream mid-way must start that count where the
# interrupted run had it. Remove when Keras exposes the epoch iterator's
# position (no upstream issue yet).


def fit_epoch_iterator(model):
    """The epoch iterator of the `fit` now running on `model`, or None (not
    called from inside Keras's `fit`, e.g. a hand-written loop)."""
    import sys

    # Checked on the installed trainer, so a renamed local raises here
    # rather than reading as "not inside fit".
    trainer = trainer_class(_STREAM)
    fit = inspect.unwrap(_require(trainer, "fit", _STREAM))
    code = getattr(fit, "__code__", None)
    if code is None or "epoch_iterator" not in code.co_varnames:
        raise _internals_error(f"`{trainer.__name__}.fit`'s local "
                               "`epoch_iterator`", _STREAM)
    frame = sys._getframe(1)
    while frame is not None:
        # Keras's own `fit`, not an override that calls it (which has no
        # such local).
        if frame.f_code.co_name == "fit":
            local = frame.f_locals
            if local.get("self") is model and "epoch_iterator" in local:
                return local["epoch_iterator"]
        frame = frame.f_back
    return None


def epoch_iterator_keeps_iterator(epoch_iterator) -> bool:
    """Whether `epoch_iterator` reads one data iterator across epochs (it was
    given `steps_per_epoch`) rather than a new one each epoch."""
    if epoch_iterator is None:
        return False
    return bool(_require(epoch_iterator, "steps_per_epoch", _STREAM))


def epoch_iterator_reads_on(epoch_iterator, iterator) -> bool:
    """Whether the next epoch of `epoch_iterator` reads on from `iterator`
    (call it after an epoch's last batch)."""
    if not epoch_iterator_keeps_iterator(epoch_iterator):
        return False
    current = _require(epoch_iterator, "_current_iterator", _STREAM)
    return current is iterator


def epoch_iterator_count(epoch_iterator) -> int:
    """The batches `epoch_iterator` has counted out of its current stream."""
    if epoch_iterator is None:
        return 0
    return int(_require(epoch_iterator, "_steps_seen", _STREAM))


def add_epoch_iterator_count(epoch_iterator, count: int) -> None:
    """Adds `count` (read by an earlier run) to that count."""
    if epoch_iterator is not None and count:
        _require(epoch_iterator, "_steps_seen", _STREAM)
        epoch_iterator._steps_seen += count


def _closure_value(function, name):
    code = getattr(function, "__code__", None)
    if code is None or name not in code.co_freevars:
        return None
    return function.__closure__[code.co_freevars.index(name)].cell_contents


class _InstrumentedIterator:
    """Wraps a dataset iterator while a train step is traced: each fetch is
    bracketed by timestamps and its duration added to a variable, and/or
    counted in another."""

    def __init__(self, iterator, seconds_waited, batches_read):
        self._iterator = iterator
        self._seconds_waited = seconds_waited
        self._batches_read = batches_read

    def get_next(self):
        return self._fetch(self._iterator.get_next, optional=False)

    def get_next_as_optional(self):
        return self._fetch(self._iterator.get_next_as_optional, optional=True)

    def __next__(self):
        return self._fetch(self._iterator.__next__, optional=False)

    def __getattr__(self, name):
        return getattr(self._iterator, name)

    def _fetch(self, fetch, optional):
        import tensorflow as tf

        if self._seconds_waited is None:
            element = fetch()
        else:
            start = tf.timestamp()
            with tf.control_dependencies([start]):
                element = fetch()
        outputs = [
            t for t in tf.nest.flatten(element, expand_composites=True)
            if isinstance(t, tf.Tensor)
        ]
        with tf.control_dependencies(outputs):
            if self._seconds_waited is not None:
                self._seconds_waited.assign_add(tf.timestamp() - start)
            if self._batches_read is not None:
                # An empty Optional is the end of the data, not a batch.
                read = (tf.cast(element.has_value(), tf.int64) if optional
                        else tf.constant(1, tf.int64))
                self._batches_read.assign_add(read)
        return element


if __name__ == "__main__":
    # The shapes of the installed Keras's originals, for `_KNOWN_SHAPES`.
    for _name, (_owner, _) in _copied_originals().items():
        _function = _lookup(_owner, _name)
        _function = getattr(_function, "keras_stock", _function)
        print(f"{_name}: {_shape_of(_function)}  # Keras {keras.__version__}")
