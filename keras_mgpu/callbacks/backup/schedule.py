"""When to save: every `save_freq` optimizer steps, or at epoch ends."""

from __future__ import annotations

from typing import Optional, Union


class SaveSchedule:
    """The saves of one `fit`, by global step and epoch.

    An epoch's end is saved in `on_epoch_end`, or, when a callback whose
    state is saved comes later in the list (`defer_epoch_end`), when the
    next epoch begins, once that state is final.
    """

    def __init__(self, save_freq: Union[str, int, bool]):
        self._save_freq = save_freq
        # Batches between periodic saves; None: at epoch ends, or never
        # (`check_arguments` let through "epoch", False or a positive int).
        self._batch_freq: Optional[int] = (
            None if isinstance(save_freq, str) or save_freq is False
            else save_freq)
        self.start(0, defer_epoch_end=False)

    def start(self, global_step: int, *, defer_epoch_end: bool) -> None:
        """A new `fit`, at `global_step`."""
        self.epoch = 0
        self._last_saved_step = global_step
        self._defer_epoch_end = defer_epoch_end
        self._save_at_epoch_end = False
        self._epoch_end_save: Optional[int] = None

    def saved_at(self, global_step: int) -> None:
        """A save (or a restore) at `global_step`."""
        self._last_saved_step = global_step

    def due_after_batch(self, global_step: int,
                        last_call_of_epoch: bool) -> bool:
        """Whether to save now, after a batch that trained. A periodic save
        due at the epoch's last batch is made after its end-of-epoch work
        instead, so a resume starts a fresh epoch."""
        if self._batch_freq is None or (
            global_step // self._batch_freq
            <= self._last_saved_step // self._batch_freq
        ):
            return False
        if last_call_of_epoch:
            self._save_at_epoch_end = True
            return False
        return True

    def due_at_epoch_end(self, epoch: int) -> Optional[int]:
        """The epoch to save as started (`epoch + 1`) if a save is due now;
        None if none is, or if it waits for the next epoch's start."""
        if not (self._save_freq == "epoch" or self._save_at_epoch_end):
            return None
        self._save_at_epoch_end = False
        if self._defer_epoch_end:
            # Saved when the next epoch begins: by then every callback has
            # run its on_epoch_end (EarlyStopping's `best`, ...).
            self._epoch_end_save = epoch + 1
            return None
        return epoch + 1

    def take_deferred(self) -> Optional[int]:
        """The epoch-end save left for the next epoch's start, if any."""
        epoch, self._epoch_end_save = self._epoch_end_save, None
        return epoch
