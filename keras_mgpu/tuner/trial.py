"""Per-trial pieces saved with a trial's backup."""

from __future__ import annotations

import keras


class _TrialHistory(keras.callbacks.History):
    """Keras's `History`, saved with the trial's backup: a resumed trial's
    `fit` returns every epoch, those before the kill too. KerasTuner takes
    the trial's score and best step from it (by position in each list)."""

    def get_state(self) -> dict:
        return {"epoch": list(self.epoch),
                "history": {k: list(v) for k, v in self.history.items()}}

    def set_state(self, state: dict) -> None:
        self.epoch = list(state["epoch"])
        self.history = {k: list(v) for k, v in state["history"].items()}
