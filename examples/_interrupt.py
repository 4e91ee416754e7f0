"""Ctrl-C in an example: exit code 130 and one line, not a traceback.

    from _interrupt import stops_cleanly

    with stops_cleanly(backup_dir) as progress:   # no backup: stops_cleanly()
        model.fit(..., callbacks=[progress.callback(), backup])

A KeyboardInterrupt (Ctrl-C) inside the block ends the program with exit
code 130 (128 + SIGINT, what a shell reports for Ctrl-C) and one line on
stderr: where training stopped, and what the same command does next. It
says "resumes" only when `saved_in` holds a committed backup generation
(`gen-*/MANIFEST.json`, docs/backup.md, at any depth: a tuner's trials
keep theirs in their own folders), after the save in flight, if any, is
written; otherwise it says that nothing is saved.

`progress.callback()` is a Keras callback that follows the epoch and step,
and once the second epoch begins prints a line on stdout saying that
Ctrl-C now stops the run (and how it resumes). A loop without `fit` calls
`progress.epoch_begin(epoch)`, `progress.batch_end(batch)` and
`progress.epoch_end(epoch)` itself (0-based, as Keras's callbacks get them).
"""

import contextlib
import glob
import os
import sys
import threading

from _common import shown

# Seconds to wait, after Ctrl-C, for a backup's write in flight (its thread
# would be waited for at exit anyway): the line says whether it is there.
WRITE_WAIT = 120


class Progress:
    """Where training is, in Keras's numbering: epochs and steps from 1."""

    def __init__(self, saved_in=None, announce=True):
        self.saved_in = saved_in
        self.announce = announce
        self.epoch = None  # 1-based; None: no epoch began
        self.step = 0  # batches done in that epoch
        self._ended = None  # the last epoch that ended here, 1-based
        self._announced = False

    def epoch_begin(self, epoch):
        # Once the next epoch begins: a backup of the epoch's end is saved
        # by then (at its end, or here when deferred: KerasTuner's trials).
        if self.announce and self._ended and not self._announced:
            self._announced = True
            kept = (f"the same command then resumes it from "
                    f"{shown(self.saved_in)}" if self.saved_in
                    else "nothing is saved")
            print(f"Epoch {self._ended} done. Ctrl-C stops the run; {kept}.",
                  flush=True)
        self.epoch, self.step = epoch + 1, 0

    def batch_end(self, batch):
        self.step = batch + 1

    def epoch_end(self, epoch):
        self._ended = epoch + 1

    def callback(self):
        """A Keras callback reporting to this progress (a copy of it too:
        KerasTuner deep-copies the callbacks of each trial)."""
        import keras

        progress = self

        class _Progress(keras.callbacks.Callback):
            def __deepcopy__(self, memo):
                return _Progress()

            def on_epoch_begin(self, epoch, logs=None):
                progress.epoch_begin(epoch)

            def on_train_batch_end(self, batch, logs=None):
                progress.batch_end(batch)

            def on_epoch_end(self, epoch, logs=None):
                progress.epoch_end(epoch)

        return _Progress()

    def where(self):
        if self.epoch is None:
            return ""
        return f" at epoch {self.epoch}, step {self.step}"


_active = []  # the Progress of each stops_cleanly block entered


def current():
    """The Progress of the innermost `stops_cleanly` block (for code that
    builds its callbacks far from the block), or one that reports nowhere."""
    return _active[-1] if _active else Progress(announce=False)


@contextlib.contextmanager
def stops_cleanly(saved_in=None, *, again="run the same command again",
                  announce=True):
    """Ends a KeyboardInterrupt in the block with exit code 130 and one line
    on stderr. `saved_in`: the backup directory (or the folder holding the
    backups, such as a tuner's) a rerun resumes from; None when nothing is
    saved. `again`: how to rerun, when it is not the same command.
    `announce`: print the "Ctrl-C stops the run" line as epoch 2 begins."""
    progress = Progress(saved_in, announce)
    _active.append(progress)
    try:
        yield progress
    except KeyboardInterrupt:
        print(_message(progress, again), file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    finally:
        _active.remove(progress)


def _message(progress, again):
    where = progress.where()
    if progress.saved_in is None:
        return f"Interrupted{where}: stopped, nothing saved."
    try:
        _wait_for_writes()
    except KeyboardInterrupt:  # a second Ctrl-C: the line all the same
        pass
    saved = glob.glob(os.path.join(glob.escape(progress.saved_in), "**",
                                   "gen-*", "MANIFEST.json"), recursive=True)
    if saved:
        return (f"Interrupted{where}: the backup in "
                f"{shown(progress.saved_in)} resumes it; {again}.")
    return (f"Interrupted{where}, before the first backup: nothing saved "
            "yet, the same command starts over.")


def _wait_for_writes():
    """Waits for the Python threads that the exit would wait for (a
    BackupAndRestore's write in flight among them)."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            try:
                thread.join(WRITE_WAIT)
            except RuntimeError:
                pass  # still starting (the Ctrl-C came as it started)

