"""Resuming mid-epoch: skipping the batches the interrupted run trained on.

`TrainingRuntime.resume()` records what to skip (the runtime's `_Skip`); the
backend's train-function wrapper then hands each call to `_skip_then_train`,
which reads those batches without training on them, and refuses the resume
where this run's data or batch size cannot end where the saved run's did.
The backend's wrapper answers the two questions that differ per backend:
`_next_batch(iterator)` (the next batch; StopIteration at the data's end)
and `_batch_samples(element)` (the samples of one batch, over all workers).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Callable

from keras_mgpu import compat

if TYPE_CHECKING:
    from keras_mgpu.runtime.counters import _Runtime as _Host
else:
    _Host = object


class ResumeSkipping(_Host):
    """`TrainingRuntime`'s skipping of what a resumed run already trained."""

    # --- resuming: skipping what the interrupted run trained -----------------

    def _skip_then_train(self, iterator, run: Callable):
        """A call while a resume skips: reads the batches the interrupted run
        had trained on, trains nothing on them, and trains the rest of the
        call (where the saved position lies inside it) with `run(batches)`,
        the backend's train function over an iterator of batches. Returns
        (what `run` returned or None, batches of the epoch read, batches
        trained); None while nothing trained (the metrics may not be built
        yet)."""
        skip = self._skip
        # Only called while a resume skips.
        assert skip is not None
        if skip.before_epoch:
            # The interrupted run's epoch began this far into its iterator.
            epoch_iterator = compat.fit_epoch_iterator(self.model)
            if (epoch_iterator is not None
                    and not compat.epoch_iterator_keeps_iterator(
                        epoch_iterator)):
                self._skip = None
                raise ValueError(
                    f"{self._saved_where(skip)}, which began "
                    f"{skip.before_epoch} batches into data that "
                    "steps_per_epoch read on across epochs; this run reads "
                    "its data afresh each epoch (no steps_per_epoch), so it "
                    "cannot start where that epoch did. Nothing was trained. "
                    "Resume with the steps_per_epoch the backup was made "
                    "with, or start fresh with a new backup_dir."
                )
            for read in range(skip.before_epoch):
                try:
                    self._next_batch(iterator)
                except StopIteration:
                    self._skip = None
                    raise ValueError(self._short_data_message(
                        skip, f"the saved epoch began {skip.before_epoch} "
                        "batches into the data, which steps_per_epoch reads "
                        "on across epochs, but this run's data ended after "
                        f"{read}")) from None
            self._stream_read += skip.before_epoch
            self._stream_base = skip.before_epoch
            self._keras_base = skip.keras_count
            compat.add_epoch_iterator_count(epoch_iterator, skip.keras_count)
            skip.before_epoch = 0
        limit = self._steps_per_call
        read = 0
        while read < limit and not skip.done:
            try:
                element = self._next_batch(iterator)
            except StopIteration:
                self._skip = None
                raise ValueError(self._short_data_message(
                    skip, f"this run's data ended after {skip.skipped} of "
                    "them")) from None
            read += 1
            skip.skipped += 1
            if skip.samples is not None:
                self._skip_samples_of(element)
        if not skip.done:
            return None, read, 0
        self._skip = None
        if read == 0 or read == limit:
            return None, read, 0
        try:
            result, trained = self._train_batches(run, iterator, limit - read)
        except StopIteration:
            # The interrupted run had read the data to its end.
            return None, read, 0
        return result, read + trained, trained

    def _skip_samples_of(self, element) -> None:
        """Counts a skipped batch's samples; refuses the resume when this
        run's batches cannot end where the saved run's did."""
        skip = self._skip
        # Only called while a resume skips by samples.
        assert skip is not None and skip.samples is not None
        batch = self._batch_samples(element)
        if not skip.checked:
            self._check_skip(batch)
        skip.skipped_samples += batch
        if skip.skipped_samples > skip.samples:
            self._skip = None
            raise ValueError(
                f"{self._saved_where(skip)}; {skip.skipped} of this run's "
                f"batches hold {skip.skipped_samples:g} samples: they do not "
                f"end at {skip.samples:g}, so some samples would be trained "
                "twice or never. Resume with the data and global batch size "
                "the backup was made with, or start fresh with a new "
                "backup_dir."
            )

    def _check_skip(self, batch: int) -> None:
        """At the first skipped batch, which shows this run's batch size:
        the saved epoch's samples are skipped, whatever the size, or the
        resume is refused if that cannot be exact."""
        skip = self._skip
        # Only called while a resume skips by samples.
        assert skip is not None and skip.samples is not None
        skip.checked = True
        samples, saved_batches = skip.samples, skip.saved_batches
        where = f"{self._saved_where(skip)}; this run's batches hold {batch}"
        # Equal, or the saved run's last batch held fewer: its data ended
        # there (only the last batch of the data is partial).
        same = batch * (saved_batches - 1) < samples <= batch * saved_batches
        if not same:
            if samples % batch:
                self._skip = None
                raise ValueError(
                    f"{where}, and no whole number of them is {samples:g} "
                    "samples: some samples would be trained twice or never. "
                    f"Resume with the saved global batch size "
                    f"{samples / saved_batches:g}, or start fresh with a new "
                    "backup_dir."
                )
            skip.batches = int(samples // batch)
            # A GradientAccumulationModel with a global batch keeps its
            # optimizer step's batch: only the micro-batches changed.
            if getattr(self.model, "global_batch_size", None) is None:
                warnings.warn(
                    f"{where}: skipping {skip.batches} batches, the same "
                    f"{samples:g} samples. From here on each optimizer "
                    f"step takes {batch} samples, not "
                    f"{samples / saved_batches:g} as in the saved run.",
                    stacklevel=2,
                )
        epoch = self._epoch_steps
        if epoch:
            # Keras reads at most this many: calls of steps_per_execution.
            most = -(-epoch // self._steps_per_call) * self._steps_per_call
            if skip.batches > most:
                self._skip = None
                raise ValueError(self._short_data_message(
                    skip, f"this run's epochs hold {epoch} batches of "
                    f"{batch}"))

    @staticmethod
    def _saved_where(skip) -> str:
        # Epochs counted from 1, as Keras's progress bar counts them.
        epoch = skip.epoch + 1
        text = "The backup being resumed was saved after "
        if not skip.saved_batches:
            return ("The backup being resumed was saved at the start of "
                    f"epoch {epoch}")
        if skip.samples is None:
            return text + f"{skip.saved_batches} batches of epoch {epoch}"
        size = skip.samples / skip.saved_batches
        of = f" of {size:g}" if size == int(size) else ""
        return text + (f"{skip.samples:g} samples of epoch {epoch} "
                       f"({skip.saved_batches} batches{of})")

    def _short_data_message(self, skip, what: str) -> str:
        return (
            f"{self._saved_where(skip)}; {what}: this run's data is shorter "
            "than the saved run's, and resuming would skip what it never "
            "trained. Nothing was trained. Resume with the data (and "
            "steps_per_epoch) the backup was made with, or start fresh with "
            "a new backup_dir."
        )

