"""The record of every workaround: what it is for, the upstream issue or
source it answers, what it works around, when it is applied and when it can
go (`WORKAROUNDS`, shown as docs/compatibility.md's table by
`workarounds_table()`).

A new workaround gets its record here, then its code in the module of the
upstream it touches, naming the record as `used_for` in every `_require`.
"""

from __future__ import annotations

import dataclasses


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


_RECORDS: list[Workaround] = []


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
    "#19969), so a clipped step differs from one device's; and it clips a "
    "sparse (`tf.IndexedSlices`) gradient's rows unmerged, duplicate "
    "indices apart (`_clip_gradients` in keras/src/optimizers/"
    "base_optimizer.py), so an embedding's gradient is not clipped as its "
    "dense equivalent, on one device too; Adam squares those rows apart "
    "for its second moment, so even unclipped the update is not the dense "
    "gradient's (keras-mgpu issue #43)",
    applied="by `auto_strategy()`; all-reduces first on more than one "
    "replica for an optimizer that clips, and merges a sparse gradient's "
    "duplicate rows before the clip and the update on any replica count",
    remove_when="Keras clips the all-reduced gradient: "
    "`test_stock_keras_still_clips_each_replica` fails; the merge, once "
    "Keras merges duplicate rows before clipping and updating: "
    "`test_stock_keras_still_clips_unmerged_rows` and "
    "`test_stock_keras_adam_squares_unmerged_rows` fail")
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
_JAX_ACCUMULATION = _workaround(
    "GradientAccumulationModel's JAX train step",
    upstream=f"{_KERAS}/blob/v3.15.1/keras/src/backend/jax/trainer.py",
    works_around="a JAX train step that replaces Keras's updates the loss "
    "tracker and compiled metrics through the trainer's private "
    "`_update_metrics_variables`, as Keras's own JAX step does",
    applied="by `GradientAccumulationModel` on Keras's JAX backend",
    remove_when="Keras exposes a stateless metrics update on its JAX "
    "trainer")
_UNEVEN_BATCHES = _workaround(
    "uneven last batches on JAX (keras-team/keras#21167)",
    upstream=f"{_KERAS}/issues/21167",
    works_around="under a `keras.distribution` distribution, `fit`, "
    "`evaluate` and `predict` raise `IndivisibleError` for a batch whose "
    "size does not divide by the devices of the batch axis (the data's "
    "last batch); keras-mgpu places such a batch whole on every device "
    "instead (Keras's `_distribute_data` in "
    "keras/src/backend/jax/trainer.py)",
    applied="by `keras_mgpu.compat.enable_uneven_last_batches()`, which "
    "`GradientAccumulationModel` and keras-mgpu's callbacks call on JAX",
    remove_when="Keras distributes a batch that does not divide by the "
    "devices (the issue is closed)")
_IN_STEP_BATCH_MOMENTS = _workaround(
    "in-step BatchNormalization statistics on JAX",
    upstream=f"{_KERAS}/blob/v3.15.1/keras/src/backend/jax/nn.py",
    works_around="inside `jax.shard_map` (in-step mode's per-device "
    "micro-batch loop) Keras's JAX `moments` sees only the device's share "
    "of the micro-batch, and has no way to reduce over the devices "
    "(`synchronized=True` raises on JAX); plain `fit` under `DataParallel` "
    "normalises over the global batch, so keras-mgpu swaps Keras's "
    "`moments` in keras/src/backend/jax/nn.py for one that combines every "
    "device's statistics, while the in-step loop is traced",
    applied="by `GradientAccumulationModel(mode=\"in_step\")` on Keras's "
    "JAX backend under a distribution, during the trace of its step; acts "
    "on moments over the batch axis (BatchNormalization's)",
    remove_when="Keras's JAX `moments` (or BatchNormalization) can reduce "
    "over a `shard_map` axis (no upstream issue yet)")
_MIXED = _workaround(
    "the mixed-precision audit",
    upstream=f"{_KERAS}/blob/v3.15.1/keras/src/layers/layer.py",
    works_around="Keras has no public way to list a layer's own "
    "variables, sublayers, autocasting or a tensor's producing layer",
    applied="by `keras_mgpu.mixed_precision.audit`, `FP32OutputHead` and "
    "`LossScaleMonitor`",
    remove_when="Keras exposes those (no upstream issue yet)")
