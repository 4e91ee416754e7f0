"""`BackupAndRestore`: rerun the same command after a crash, end with the same model.

The callback decides when to save and restore; the other modules of this
package do the rest (see docs/architecture.md).
"""

from __future__ import annotations

import atexit
import dataclasses
import sys
import time
import warnings
from typing import Any, Optional, Union

import tensorflow as tf

from keras_mgpu import _fs
from keras_mgpu import compat
from keras_mgpu import strategy as strategy_lib
from keras_mgpu._version import __version__
from keras_mgpu.callbacks._console import print_msg
from keras_mgpu.callbacks.backup import generation, local_tier, writer
from keras_mgpu.callbacks.backup import state as callback_state
from keras_mgpu.callbacks.backup.compatibility import (fingerprint,
                                                      training_config)
from keras_mgpu.cluster.exit_codes import RESTART_EXIT_CODE
from keras_mgpu.goodput.ledger import ledger
from keras_mgpu.callbacks.backup.lock import OwnerLock
from keras_mgpu.callbacks.backup.options import (check_arguments,
                                                 check_local_tier,
                                                 check_writable)
from keras_mgpu.callbacks.backup.preemption import SigtermNotice
from keras_mgpu.callbacks.backup.presets import preset_arguments
from keras_mgpu.callbacks.backup.restore import Restored, restore_latest
from keras_mgpu.callbacks.backup.schedule import SaveSchedule
from keras_mgpu.callbacks.backup.snapshot import HostSnapshot
from keras_mgpu.callbacks.backup.store import GenerationStore
from keras_mgpu.runtime import RuntimeCallback, TrainingRuntime


@dataclasses.dataclass(frozen=True)
class _Fit:
    """Who takes part in the `fit` now running, and where it saves."""

    runtime: TrainingRuntime
    strategy: object  # the model's strategy (TensorFlow) or distribution (JAX)
    chief: bool
    multi_worker: bool
    siblings: list  # the other callbacks of the list
    store: GenerationStore


