"""`BackupAndRestore`: rerun the same command after a crash, end with the same model."""

from __future__ import annotations

import atexit
import hashlib
import io
import json
import os
import signal
import sys
import threading
import time
import warnings
from typing import Optional, Union

import keras
import numpy as np
import tensorflow as tf

from keras_mgpu._checks import is_nonempty_path, is_positive_int, is_url
from keras_mgpu import compat
from keras_mgpu.callbacks import _backup_store, callback_state
from keras_mgpu.callbacks._console import print_msg
from keras_mgpu.callbacks._backup_lock import BackupDirInUse, OwnerLock  # noqa: F401
from keras_mgpu import strategy as strategy_lib
from keras_mgpu.runtime import training_runtime

# The exit code after a SIGTERM save (143), and the exit codes each job
# runner reruns a job for, with their sources.
from keras_mgpu.callbacks._exit_codes import (  # noqa: F401
    RESTART_EXIT_CODE, RETRIED_EXIT_CODES)

FORMAT_VERSION = 3
# Format 2 (before #31): callback states as {"class", "values"} and no
# callbacks.npz. Still read; an older keras-mgpu refuses format 3 by name.
_READABLE_FORMATS = (2, FORMAT_VERSION)

# A preset is only a named set of constructor arguments.
PRESETS = {
    "epoch": {
        "save_freq": "epoch",
        "keep": 2,
    },
    "preemptible": {
        "save_freq": 50,
        "keep": 2,
        "save_on_sigterm": True,
        "exit_code": RESTART_EXIT_CODE,
    },
    "multi_worker": {
        "save_freq": 200,
        "keep": 3,
        "save_on_sigterm": True,
        "exit_code": RESTART_EXIT_CODE,
    },
}

# The background write of each backup_dir, while it may still run: a fit
# that raises leaves it running, and the next fit on that directory in this
# process waits for it.
_writes_in_flight = {}

_WEIGHTS = "weights.weights.h5"
_EXTRA = "variables.npz"
_STATE = "state.json"
# What a generation must hold to be restored.
_REQUIRED = frozenset({_WEIGHTS, _EXTRA, _STATE})


