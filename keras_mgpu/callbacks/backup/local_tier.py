"""The local tier: frequent generations in a fast directory of each worker's
own machine (`local_dir`, e.g. under `/dev/shm`), beside the durable
`backup_dir`.

Every worker writes its own copy (the model is the same on every worker),
in `<local_dir>/worker-<index>`, with the same store and checks as the
durable tier. A resume takes the newest generation that every worker has
and that is not older than the durable tier's newest; the workers agree on
it in one collective, as they agree on a durable generation. A worker
whose copy is gone (a new machine, a reboot) has none, so the run resumes
from the durable tier.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import warnings
from typing import Optional, Union

import numpy as np

from keras_mgpu import _fs, backend
from keras_mgpu import strategy as strategy_lib
from keras_mgpu.callbacks.backup import generation
from keras_mgpu.callbacks.backup.schedule import SaveSchedule
from keras_mgpu.callbacks.backup.store import (CorruptGeneration,
                                              GenerationStore)
from keras_mgpu.callbacks.backup.writer import GenerationWriter

AUTO = "auto"
# Two, so that a kill while one worker's newest write is in flight still
# leaves a generation every worker has.
LOCAL_KEEP = 2
_RAM_DIR = "/dev/shm"


def resolve(local_dir: Optional[str], backup_dir: str) -> Optional[str]:
    """The run's local directory: `local_dir`, or for `"auto"` a folder
    named after `backup_dir` under `/dev/shm` (None where there is none)."""
    if local_dir != AUTO:
        return local_dir
    if not (os.path.isdir(_RAM_DIR) and os.access(_RAM_DIR, os.W_OK)):
        return None
    where = backup_dir if _fs.is_url(backup_dir) else os.path.abspath(
        backup_dir)
    key = hashlib.sha256(where.encode()).hexdigest()[:16]
    return f"{_RAM_DIR}/keras-mgpu-{os.getuid()}/{key}"


@dataclasses.dataclass
class Candidate:
    """A usable local generation: its number, the global step it was saved
    at, its parsed state and its verified files."""

    number: int
    step: int
    state: dict
    files: dict


class LocalTier:
    """One worker's local generations, and the schedule of its saves.

    Args:
        local_dir: The run's local directory (None: `"auto"` found no RAM
            directory; the worker still takes part in the agreement).
        save_freq: Batches between local saves (or `"epoch"`).
        auto: Whether `local_dir` was chosen by `"auto"`: then a RAM
            directory without room for the generations is not used.
    """

    def __init__(self, local_dir: Optional[str], save_freq: Union[str, int],
                 *, auto: bool):
        self.directory: Optional[str] = None
        self.root = local_dir
        self.auto = auto
        self.schedule = SaveSchedule(save_freq)
        self.store: Optional[GenerationStore] = None
        self.writer: Optional[GenerationWriter] = None
        self._room_checked = False

    def start(self) -> None:
        """A new `fit`: this worker's folder (the worker index is known
        once the strategy is)."""
        if self.root is None:
            return
        directory = _fs.join(self.root,
                             f"worker-{strategy_lib.worker_index()}")
        if directory != self.directory:
            self.directory = directory
            self.store = GenerationStore(directory, keep=LOCAL_KEEP)
            self.writer = GenerationWriter(directory)
            self._room_checked = False

    @property
    def writes(self) -> bool:
        return self.store is not None

    def check_room(self, weights: list, extra: list) -> None:
        """At the first save: an `"auto"` RAM directory without room for
        `LOCAL_KEEP + 1` generations of the host snapshot (`weights`,
        `extra`) is given up, with a warning (an explicit `local_dir` fails
        the save instead)."""
        if self._room_checked or self.store is None:
            return
        self._room_checked = True
        if not self.auto:
            return
        nbytes = sum(np.asarray(array).nbytes
                     for _, _, values in weights for _, array in values)
        nbytes += sum(np.asarray(array).nbytes for array in extra)
        needed = (LOCAL_KEEP + 1) * nbytes
        free = shutil.disk_usage(_RAM_DIR).free
        if free < needed:
            warnings.warn(
                f"BackupAndRestore: local_dir='auto' found {free} bytes "
                f"free in {_RAM_DIR}, and the local tier needs about "
                f"{needed}: this worker saves to backup_dir only. Pass "
                "local_dir= a folder with room, or local_dir=None.",
                stacklevel=3)
            self.store = self.writer = None

    def candidates(self) -> list:
        """This worker's usable local generations, newest first; damaged
        ones are removed with a warning (no one else has them)."""
        store = self.store
        if store is None or not _fs.exists(store.directory):
            return []
        store.remove_leftovers()
        found = []
        for number in store.generations():
            try:
                files = store.read(number, generation.REQUIRED)
                state = generation.parse_state(files)
                step = state["runtime"]["global_step"]
            except CorruptGeneration as e:
                warnings.warn(
                    f"BackupAndRestore: local generation {number} in "
                    f"{store.directory} is unusable ({e}); removed.",
                    stacklevel=3)
                store.remove(number)
                continue
            found.append(Candidate(number, step, state, files))
        return found

    def agreed(self, strategy, durable_step: int) -> Optional[Candidate]:
        """The newest local generation every worker has (a collective), or
        None. `durable_step`: the global step of the durable tier's newest
        generation (-1: none), which every worker must see the same (else
        `RuntimeError`)."""
        mine = self.candidates()
        row = np.full(LOCAL_KEEP + 1, -1.0)
        for i, candidate in enumerate(mine[:LOCAL_KEEP]):
            row[i] = candidate.step
        row[-1] = durable_step
        rows = backend.active().gather_rows(strategy, row,
                                            strategy_lib.num_workers())
        step = common_step(rows)
        return next((c for c in mine if c.step == step), None)

    def keep_up_to(self, step: int) -> None:
        """Removes local generations saved after global step `step` (the
        one resumed from): a later resume must not mix them in."""
        if self.store is None or not _fs.exists(self.store.directory):
            return
        for number in self.store.generations():
            if _saved_step(self.store, number) > step:
                self.store.remove(number)

    def delete(self) -> None:
        """Removes this worker's generations and folder, and the run's
        folder `"auto"` made once no worker's is left in it."""
        if self.store is None:
            return
        self.store.delete()
        if self.auto and self.root is not None:
            try:
                os.rmdir(self.root)
            except OSError:
                pass  # another worker's folder is still in it


