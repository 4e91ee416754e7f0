"""The background write of a generation: one thread per save, at most one
in flight per `backup_dir`, its failure raised on the training thread."""

from __future__ import annotations

import threading
from typing import Optional

from keras_mgpu import _fs
from keras_mgpu.callbacks.backup.store import (GenerationStore, PruneFailed,
                                              WriteFailed)

# The background write of each backup_dir, while it may still run: a fit
# that raises leaves it running, and the next fit on that directory in this
# process waits for it.
_writes_in_flight: dict[str, BackgroundWrite] = {}


class BackgroundWrite:
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


class GenerationWriter:
    """The write in flight for one `backup_dir` (`current`, or None)."""

    def __init__(self, backup_dir: str):
        self._backup_dir = backup_dir
        self.current: Optional[BackgroundWrite] = None

    def wait_for_earlier(self) -> Optional[BaseException]:
        """Waits for a write a `fit` that raised left running on this
        `backup_dir` (this callback's or another's); its error, if any."""
        left = _writes_in_flight.pop(self._backup_dir, None)
        self.current = None
        if left is None:
            return None
        left.join()
        return left.error

    def start(self, write, *args) -> None:
        """Runs `write(*args)` on a new thread (the previous write must have
        been finished)."""
        self.current = BackgroundWrite(write, *args)
        _writes_in_flight[self._backup_dir] = self.current

    def finish(self) -> Optional[BackgroundWrite]:
        """Waits for the write in flight, if any, and hands it back."""
        write, self.current = self.current, None
        if write is None:
            return None
        if _writes_in_flight.get(self._backup_dir) is write:
            del _writes_in_flight[self._backup_dir]
        write.join()
        return write


def _what_is_left(store: GenerationStore, had_any: bool) -> str:
    """What a rerun resumes from, as it is now, not as it was: the folder
    may have been removed or replaced during training."""
    try:
        committed = store.generations()
    except _fs.ERRORS:
        committed = []
    if committed:
        return (f"Generation {committed[0]} is intact: make room in (or "
                "fix) backup_dir and rerun, and the run resumes from it.")
    if had_any:
        return (f"No committed generation is left in {store.directory} "
                "(removed or replaced during training?): a rerun starts "
                "over.")
    return "No earlier generation exists."


def write_generation(store: GenerationStore, files: dict) -> int:
    """Writes and commits `files` as the next generation; its number. A
    failure is a `RuntimeError` saying what is intact and what to do."""
    try:
        return store.write(files)
    except WriteFailed as e:
        raise RuntimeError(
            f"BackupAndRestore could not write generation {e.number} to "
            f"{e.path} ({type(e.cause).__name__}: {e.cause}). Training "
            f"stops. {_what_is_left(store, e.previous is not None)}"
        ) from e.cause
    except PruneFailed as e:
        raise RuntimeError(
            f"BackupAndRestore committed generation {e.number} to "
            f"{store.directory} but could not remove older generations "
            f"({type(e.cause).__name__}: {e.cause}). Training stops; "
            f"fix backup_dir and rerun, and the run resumes from "
            f"generation {e.number}."
        ) from e.cause
    except _fs.ERRORS as e:
        # Before a generation was begun: the folder itself (removed, or
        # replaced by a file, during training).
        raise RuntimeError(
            f"BackupAndRestore could not write to {store.directory} "
            f"({type(e).__name__}: {e}). Training stops. "
            f"{_what_is_left(store, True)}") from e