_JAX_LOGITS = _workaround(
    "the float32 head's logits for the losses on JAX",
    upstream=f"{_KERAS}/blob/v3.15.1/keras/src/backend/jax/nn.py",
    works_around="Keras's JAX cross-entropy (categorical, sparse "
    "categorical, binary) reads no logits with a softmax or sigmoid output "
    "(JAX arrays take no `_keras_logits` attribute, which the TensorFlow "
    "backend reads), so it clips the probabilities to [1e-7, 1 - 1e-7]; "
    "keras-mgpu wraps the three functions of "
    "`keras.src.backend.jax.nn` so that, given exactly an output of "
    "`FP32OutputHead`, they compute the loss from its float32 logits",
    applied="on Keras's JAX backend, from the first `FP32OutputHead` with a "
    "softmax or sigmoid activation built (or the first `audit`); acts only "
    "on the head's outputs",
    remove_when="Keras's JAX losses recover a softmax or sigmoid output's "
    "logits themselves (no upstream issue yet)")
_BACKUP = _workaround(
    "BackupAndRestore's resume hooks",
    upstream=f"{_KERAS}/blob/v3.15.1/keras/src/saving/saving_lib.py",
    works_around="`fit` can only be started at an epoch through "
    "`model._initial_epoch`; weights can be neither snapshotted to host "
    "memory without a file nor loaded from bytes",
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
_RUNNING_FIT = _workaround(
    "the running fit's callbacks and epoch iterator",
    upstream=f"{_KERAS_TF}/trainer.py",
    works_around="a callback sees neither the other callbacks of its `fit` "
    "(whose state the backup saves) nor the epoch iterator feeding the "
    "train function (whose position a resume continues), nor whether it "
    "runs inside `fit` at all",
    applied="from `import keras_mgpu` on: the trainer's `fit` and "
    "`EpochIterator.__init__` are wrapped, once, to record the running fit "
    "(they do nothing else); checked where keras-mgpu's callbacks are made",
    remove_when="Keras gives callbacks their `CallbackList` and the epoch "
    "iterator's position (no upstream issue yet)")
_CTRL_C = _workaround(
    "Ctrl-C during fit, taken at the next batch",
    upstream=f"{_KERAS}/blob/v3.15.1/keras/src/utils/python_utils.py",
    works_around="a KeyboardInterrupt raised where a Ctrl-C lands is lost "
    "in Keras's log conversion before each callback (a bare `except:` in "
    "`pythonify_logs`) and in TensorFlow's eager fast path "
    "(`TFE_Py_FastPathExecute` clears an error raised by the Python it "
    "calls, such as `TensorShape.__len__` as an epoch's data iterator is "
    "made, then may corrupt the heap): `fit` goes on, or the process dies",
    applied="where keras-mgpu's callbacks and runtime are made, on the main "
    "thread, if Python's own SIGINT handler is in place: inside a `fit` "
    "with keras-mgpu's runtime, a first Ctrl-C is raised at the next "
    "training or validation batch, or as `fit` returns; a second at once",
    remove_when="neither loses a KeyboardInterrupt: "
    "`test_stock_keras_still_swallows_ctrl_c_in_its_log_conversion` and "
    "`test_tensorflow_still_loses_a_ctrl_c_as_an_epochs_iterator_is_made` "
    "fail")
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
_RESTART_MARKER = _workaround(
    "DistributedLogger's TensorBoard restart marker",
    upstream="https://github.com/tensorflow/tensorflow/blob/v2.21.0/"
    "tensorflow/python/ops/summary_ops_v2.py",
    works_around="`tf.summary` writes only `Summary` protos: no public call "
    "writes the `SessionLog` START event after which TensorBoard's Python "
    "loaders drop the values a failed attempt wrote past the step a resume "
    "continues from (its data server drops them as the steps are written "
    "again)",
    applied="by `DistributedLogger` as a process's training begins, in "
    "each of the run's TensorBoard runs",
    remove_when="`tf.summary` writes an `Event` that is not a `Summary` (no "
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
"""Every workaround of an upstream bug or limitation keras-mgpu applies, a
`Workaround` record each, in the order of docs/compatibility.md's table."""
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
