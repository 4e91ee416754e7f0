"""SIGTERM as a preemption notice: save at the next batch boundary, then
exit with the code a job runner reruns on."""

from __future__ import annotations

import signal
import threading
import warnings

from keras_mgpu import compat
from keras_mgpu.callbacks.backup.agreement import sum_over_workers


class SigtermNotice:
    """SIGTERM while a `fit` of the model runs: a request to save and exit.

    `requested` is set by the signal and acted on at the batch's end. The
    callback says when its `fit` runs (`fit_started`, `fit_ended`, and
    `fit_ended` again on a failure it sees). Outside one, the signal goes
    to the handler that was there before (default: terminate), rather
    than being swallowed.
    """

    def __init__(self):
        self.requested = threading.Event()
        self._previous_handler = None
        self._model = None  # the model whose fit runs, or None

    def fit_started(self, model) -> None:
        """Catches SIGTERM for the `fit` of `model` now starting."""
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "BackupAndRestore(save_on_sigterm=True) needs fit() on the "
                "main thread to catch SIGTERM; it will not save on SIGTERM.",
                stacklevel=2,
            )
            return
        self.requested.clear()
        self._model = model
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        # None: a handler set outside Python; the default is what it did.
        self._previous_handler = (
            signal.SIG_DFL if previous is None else previous)

    def fit_ended(self) -> None:
        """Puts the previous handler back."""
        self._model = None
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def _fit_running(self) -> bool:
        # Set from `fit_started` to `fit_ended`; a `fit` that raised in
        # another callback never says it ended, so the flag is confirmed
        # with Keras's `fit` itself.
        return (self._model is not None
                and compat.running_fit(self._model) is not None)

    def _on_sigterm(self, signum, frame) -> None:
        if self._fit_running():
            self.requested.set()  # saved and acted on at the batch's end
            return
        # `fit` raised, so `on_train_end` never put the old handler back:
        # do it now, and let that handler (default: terminate) have the
        # signal, rather than ignore it forever.
        previous = self._previous_handler
        self.fit_ended()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.raise_signal(signum)

    def agreed(self, strategy, multi_worker: bool) -> bool:
        """Whether any worker got the notice."""
        mine = 1.0 if self.requested.is_set() else 0.0
        if not multi_worker:
            return bool(mine)
        # All workers must save together (saving is a collective), so one
        # worker's notice stops them all at the same batch.
        return sum_over_workers(strategy, mine) > 0