def list_presets() -> dict:
    """The presets of `BackupAndRestore.from_preset`, name to arguments.

    Example:

    >>> sorted(list_presets())
    ['epoch', 'multi_worker', 'preemptible']
    """
    return {name: dict(args) for name, args in PRESETS.items()}


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up training state so that a rerun resumes exactly where it died.

    Kill the training process at any point (SIGKILL, mid-epoch, mid
    accumulation window), run the same script again, and it ends with the
    same weights and the same number of optimizer steps as an uninterrupted
    run (given a deterministic input order). On restart it restores the model
    and optimizer variables (which include `iterations`, the learning-rate
    schedule's position, the loss scale, `GradientAccumulationModel`
    accumulators and the dropout seed generators), starts at the interrupted
    epoch, skips the batches that epoch had already consumed, and restores
    the state of the stateful callbacks in the same `fit` call:
    `EarlyStopping` (its best weights too), `ModelCheckpoint`,
    `ReduceLROnPlateau`, and any callback with `get_state()` and
    `set_state(state)` methods or a class registered with
    `keras_mgpu.callbacks.register_callback_state` (its arrays in the
    generation's `callbacks.npz`).

    A save stalls training only to copy the state into host memory: the
    variables (device-to-host copies) and the small state, a fifth to a
    quarter of the time of Keras's own synchronous save
    (`docs/benchmarks.md`). A background thread then writes them as a
    complete generation: into a `.tmp-*` directory inside `backup_dir` (no
    TMPDIR, no local staging for a URL), each file once, from memory, then
    moves the files into place and writes the manifest (sizes and SHA-256
    checksums of the same bytes) last, atomically (a temporary name, then a
    rename; local files are fsynced first): the manifest commits the
    generation, and a generation directory without one is a leftover of a
    killed save, skipped and removed. At most one save is in flight: the
    next one waits for it, so no save is skipped. The SIGTERM save and the
    end of `fit` wait for the write. If `fit` raises, the write finishes on
    its thread: the process waits for it before exiting, and the next `fit`
    on this `backup_dir` waits for it before reading. A SIGKILL mid-write
    leaves the previous generation in place. Host memory holds one copy of
    the saved state from the first save to the end of `fit` (the next save
    copies into it), and up to about two more while a write runs. The last
    `keep` generations are kept (1 by default, 2 with
    `double_checkpoint=True`); pruning deletes links, never what they point
    to. A restore verifies the newest
    generation (the manifest and state against their schema, every file it
    needs listed and matching its checksum; what is loaded is the bytes
    verified) and falls back to the previous one, with a warning naming it,
    if it is truncated, corrupt or incomplete; if every one is, it raises (see
    `restart_if_unusable`). Paths go through `tf.io.gfile`,
    so `gs://` and other TensorFlow filesystems work.

    A save that cannot be written (a full disk, a file-size limit, an
    unwritable `backup_dir`) stops training, at the next batch or save,
    with a `RuntimeError` naming the path and the cause; the previous
    generation stays intact and a rerun resumes from it (and fails the
    same way, with the same message, until there is room). Before writing
    to a local `backup_dir` it checks the free space and the file-size
    limit against the generation's size.

    One run at a time owns `backup_dir`: the chief keeps an owner lock
    there (`LOCK.json`: host, pid, process start time, a heartbeat every
    30 s). A second live run is refused with `BackupDirInUse` naming the
    owner. A lock whose process is gone (same machine), or whose heartbeat
    is 10 minutes old (another machine), is taken over with a warning, so
    a rerun after a crash or on a new machine needs nothing removed. The
    lock is released when `fit` ends, or raises one of this callback's
    errors; after another exception it stays with this process (its next
    `fit` takes it again) until the process exits.

    Each generation records what decides the math of a step: the optimizer
    (class and hyperparameters, not its learning-rate variable, which is
    restored), `accum_steps` and the random layers. A resume that changes
    them is refused with the old and new values. A resume mid-epoch skips
    the samples the interrupted epoch trained on: under another global
    batch size that divides them it is exact (with a warning), otherwise
    refused; another `steps_per_execution` is exact; data shorter than the
    saved position is refused before training. The replica count may
    change.

    The run's counters (`keras_mgpu.runtime`: global step, samples seen,
    resume history) are saved with each generation and continue after a
    resume, so `DistributedLogger`'s curves continue too. The batches to
    skip are skipped by that runtime, which `DistributedLogger` and
    `LossScaleMonitor` share: any callback order works. A run saved on one
    number of replicas may resume on another with the same global batch
    (the accumulators of a `GradientAccumulationModel` hold global sums).

    Under `MultiWorkerMirroredStrategy` every worker takes part in each save
    (reading replica-local variables is a collective), only the chief writes
    to `backup_dir`, and all workers resume from the same generation.

    An epoch's end is saved in `on_epoch_end`, as Keras saves it. If a
    stateful callback comes after this callback in the list, it is saved
    when the next epoch begins instead, once its `on_epoch_end` has set the
    state saved with it (a crash in between reruns that epoch): list this
    callback last to avoid that.

    Not restored: the running averages of the interrupted epoch's metrics
    (Keras restarts them each epoch; after a resume they cover the batches
    trained after it), and the order of data shuffled by a process-wide
    random generator: use a deterministic, or per-epoch seeded, input order.

    The first four arguments are those of `keras.callbacks.BackupAndRestore`,
    in its order and with its meaning, so either class can replace the
    other. What differs: a resume from a mid-epoch save continues at the
    saved batch (Keras's callback reruns that epoch from its first batch);
    generations are verified and written atomically; `save_freq` must be
    `"epoch"`, `False` or a positive integer (Keras 3.15's callback saves
    after every batch for `0`, negative values, `True` and `False`); the
    flags must be `True` or `False`. With one generation (the default) a
    save killed midway still leaves the previous commit intact (pruning
    follows the commit), but a generation damaged afterwards has no
    fallback: the restore raises (see `restart_if_unusable`). Use
    `double_checkpoint=True`, or `keep`, for a fallback. The presets set
    `keep` explicitly.

    Args:
        backup_dir: Where generations live (local path or any `tf.io.gfile`
            URL). Use one directory per training run.
        save_freq: Defaults to `"epoch"`: save at each epoch's end. An
            integer `n >= 1`: save every `n` batches. `False`: no periodic
            saves, only the SIGTERM save (needs `save_on_sigterm=True`;
            Keras documents `False` for preemption checkpointing).
        double_checkpoint: Defaults to `False`. `True`: keep the previous
            generation too, as the fallback when the newest is damaged
            (the same as `keep=2`). `False` with `keep=None` keeps one
            generation, as Keras keeps one checkpoint.
        delete_checkpoint: Defaults to `True`: a run that finishes deletes
            its generations. `False`: keep them.
        keep: Defaults to `None`: 2 generations if `double_checkpoint`,
            else 1. An integer `n >= 1`: keep the newest `n` (at least 2
            if `double_checkpoint=True`). Keyword-only.
        save_on_sigterm: Defaults to `False`. If `True`, SIGTERM (the usual
            preemption notice) makes the callback save at the next batch
            boundary and exit with `exit_code`. Keyword-only.
        exit_code: Defaults to `RESTART_EXIT_CODE` (143, 128 + SIGTERM,
            as TensorFlow's own preemption handler exits): the process exit
            status after a SIGTERM save, so a job runner knows to rerun.
            Kubeflow's TFJob (`restartPolicy: ExitCode`), Kubernetes Jobs
            and Vertex AI rerun on 143; SLURM reruns on the codes its
            `RequeueExit` lists (`RETRIED_EXIT_CODES`, `docs/backup.md`).
            Pass the code your job runner reruns on if it is another.
            Keyword-only.
        restart_if_unusable: Defaults to `False`: if `backup_dir` holds
            generations and every one is unusable (truncated, corrupt,
            incomplete), raise an error naming them instead of training
            from the start. `True`: warn, leave them, and train from the
            start. Keyword-only.

    Example:

    >>> import numpy as np, keras, tempfile
    >>> from keras_mgpu.callbacks import BackupAndRestore
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> backup = BackupAndRestore(tempfile.mkdtemp(), save_freq=2,
    ...                           double_checkpoint=True)
    >>> backup.keep
    2
    >>> preset = BackupAndRestore.from_preset(
    ...     "preemptible", tempfile.mkdtemp(), save_freq=2)
    >>> history = model.fit(np.ones((32, 4)), np.ones((32, 1)), batch_size=8,
    ...                     epochs=2, callbacks=[preset], verbose=0)
    >>> len(history.history["loss"])
    2
    """

    def __init__(
        self,
        backup_dir: str,
        save_freq: Union[str, int, bool] = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
        *,
        keep: Optional[int] = None,
        save_on_sigterm: bool = False,
        exit_code: int = RESTART_EXIT_CODE,
        restart_if_unusable: bool = False,
    ):
        super().__init__()
        if not is_nonempty_path(backup_dir):
            raise ValueError(
                f"backup_dir must be a non-empty path, got {backup_dir!r}."
            )
        _check_backup_dir(os.fspath(backup_dir))
        flags = {"double_checkpoint": double_checkpoint,
                 "delete_checkpoint": delete_checkpoint,
                 "save_on_sigterm": save_on_sigterm,
                 "restart_if_unusable": restart_if_unusable}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise TypeError(
                    f"{name} must be True or False, got {value!r} (a "
                    "non-empty string such as 'false' would count as True)."
                )
        if save_freq is False:
            if not save_on_sigterm:
                raise ValueError(
                    "save_freq=False makes no periodic saves: only the "
                    "SIGTERM save, which needs save_on_sigterm=True. Without "
                    "it nothing would ever be saved (Keras documents "
                    "save_freq=False for preemption checkpointing; "
                    "keras.callbacks.BackupAndRestore in Keras 3 saves after "
                    "every batch with it). Pass save_on_sigterm=True, or "
                    "save_freq=1 to save after every batch, or "
                    "save_freq='epoch'."
                )
        elif save_freq != "epoch" and not is_positive_int(save_freq):
            raise ValueError(
                f"Invalid value for save_freq: {save_freq!r}. Use 'epoch', a "
                "positive number of batches, or False (with "
                "save_on_sigterm=True: save only on SIGTERM). "
                "keras.callbacks.BackupAndRestore saves after every batch "
                "for 0, a negative number or True: that is save_freq=1."
            )
        if keep is None:
            keep = 2 if double_checkpoint else 1
        elif not is_positive_int(keep):
            raise ValueError(
                f"keep must be None or a positive integer, got {keep!r}: the "
                "newest generation is always kept."
            )
        elif double_checkpoint and keep < 2:
            raise ValueError(
                f"double_checkpoint=True keeps the previous generation as a "
                f"fallback, which needs keep >= 2, got keep={keep}. Pass "
                "keep=2 (or more, or leave keep=None), or "
                "double_checkpoint=False to keep one generation."
            )
        if (not isinstance(exit_code, int) or isinstance(exit_code, bool)
                or not 0 <= exit_code <= 255):
            raise ValueError(
                f"exit_code must be an integer from 0 to 255 (a process exit "
                f"status; 256 would exit 0), got {exit_code!r}."
            )
        self.backup_dir = str(backup_dir).rstrip("/")
        self.save_freq = save_freq
        # Batches between periodic saves; None: at epoch ends, or never.
        self._batch_freq = (
            None if save_freq == "epoch" or save_freq is False else save_freq)
        self.keep = keep
        # Whether a previous generation is kept as a fallback (keep >= 2),
        # however that was asked for.
        self.double_checkpoint = keep >= 2
        self.delete_checkpoint = delete_checkpoint
        self.save_on_sigterm = save_on_sigterm
        self.exit_code = exit_code
        self.restart_if_unusable = restart_if_unusable
        self._sigterm = threading.Event()
        self._previous_handler = None
        self._write = None  # the save being written in the background

    @classmethod
    def from_preset(cls, name: str, backup_dir: str, **overrides):
        """Builds the callback from a named preset, with `overrides` on top.

        Args:
            name: One of `list_presets()`.
            backup_dir: Where generations live.
            **overrides: Constructor arguments replacing the preset's.
        """
        if name not in PRESETS:
            raise ValueError(
                f"Unknown BackupAndRestore preset {name!r}. Valid presets: "
                f"{sorted(PRESETS)}."
            )
        return cls(backup_dir, **{**PRESETS[name], **overrides})

    # --- fit hooks ----------------------------------------------------------

    def on_train_begin(self, logs=None):
        compat.check_backup_support(self.model)
        left = _writes_in_flight.pop(self.backup_dir, None)
        if left is not None:
            # Left running by a fit that raised (this callback's or
            # another's): finished before this fit reads backup_dir.
            left.join()
            if left.error is not None:
                warnings.warn(f"BackupAndRestore: the last save of an "
                              f"earlier fit failed: {left.error}",
                              stacklevel=2)
        self._write = None
        # Walked again each fit: a recompile or a new optimizer changes
        # where the values are.
        self._layout = None
        model = self.model
        self._runtime = training_runtime(model)
        self._runtime.train_begin(self)
        self._strategy = model.distribute_strategy
        self._chief = strategy_lib.is_chief()
        self._multi_worker = strategy_lib.is_multi_worker(self._strategy)
        callbacks = list(compat.callback_siblings(self) or [])
        self._siblings = [c for c in callbacks if c is not self]
        # An epoch's end is saved in on_epoch_end, as Keras saves it, unless
        # a callback whose state is saved comes later in the list: then at
        # the next epoch's start, when that state is final.
        mine = next((i for i, c in enumerate(callbacks) if c is self), None)
        later = [] if mine is None else callbacks[mine + 1:]
        self._defer_epoch_end = bool(callback_state.stateful_callbacks(later))
        # A callback with half the protocol fails here, before training.
        callback_state.stateful_callbacks(self._siblings)
        self._epoch = 0
        self._last_saved_step = self._runtime.global_step
        self._pending_callback_state = None
        self._save_at_epoch_end = False
        self._epoch_end_save = None
        self._keep_backups = False
        self._lock = None
        self._store = _backup_store.GenerationStore(self.backup_dir,
                                                    keep=self.keep)
        if self._chief:
            _check_writable(self._store)
            # Before the restore, which sweeps what killed saves left.
            self._lock = OwnerLock(self.backup_dir)
            self._lock.acquire()
            # A fit that raises (Ctrl-C included) skips on_train_end: the
            # lock goes when the process exits, after the write in flight
            # (non-daemon threads are joined before atexit runs), so the
            # rerun finds no dead owner to take over from.
            atexit.register(self._release_lock)
        try:
            self._restore()
        except BaseException:
            # Keras skips on_train_end when fit raises: free backup_dir now.
            self._release_lock()
            raise
        if self.save_on_sigterm:
            self._install_sigterm_handler()

    def on_epoch_begin(self, epoch, logs=None):
        self._runtime.epoch_begin(epoch)
        self._save_pending_epoch_end()
        self._epoch = epoch
        if self._pending_callback_state is not None:
            # Applied here, not in on_train_begin: EarlyStopping resets its
            # own state in its on_train_begin, which may run after ours.
            callback_state.restore(self._siblings,
                                   self._pending_callback_state)
            self._pending_callback_state = None

    def on_train_batch_begin(self, batch, logs=None):
        self._runtime.train_batch_begin(batch)

    def on_train_batch_end(self, batch, logs=None):
        runtime = self._runtime
        runtime.train_batch_end(batch)
        self._refresh_lock()
        if self._write is not None and self._write.done():
            self._finish_write()  # raises here if the write failed
        if not runtime.batch_trains:
            return  # a batch the interrupted run had already trained on
        # What the call read, not Keras's `batch`: a last, partial call of
        # steps_per_execution batches reports more than it held.
        done = runtime.epoch_step
        if self._batch_freq is not None and (
            runtime.global_step // self._batch_freq
            > self._last_saved_step // self._batch_freq
        ):
            if runtime.last_call_of_epoch:
                # The epoch's last batch: save after its end-of-epoch work
                # instead, so a resume starts a fresh epoch.
                self._save_at_epoch_end = True
            else:
                self._save(self._epoch, done)
        if self.save_on_sigterm and self._sigterm_agreed():
            self._save(self._epoch, done)
            generation = self._finish_write()
            self.model.stop_training = True
            print(
                f"BackupAndRestore: SIGTERM received; saved generation "
                f"{generation} at epoch {self._epoch}, batch {done}. Exiting "
                f"with code {self.exit_code}: run the same command again to "
                "resume.",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(self.exit_code)

    def on_test_begin(self, logs=None):
        self._runtime.test_begin()

    def on_epoch_end(self, epoch, logs=None):
        self._runtime.epoch_end(epoch)
        if self.save_freq == "epoch" or self._save_at_epoch_end:
            self._save_at_epoch_end = False
            if self._defer_epoch_end:
                # Saved when the next epoch begins: by then every callback
                # has run its on_epoch_end (EarlyStopping's `best`, ...).
                self._epoch_end_save = epoch + 1
            else:
                self._save(epoch + 1, 0)

    def _save_pending_epoch_end(self) -> None:
        if self._epoch_end_save is not None:
            self._save(self._epoch_end_save, 0)
            self._epoch_end_save = None

    def on_train_end(self, logs=None):
        self._runtime.train_end()
        self._uninstall_sigterm_handler()
        if not self.delete_checkpoint:
            self._save_pending_epoch_end()
        compat.set_initial_epoch(self.model, None)
        self._finish_write()
        self._snapshot = None  # host memory the size of the saved state
        self._release_lock()
        if self.delete_checkpoint and self._chief and not self._keep_backups:
            self._store.delete()

    def _release_lock(self) -> None:
        atexit.unregister(self._release_lock)
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _refresh_lock(self) -> None:
        if self._lock is None:
            return
        try:
            self._lock.refresh()  # a file write at most every 30 s
        except (OSError, tf.errors.OpError) as e:
            # A storage blip: the next batch tries again. Another run taking
            # the lock over (BackupDirInUse) is not caught: it stops this one.
            warnings.warn(f"BackupAndRestore: could not refresh the owner "
                          f"lock of {self.backup_dir} ({e}).", stacklevel=2)

    # --- saving -------------------------------------------------------------

    def _save(self, epoch: int, step_in_epoch: int) -> None:
        """Takes a snapshot of the training state; the chief writes it as
        the next generation on a background thread.

        The training thread only reads: the variables into host memory
        (what `save_weights` writes, and the RNG states it leaves out) and
        the small state. At most one save is in flight: a save first waits
        for the previous one's write, so none is skipped (each is a point a
        rerun may resume from, and the SIGTERM save is the one that counts).
        """
        self._last_saved_step = self._runtime.global_step
        self._finish_write()
        # Collectives under MultiWorkerMirroredStrategy (replica-local
        # variables are all-reduced on read): every worker reads, in this
        # order. Only the chief keeps what it read.
        if self._layout is None:
            self._layout = compat.weights_layout(self.model)
            self._snapshot = None
        # Into the previous save's arrays: its write has finished.
        weights = self._snapshot = self._layout.read(into=self._snapshot)
        extra = [np.asarray(v.numpy()) for v in _unsaved_variables(self.model)]
        runtime_state = self._runtime.state()
        if not self._chief:
            return
        callbacks, callback_arrays = callback_state.snapshot(self._siblings)
        state = {
            "format": FORMAT_VERSION,
            "keras_mgpu_version": _version(),
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "runtime": runtime_state,
            "architecture": _fingerprint(self.model),
            "training": _training_config(self.model, self.params),
            "callbacks": callbacks,
            "time": time.time(),
        }
        files = ({} if callback_arrays is None
                 else {callback_state.ARRAYS_FILE: callback_arrays})
        self._write = _Write(self._write_generation, weights, extra, state,
                             files)
        _writes_in_flight[self.backup_dir] = self._write

    def _finish_write(self) -> Optional[int]:
        """Waits for the save in flight, if any; the generation it wrote.
        Raises its failure (which stops training)."""
        write, self._write = self._write, None
        if write is None:
            return None
        if _writes_in_flight.get(self.backup_dir) is write:
            del _writes_in_flight[self.backup_dir]
        write.join()
        if write.error is not None:
            self._release_lock()
            raise write.error
        return write.number

    def _write_generation(self, weights: list, extra: list,
                          state: dict, more_files: dict) -> int:
        """Writes one generation from a snapshot (on the writer thread):
        every file once, from memory; returns its number. `more_files`:
        name to bytes (the callbacks' arrays)."""
        buffer = io.BytesIO()
        np.savez(buffer, *extra)
        files = {
            _WEIGHTS: compat.weights_file(weights),
            _EXTRA: buffer.getvalue(),
            _STATE: json.dumps(state, allow_nan=True).encode(),
            **more_files,
        }
        try:
            return self._store.write(files)
        except _backup_store.WriteFailed as e:
            previous = (
                f"Generation {e.previous} is intact: make room in (or fix) "
                "backup_dir and rerun, and the run resumes from it."
                if e.previous is not None else "No earlier generation exists."
            )
            raise RuntimeError(
                f"BackupAndRestore could not write generation {e.number} to "
                f"{e.path} ({type(e.cause).__name__}: {e.cause}). Training "
                f"stops. {previous}"
            ) from e.cause
        except _backup_store.PruneFailed as e:
            raise RuntimeError(
                f"BackupAndRestore committed generation {e.number} to "
                f"{self.backup_dir} but could not remove older generations "
                f"({type(e.cause).__name__}: {e.cause}). Training stops; "
                f"fix backup_dir and rerun, and the run resumes from "
                f"generation {e.number}."
            ) from e.cause

    # --- restoring ----------------------------------------------------------

    def _restore(self) -> None:
        store = self._store
        if self._chief and tf.io.gfile.exists(self.backup_dir):
            # What killed saves left: uncommitted, so never read.
            store.remove_leftovers()
        found = store.latest_usable(_REQUIRED, validate=_parse_state)
        chosen, state, files = found.number, found.value, found.files
        unusable = [f"generation {n} ({why})" for n, why in found.unusable]
        fallbacks = [n for n, _ in found.unusable[1:]] + [chosen]
        for (number, why), fallback in zip(found.unusable, fallbacks):
            if fallback is not None:
                warnings.warn(
                    f"BackupAndRestore: generation {number} in "
                    f"{self.backup_dir} is unusable ({why}); falling back "
                    f"to generation {fallback}.",
                    stacklevel=2,
                )
        if self._multi_worker:
            self._check_same_generation(chosen or 0)
        if chosen is None:
            if unusable:
                self._all_unusable(unusable)
            return
        self._check_compatible(state, chosen, files)
        model = self.model
        if not model.built:
            raise ValueError(
                f"Cannot restore from {self.backup_dir}: the model is not "
                "built. Build it (e.g. give it a keras.Input) before fit()."
            )
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        # The bytes verified above, not the file read again: no TMPDIR
        # needed either.
        compat.load_weights_file(model, files[_WEIGHTS])
        with np.load(io.BytesIO(files[_EXTRA])) as extra:
            for i, variable in enumerate(_unsaved_variables(model)):
                variable.assign(extra[f"arr_{i}"])
        epochs = (self.params or {}).get("epochs")
        if epochs is not None and state["epoch"] >= epochs:
            # fit would train nothing, and then delete the only record of
            # the run as if it had finished.
            self._keep_backups = True
            warnings.warn(
                f"BackupAndRestore: the backup in {self.backup_dir} "
                f"(generation {chosen}) is at epoch {state['epoch']}, but "
                f"fit(epochs={epochs}) ends before it: nothing is trained and "
                "the backups are kept. Raise epochs to continue that run, or "
                "use a new backup_dir to start another.",
                stacklevel=3,
            )
        compat.set_initial_epoch(model, state["epoch"])
        self._runtime.resume(state["runtime"], generation=chosen,
                             epoch=state["epoch"],
                             step_in_epoch=state["step_in_epoch"])
        self._last_saved_step = self._runtime.global_step
        self._pending_callback_state = state["callbacks"]
        if self._chief:
            # Epochs counted as Keras's progress bar counts them; the step is
            # the batches of that epoch already trained.
            print_msg(
                f"BackupAndRestore: resumed from backup generation {chosen} "
                f"at epoch {state['epoch'] + 1}, step "
                f"{state['step_in_epoch']} ({self.backup_dir})"
            )

    def _all_unusable(self, unusable: list) -> None:
        message = (
            f"Every backup generation in {self.backup_dir} is unusable: "
            f"{'; '.join(unusable)}."
        )
        if not self.restart_if_unusable:
            raise RuntimeError(
                f"{message} Nothing was restored and nothing was deleted. To "
                "train from the start, pass restart_if_unusable=True or use a "
                "new backup_dir."
            )
        warnings.warn(f"BackupAndRestore: {message} Training from the start "
                      "(restart_if_unusable=True).", stacklevel=3)

    def _check_compatible(self, state: dict, number: int, files: dict) -> None:
        where = f"generation {number} in {self.backup_dir}"
        if state.get("format") not in _READABLE_FORMATS:
            raise ValueError(
                f"The backup ({where}) was written by keras-mgpu "
                f"{state.get('keras_mgpu_version')} in format "
                f"{state.get('format')}; this keras-mgpu ({_version()}) reads "
                f"formats {' and '.join(map(str, _READABLE_FORMATS))}. Resume "
                "with that version, or use a new backup_dir. The backup was "
                "left untouched."
            )
        if state["architecture"] != _fingerprint(self.model):
            raise ValueError(
                f"The backup ({where}) was made by a model with different "
                "variables (names, shapes or dtypes) than this one. Use a new "
                "backup_dir for a new architecture, or restore the original "
                "model code. The backup was left untouched."
            )
        with np.load(io.BytesIO(files[_EXTRA])) as extra:
            saved_random = len(extra.files)
        random = len(_unsaved_variables(self.model))
        if saved_random != random:
            raise ValueError(
                f"The backup ({where}) holds {saved_random} random-generator "
                f"state(s) (Dropout, noise and other random layers); this "
                f"model has {random}: its layers changed. Use a new "
                "backup_dir for the new model, or restore the original model "
                "code. The backup was left untouched."
            )
        saved = state.get("training")
        if saved is not None:
            _check_same_training(saved, _training_config(self.model, None),
                                 where)

    def _check_same_generation(self, number: int) -> None:
        total = _sum_over_workers(self._strategy, float(number))
        expected = number * strategy_lib.num_workers()
        if total != expected:
            raise RuntimeError(
                f"Workers see different backups in {self.backup_dir} (this "
                f"worker: generation {number}). backup_dir must be storage "
                "that every worker reads the same, e.g. a shared filesystem "
                "or gs://."
            )

    # --- SIGTERM ------------------------------------------------------------

    def _install_sigterm_handler(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "BackupAndRestore(save_on_sigterm=True) needs fit() on the "
                "main thread to catch SIGTERM; it will not save on SIGTERM.",
                stacklevel=2,
            )
            return
        self._sigterm.clear()
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        # None: a handler set outside Python; the default is what it did.
        self._previous_handler = (
            signal.SIG_DFL if previous is None else previous)

    def _on_sigterm(self, signum, frame) -> None:
        if _inside_fit(frame, self.model):
            self._sigterm.set()  # saved and acted on at the batch's end
            return
        # `fit` raised, so `on_train_end` never put the old handler back:
        # do it now, and let that handler (default: terminate) have the
        # signal, rather than ignore it forever.
        previous = self._previous_handler
        self._uninstall_sigterm_handler()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.raise_signal(signum)

    def _uninstall_sigterm_handler(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def _sigterm_agreed(self) -> bool:
        mine = 1.0 if self._sigterm.is_set() else 0.0
        if not self._multi_worker:
            return bool(mine)
        # All workers must save together (saving is a collective), so one
        # worker's notice stops them all at the same batch.
        return _sum_over_workers(self._strategy, mine) > 0


def _check_backup_dir(path: str) -> None:
    """Refuses a `backup_dir` that names no directory of its own."""
    if is_url(path):
        scheme, location = path.split("://", 1)
        if not location.strip("/"):
            raise ValueError(
                f"backup_dir={path!r} names a filesystem but no bucket or "
                "directory in it (the path would be a local folder named "
                f"{scheme + ':'!r}). Give the directory for this run's "
                f"backups, e.g. '{scheme}://bucket/run1/backup'."
            )
    elif not path.strip("/"):
        raise ValueError(
            f"backup_dir={path!r} is the filesystem root: BackupAndRestore "
            "creates and deletes its generations in backup_dir, and the "
            "directory itself after a finished run. Give a directory of "
            "its own, e.g. '/tmp/run1/backup'."
        )


def _inside_fit(frame, model) -> bool:
    """Whether `frame` (where a signal interrupted the main thread) runs
    inside `model.fit`."""
    while frame is not None:
        if (frame.f_code.co_name == "fit"
                and frame.f_locals.get("self") is model):
            return True
        frame = frame.f_back
    return False


class _Write:
    """One generation being written on a thread of its own."""

    def __init__(self, write, *args):
        self.number = None
        self.error = None
        # Not a daemon: if `fit` raises, the process still finishes this
        # write (a complete, committed generation) before it exits.
        self._thread = threading.Thread(
            target=self._run, args=(write, args),
            name="keras-mgpu-backup-write")
        self._thread.start()

    def _run(self, write, args) -> None:
        try:
            self.number = write(*args)
        except BaseException as e:  # raised on the training thread
            self.error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()


def _check_writable(store) -> None:
    try:
        store.check_writable()
    except (tf.errors.OpError, OSError) as e:
        raise PermissionError(
            f"BackupAndRestore cannot write to backup_dir={store.directory!r} "
            f"({type(e).__name__}: {e}). Choose a writable directory; any "
            "backup already there was left untouched."
        ) from None


def _parse_state(files: dict) -> dict:
    """The state of a generation whose files verified, checked against its
    schema; `CorruptGeneration` if it is not what a save writes."""
    bad = _backup_store.CorruptGeneration
    try:
        state = json.loads(files[_STATE])
    except ValueError as e:
        raise bad(f"{_STATE} is not JSON ({e})") from None
    if not isinstance(state, dict):
        raise bad(f"{_STATE} holds {type(state).__name__}, not an object")
    if state.get("format") not in _READABLE_FORMATS:
        # Another version's layout: refused as such by _check_compatible.
        return state
    checks = {
        "epoch": _is_count, "step_in_epoch": _is_count,
        "runtime": lambda v: isinstance(v, dict),
        "architecture": lambda v: isinstance(v, str),
        "training": lambda v: v is None or (
            isinstance(v, dict) and {"optimizer", "accum_steps"} <= set(v)
            and (v["optimizer"] is None or (
                isinstance(v["optimizer"], dict)
                and isinstance(v["optimizer"].get("class"), str)
                and "config" in v["optimizer"]))),
        # "values": the key of backups written before get_state/set_state.
        "callbacks": lambda v: isinstance(v, list) and all(
            isinstance(c, dict) and isinstance(c.get("class"), str)
            and isinstance(c.get("state", c.get("values")), dict) for c in v),
    }
    runtime = state.get("runtime")
    runtime_checks = {
        "global_step": _is_count,
        "samples_seen": lambda v: v is None or _is_amount(v),
        "epoch_samples": lambda v: v is None or _is_amount(v),
        "updates_offset": lambda v: v is None or _is_count(v),
        "input_wait_seconds": _is_amount,
        "replicas": lambda v: _is_count(v) and v >= 1,
        "resumes": lambda v: isinstance(v, list) and all(
            isinstance(e, dict) and set(e) == {
                "generation", "step", "epoch", "saved_replicas", "replicas"}
            and all(_is_count(x) for x in e.values()) for e in v),
    }
    # Written since the runtime counts a data stream kept across epochs:
    # absent from older backups, where they mean 0.
    optional_runtime_checks = {
        "stream_before_epoch": _is_count,
        "keras_count_before_epoch": _is_count,
    }
    problems = [
        f"{key} {state.get(key, '(missing)')!r}"
        for key, valid in checks.items()
        if key not in state or not valid(state[key])
    ]
    if isinstance(runtime, dict):
        problems += [
            f"runtime.{key} {runtime.get(key, '(missing)')!r}"
            for key, valid in runtime_checks.items()
            if key not in runtime or not valid(runtime[key])
        ] + [
            f"runtime.{key} {runtime[key]!r}"
            for key, valid in optional_runtime_checks.items()
            if key in runtime and not valid(runtime[key])
        ]
    if problems:
        raise bad(f"{_STATE} has an invalid {', '.join(problems)}")
    try:
        # Arrays of the callbacks' states: a missing one is this
        # generation's fault, as a missing file is.
        state["callbacks"] = callback_state.decode(
            state["callbacks"], files.get(callback_state.ARRAYS_FILE))
    except ValueError as e:
        raise bad(str(e)) from None
    return state


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_amount(value) -> bool:
    import math

    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)


# For reading a backup_dir outside `fit` (tests, tools).
def _generation_dir(directory: str, number: int) -> str:
    return _backup_store.GenerationStore(directory).path(number)


def _generations(directory: str) -> list:
    """Committed generation numbers, newest first."""
    return _backup_store.GenerationStore(directory).generations()


def _read_generation(directory: str, number: int):
    """(state, the other files) of a generation, verified."""
    files = _backup_store.GenerationStore(directory).read(number, _REQUIRED)
    return _parse_state(files), {k: v for k, v in files.items()
                                 if k != _STATE}


def _unsaved_variables(model) -> list:
    """Model variables that `save_weights` leaves out: RNG seed states."""
    saved = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in saved]


def _fingerprint(model) -> str:
    # Shapes and dtypes in order, not names: Keras numbers layer names per
    # process, so the same architecture can be named differently.
    spec = [
        (tuple(v.shape), keras.backend.standardize_dtype(v.dtype))
        for v in model.weights
    ]
    return hashlib.sha256(repr(spec).encode()).hexdigest()


def _training_config(model, params) -> dict:
    """What decides the math of a step, besides the weights: the optimizer
    (class and hyperparameters) and the accumulation window. The batch size
    is checked by the runtime as it skips (by samples); replicas may change
    (the accumulators hold global sums); `epochs` is only recorded."""
    optimizer = getattr(model, "optimizer", None)
    return {
        "optimizer": None if optimizer is None else {
            "class": type(optimizer).__name__,
            "config": _hyperparameters(optimizer.get_config()),
        },
        "accum_steps": getattr(model, "accum_steps", None),
        "epochs": (params or {}).get("epochs"),
    }


def _hyperparameters(config):
    """A JSON copy of an optimizer config without its names (Keras numbers
    them per process: "adam_1") or its plain learning rate: that is a
    variable, restored with the weights (ReduceLROnPlateau may have changed
    it); a schedule's config is kept."""
    if isinstance(config, dict):
        return {
            key: _hyperparameters(value) for key, value in config.items()
            if key != "name" and not (
                key == "learning_rate" and isinstance(value, (int, float)))
        }
    if isinstance(config, (list, tuple)):
        return [_hyperparameters(v) for v in config]
    return json.loads(json.dumps(config, default=repr))


def _check_same_training(saved: dict, now: dict, where: str) -> None:
    changes = []
    if saved["accum_steps"] != now["accum_steps"]:
        changes.append(f"accum_steps {saved['accum_steps']} -> "
                       f"{now['accum_steps']}")
    old, new = saved["optimizer"], now["optimizer"]
    if (old is None) != (new is None) or (
            old is not None and old["class"] != new["class"]):
        changes.append(f"optimizer {old and old['class']} -> "
                       f"{new and new['class']}")
    elif old is not None:
        flat_old, flat_new = _flatten(old["config"]), _flatten(new["config"])
        changes += [
            f"optimizer {key} {flat_old.get(key)!r} -> {flat_new.get(key)!r}"
            for key in sorted(set(flat_old) | set(flat_new))
            if flat_old.get(key) != flat_new.get(key)
        ]
    if changes:
        raise ValueError(
            f"The backup ({where}) was trained differently: "
            f"{'; '.join(changes)}. Resuming would not continue that run "
            "(the optimizer's state and schedule would restart or change "
            "meaning). Compile as the saved run did to resume it, or use a "
            "new backup_dir to start fresh. The backup was left untouched."
        )


def _flatten(config, prefix: str = "") -> dict:
    if not isinstance(config, dict):
        return {prefix: config}
    flat = {}
    for key, value in config.items():
        flat.update(_flatten(value, f"{prefix}{key}." if isinstance(
            value, dict) else f"{prefix}{key}"))
    return flat


def _sum_over_workers(strategy, value: float) -> float:
    """A real all-reduce of one number across every replica."""
    per_replica = strategy.run(
        lambda: tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, tf.constant(value, tf.float32)
        )
    )
    total = strategy.experimental_local_results(per_replica)[0].numpy()
    # Each worker's value was contributed by each of its local replicas.
    return float(total) / len(strategy.extended.worker_devices)


def _version() -> str:
    import keras_mgpu

    return keras_mgpu.__version__
