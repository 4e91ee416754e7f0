"""A hand-written loop's figures: what it gives in its batch ends' `logs`,
and the samples it added to Keras's loss tracker batch by batch."""

from __future__ import annotations

from keras_mgpu import compat
from keras_mgpu.callbacks.telemetry.records import _floats


class _HandLoop:
    """What the logger reads of a loop that drives its callbacks itself
    (a `CallbackList`, `train_on_batch` included) rather than `fit`.

    `fit` is read from Keras's compiled step; a hand-written loop has none,
    so its values come from the logs of each batch end, and its samples
    from the loss tracker as each batch leaves it.
    """

    def __init__(self):
        self.active = False  # driven by a hand-written loop, not `fit`
        self._given = None  # (epoch, batch, logs) of its latest batch end
        self._counting = False  # a batch whose samples are unread
        self._seen_before = 0.0
        self._tracker_resets = True

    def begin(self, model) -> None:
        """At train begin: whether `fit` drives this run (Keras's `fit` is
        running on `model`)."""
        self.active = compat.running_fit(model) is None
        self._given = None
        self._counting = False
        if self.active:
            self._tracker_resets = compat.train_on_batch_resets_metrics()

    def batch_begin(self, model) -> None:
        self._counting = self.active
        if self.active and not self._tracker_resets:
            # The tracker runs on across calls: this batch is what it adds.
            self._seen_before = compat.examples_seen(model) or 0.0

    def batch_end(self, epoch: int, batch: int, logs) -> None:
        if self.active:
            self._given = (epoch, batch, _floats(logs or {}))

    def count(self, model, *spans) -> None:
        """Adds the samples of the batch just trained to `spans`: what it
        added to Keras's loss tracker (which `train_on_batch` resets at
        every call on Keras 3.15, not before). Nothing for a step that does
        not feed it (a `GradientTape` step)."""
        if not self._counting:
            return
        self._counting = False
        seen = compat.examples_seen(model)
        if seen and not self._tracker_resets:
            seen -= self._seen_before
        if seen:
            for span in spans:
                span.examples += seen

    def metrics(self, read: dict, window, epoch: int, batch: int) -> dict:
        """A window's metrics: the logs given at the window's last batch
        end (`batch` of `epoch`), as Keras's `TensorBoard` logs them.
        Without them, the model's metrics where its steps fed them
        (`train_on_batch`), else none (a `GradientTape` step leaves them at
        0, which is not a loss)."""
        given = self._given
        if given and given[:2] == (epoch, batch) and given[2]:
            return given[2]
        return read if window.examples else {}