def common_step(rows: np.ndarray) -> Optional[int]:
    """The newest global step in every worker's row of local steps (-1:
    none); each row ends with the durable tier's newest step, which must be
    the same in every row.

    Example:

    >>> import numpy as np
    >>> common_step(np.array([[20, 10, 10], [10, -1, 10]]))
    10
    >>> common_step(np.array([[20, 10, 15], [30, 20, 15]]))
    20
    >>> common_step(np.array([[20, 10, 15], [-1, -1, 15]])) is None
    True
    """
    durable = rows[:, -1]
    if (durable != durable[0]).any():
        raise RuntimeError(
            "Workers see different backups in backup_dir (their newest "
            f"generations were saved at steps {durable.astype(int).tolist()})"
            ". backup_dir must be storage that every worker reads the same, "
            "e.g. a shared filesystem or gs://.")
    shared = set.intersection(*(
        {int(s) for s in row[:-1] if s >= 0} for row in rows))
    return max(shared, default=None)


def durable_step(store: GenerationStore) -> int:
    """The global step of the newest durable generation whose state reads
    (-1: none), from its manifest and state alone: the rest is read only if
    the durable tier is chosen."""
    for number in store.generations():
        step = _saved_step(store, number)
        if step >= 0:
            return step
    return -1


def _saved_step(store: GenerationStore, number: int) -> int:
    try:
        state = json.loads(store.read(number, (generation.STATE,),
                                      only=(generation.STATE,))
                           [generation.STATE])
        step = state["runtime"]["global_step"]
    except (CorruptGeneration, ValueError, KeyError, TypeError):
        return -1
    return step if generation.is_count(step) else -1