class BackupAndRestore(RuntimeCallback):
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
    restored), `accum_steps` (or a `GradientAccumulationModel`'s
    `global_batch_size`) and the random layers. A resume that changes
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
    With its `global_batch_size`, the micro-batches per step are planned
    again for the new count, and a save due inside a window (periodic or
    on SIGTERM) waits for the window's end (at most `accum_steps - 1`
    batches), so the run resumes on any count whose micro-batches divide
    the global batch.

    Under `MultiWorkerMirroredStrategy` every worker takes part in each save
    (reading replica-local variables is a collective), only the chief writes
    to `backup_dir` (every worker to its local tier, if any), and all
    workers resume from the same generation. On
    Keras's JAX backend, under a `keras.distribution` distribution, the
    same holds for `jax.distributed` processes (process 0 is the chief); a
    variable split over devices of other processes (`ModelParallel`) is
    gathered from them for the save.

    A local tier (`local_dir`) makes a failure cost fewer steps: saves every
    `local_save_freq` batches go to a fast folder on each worker's own
    machine (for example under `/dev/shm`), every worker writing its own
    copy, with the same store and checks; `backup_dir` is written every
    `save_freq` batches as before (each durable save is a local one too). A
    local save waits only for the previous local write, not for a durable
    write in flight. A restore takes the newest local generation that every
    worker has and that is not older than the newest durable one (the
    workers agree on it in one collective), else the durable tier: a worker
    whose local folder is gone (a new machine, a reboot) makes the run
    resume from `backup_dir`. A damaged local generation is removed with a
    warning, and local generations newer than the one resumed from are
    removed. A finished run deletes both tiers (with `delete_checkpoint`).

    Not `async_safe`: a save at a batch end copies the state that batch
    left, and a SIGTERM stops the run there, so its batch ends run in
    order on the training thread. On JAX that makes Keras wait for each
    step before dispatching the next (Keras's own `BackupAndRestore` does
    the same); `docs/benchmarks.md` gives the cost.

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
        local_dir: Defaults to `None`: no local tier. A folder on each
            worker's machine (not a URL; one per run: each worker uses
            `<local_dir>/worker-<index>`), or `"auto"`: a folder named
            after `backup_dir` under `/dev/shm` where that exists (a
            first save that finds no room there for three generations
            warns and writes `backup_dir` only), and no local tier where
            `save_freq` leaves no room for more frequent saves
            (`"epoch"`, `False`, `1`). Keyword-only.
        local_save_freq: Defaults to `None`: a tenth of `save_freq` (at
            least 1); required for an explicit `local_dir` with
            `save_freq="epoch"` or `False`. Batches between local saves,
            fewer than `save_freq`. Keyword-only.

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
        local_dir: Optional[str] = None,
        local_save_freq: Optional[int] = None,
    ):
        super().__init__()
        keep = check_arguments(
            backup_dir, save_freq, double_checkpoint, delete_checkpoint, keep,
            save_on_sigterm, exit_code, restart_if_unusable)
        self.backup_dir = str(backup_dir).rstrip("/")
        self.local_save_freq = check_local_tier(
            local_dir, local_save_freq, self.backup_dir, save_freq)
        if self.local_save_freq is None:
            local_dir = None
        # The folder the local tier uses ("auto" resolved; None: none).
        self.local_dir = local_tier.resolve(
            None if local_dir is None else str(local_dir).rstrip("/"),
            self.backup_dir)
        # Every worker has one if the local tier is on, even where "auto"
        # found no RAM folder: the workers agree on a restore together.
        self._local = None if self.local_save_freq is None else (
            local_tier.LocalTier(self.local_dir, self.local_save_freq,
                                 auto=local_dir == "auto"))
        self.save_freq = save_freq
        self.keep = keep
        self.delete_checkpoint = delete_checkpoint
        self.save_on_sigterm = save_on_sigterm
        self.exit_code = exit_code
        self.restart_if_unusable = restart_if_unusable
        self._schedule = SaveSchedule(save_freq)
        self._writer = writer.GenerationWriter(self.backup_dir)
        self._host = HostSnapshot()
        self._preemption = SigtermNotice()
        # The chief's, from train begin to end.
        self._lock: Optional[OwnerLock] = None
        self._fit: Optional[_Fit] = None  # from the first on_train_begin
        self._restored = Restored()

    @property
    def double_checkpoint(self) -> bool:
        """Whether a previous generation is kept as a fallback (keep >= 2),
        however that was asked for."""
        return self.keep >= 2

    @classmethod
    def from_preset(cls, name: str, backup_dir: str,
                    **overrides: Any) -> BackupAndRestore:
        """Builds the callback from a named preset, with `overrides` on top.

        Args:
            name: One of `list_presets()`.
            backup_dir: Where generations live.
            **overrides: Constructor arguments replacing the preset's.
        """
        return cls(backup_dir, **preset_arguments(name, overrides))

    @property
    def _write(self) -> Optional[writer.BackgroundWrite]:
        """The save being written in the background, if any."""
        return self._writer.current

    # --- fit hooks ----------------------------------------------------------

    def on_train_begin(self, logs=None):
        compat.check_backup_support(self.model)
        if self._local is not None:
            self._local.start()
        errors = [w.wait_for_earlier() for w in self._writers()]
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            warnings.warn(f"BackupAndRestore: the last save of an "
                          f"earlier fit failed: {error}", stacklevel=2)
        self._host.check_layout()
        model = self.model
        super().on_train_begin(logs)
        runtime = self.runtime
        strategy = strategy_lib.of_model(model)
        running = compat.running_fit(model)
        callbacks = [] if running is None else running.callbacks
        self._fit = _Fit(
            runtime=runtime, strategy=strategy,
            chief=strategy_lib.is_chief(),
            multi_worker=strategy_lib.is_multi_worker(strategy),
            siblings=[c for c in callbacks if c is not self],
            store=GenerationStore(self.backup_dir, keep=self.keep))
        # An epoch's end is saved in on_epoch_end, as Keras saves it, unless
        # a callback whose state is saved comes later in the list: then at
        # the next epoch's start, when that state is final.
        mine = next((i for i, c in enumerate(callbacks) if c is self), None)
        later = [] if mine is None else callbacks[mine + 1:]
        defer = bool(callback_state.stateful_callbacks(later))
        # A callback with half the protocol fails here, before training.
        callback_state.stateful_callbacks(self._fit.siblings)
        for schedule in self._schedules():
            schedule.start(runtime.global_step, defer_epoch_end=defer)
        self._restored = Restored()
        self._lock = None
        if self._fit.chief:
            # Claimed before anything is written there: a probe beside a
            # live owner (whose restore sweeps temporary files) could fail
            # as an unwritable folder instead of naming that owner. Before
            # the restore, which sweeps what killed saves left.
            self._lock = OwnerLock(
                self.backup_dir, running=None if running is None
                else lambda: running.running)
            try:
                self._lock.acquire()
            except _fs.ERRORS:
                # Raises the unwritable folder's message, if it is that.
                check_writable(self._fit.store)
                raise
            # A fit that raises (Ctrl-C included) skips on_train_end: the
            # lock goes when the process exits, after the write in flight
            # (non-daemon threads are joined before atexit runs), so the
            # rerun finds no dead owner to take over from.
            atexit.register(self._release_lock)
        try:
            if self._fit.chief:
                check_writable(self._fit.store)
            with ledger().spending("restore"):
                self._restored = restore_latest(
                    model, self._fit, self.backup_dir, self.params,
                    restart_if_unusable=self.restart_if_unusable,
                    local=self._local)
        except BaseException:
            # Keras skips on_train_end when fit raises: free backup_dir now.
            self._release_lock()
            raise
        # Where the restore left the run, if it did.
        for schedule in self._schedules():
            schedule.saved_at(runtime.global_step)
        if self.save_on_sigterm:
            self._preemption.fit_started(model)

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        self._save_pending_epoch_end()
        self._schedule.epoch = epoch
        if self._restored.callback_states is not None:
            # Applied here, not in on_train_begin: EarlyStopping resets its
            # own state in its on_train_begin, which may run after ours.
            assert self._fit is not None  # set by on_train_begin
            callback_state.restore(self._fit.siblings,
                                   self._restored.callback_states)
            self._restored.callback_states = None
        self._announce_resume()

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        self._announce_resume(mid_epoch=True)
        assert self._fit is not None  # set by on_train_begin
        runtime = self._fit.runtime
        self._refresh_lock()
        if any(w.current is not None and w.current.done()
               for w in self._writers()):
            self._finish_write()  # raises here if a write failed
        if not runtime.batch_trains:
            return  # a batch the interrupted run had already trained on
        # What the call read, not Keras's `batch`: a last, partial call of
        # steps_per_execution batches reports more than it held.
        done = runtime.epoch_step
        epoch = self._schedule.epoch
        due = [schedule.due_after_batch(runtime.global_step,
                                        runtime.last_call_of_epoch)
               for schedule in self._schedules()]
        # Read (a host read of the window) only where a save could follow.
        if (any(due) or self.save_on_sigterm) and _window_open(self.model):
            return
        if any(due):
            self._save(epoch, done, durable=due[0])
        if self.save_on_sigterm and self._preemption.agreed(
                self._fit.strategy, self._fit.multi_worker):
            self._save(epoch, done)
            generation_number = self._finish_write()
            self.model.stop_training = True
            # Only the chief writes: the others took part in its save.
            saved = (f"saved generation {generation_number}"
                     if self._fit.chief else "the chief saved this run")
            print(
                # Counted as the resume's message (and Keras's progress
                # bar) counts them.
                f"BackupAndRestore: SIGTERM received; {saved} at epoch "
                f"{epoch + 1}, step {done}. Exiting with code "
                f"{self.exit_code}: run the same command again to resume.",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(self.exit_code)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self._announce_resume()
        self._save_epoch_start([schedule.due_at_epoch_end(epoch)
                                for schedule in self._schedules()])

    def _save_pending_epoch_end(self) -> None:
        self._save_epoch_start([schedule.take_deferred()
                                for schedule in self._schedules()])

    def _save_epoch_start(self, due: list) -> None:
        """Saves as the epoch in `due` (the durable schedule's answer first,
        then the local tier's) starts, if any tier is due."""
        started = next((epoch for epoch in due if epoch is not None), None)
        if started is not None:
            self._save(started, 0, durable=due[0] is not None)

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        self._announce_resume()  # a fit past the backup's epoch trains none
        self._preemption.fit_ended()
        if not self.delete_checkpoint:
            self._save_pending_epoch_end()
        compat.set_initial_epoch(self.model, None)
        self._finish_write()
        self._host.free()
        self._release_lock()
        assert self._fit is not None  # set by on_train_begin
        if self.delete_checkpoint and not self._restored.keep_backups:
            if self._fit.chief:
                self._fit.store.delete()
            if self._local is not None:
                self._local.delete()

    def _announce_resume(self, mid_epoch: bool = False) -> None:
        """Prints where the run resumed from (the chief), once nothing can
        refuse the resume any more: the generation's checks passed in
        `on_train_begin`, the other callbacks took their states when the
        first epoch began, and the runtime has skipped the batches the
        interrupted run trained (this run's data or batch size can refuse
        the resume until then). A refused resume says nothing of resuming."""
        line = self._restored.announcement
        if line is None:
            return
        assert self._fit is not None  # set by on_train_begin
        if self._fit.runtime.skipping:
            return
        self._restored.announcement = None
        if mid_epoch and (self.params or {}).get("verbose") in (1, "auto"):
            # Off the progress bar's unfinished line, as Keras's
            # ModelCheckpoint starts its lines within an epoch.
            line = "\n" + line
        print_msg(line)

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

    def _schedules(self) -> list:
        """The durable tier's save schedule, then the local tier's."""
        return [self._schedule] + (
            [] if self._local is None else [self._local.schedule])

    def _writers(self) -> list:
        """The local tier's writer (if it writes), then the durable one's:
        the order a save waits for them in (the local write starts the
        durable one)."""
        local = self._local
        return ([] if local is None or local.writer is None
                else [local.writer]) + [self._writer]

    def _save(self, epoch: int, step_in_epoch: int,
              durable: bool = True) -> None:
        """Takes a snapshot of the training state; the chief writes it as
        the next durable generation (if `durable`), every worker as its
        next local one (with a local tier), on background threads.

        The training thread only reads: the variables into host memory
        (what `save_weights` writes, and the RNG states it leaves out) and
        the small state. At most one write is in flight per tier: a save
        first waits for the previous one's write in the tiers it writes to,
        so none is skipped (each is a point a rerun may resume from, and
        the SIGTERM save is the one that counts). A local save does not
        wait for a durable write in flight.
        """
        with ledger().spending("checkpoint"):
            self._snapshot(epoch, step_in_epoch, durable)

    def _snapshot(self, epoch: int, step_in_epoch: int,
                  durable: bool) -> None:
        fit = self._fit
        assert fit is not None  # set by on_train_begin
        local = self._local
        for schedule in self._schedules()[0 if durable else 1:]:
            schedule.saved_at(fit.runtime.global_step)
        # The local write encodes from the host arrays read into below.
        self._finish_write(durable=durable)
        # Every worker reads (collectives); only the chief keeps it for the
        # durable tier.
        weights, extra = self._host.read(self.model, fit.runtime)
        runtime_state = fit.runtime.state()
        if local is not None:
            local.check_room(weights, extra)
            if not local.writes:
                local = None
        durable = durable and fit.chief
        if not (durable or local):
            return
        callbacks, callback_arrays = callback_state.snapshot(fit.siblings)
        state = {
            "format": generation.FORMAT_VERSION,
            "keras_mgpu_version": __version__,
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "runtime": runtime_state,
            "architecture": fingerprint(self.model),
            "training": training_config(self.model, self.params),
            "callbacks": callbacks,
            "time": time.time(),
        }
        files = ({} if callback_arrays is None
                 else {callback_state.ARRAYS_FILE: callback_arrays})
        if local is None:
            self._writer.start(self._write_generation, weights, extra,
                               state, files)
        else:
            assert local.writer is not None  # local.writes
            local.writer.start(self._write_tiers, weights, extra, state,
                               files, durable)

    def _finish_write(self, durable: bool = True) -> Optional[int]:
        """Waits for the writes in flight, if any (`durable=False`: the
        local tier's only); the durable generation written. Raises a
        failure (which stops training)."""
        number = None
        for tier in self._writers()[: None if durable else -1]:
            with ledger().spending("checkpoint"):
                write = tier.finish()
            if write is None:
                continue
            if write.error is not None:
                self._release_lock()
                self._preemption.fit_ended()
                raise write.error
            if tier is self._writer:
                number = write.number
        return number

    def _write_generation(self, weights: list, extra: list,
                          state: dict, more_files: dict) -> int:
        """Writes one generation from a snapshot (on the writer thread):
        every file once, from memory; returns its number. `more_files`:
        name to bytes (the callbacks' arrays)."""
        assert self._fit is not None  # the fit that saved it
        return writer.write_generation(
            self._fit.store,
            generation.encode(weights, extra, state, more_files))

    def _write_tiers(self, weights: list, extra: list, state: dict,
                     more_files: dict, durable: bool) -> int:
        """The local tier's write (on its thread): encodes the snapshot
        once, starts the durable write of the same bytes on a thread of its
        own (if `durable`), then writes the local generation; its number."""
        assert self._fit is not None and self._local is not None
        files = generation.encode(weights, extra, state, more_files)
        if durable:
            self._writer.start(writer.write_generation, self._fit.store,
                               files)
        assert self._local.store is not None  # local.writes
        return writer.write_generation(self._local.store, files)


def _window_open(model) -> bool:
    """Whether a save due now (or on SIGTERM) waits for the accumulation
    window's end: with a global batch, a window saved whole resumes on any
    replica count, one saved half-way only where the new micro-batches tile
    it. Every worker has the same window, so they wait alike."""
    return getattr(model, "global_batch_size", None) is not None and (
        model.micro_step > 0)
