"""Helpers shared by the benchmark scripts: epoch timing, Markdown tables."""

import time
from typing import Sequence

import keras


class EpochTimer:
    """A pair of callbacks timing each epoch: put one first, one last.

    `hook_seconds` is a counter other code may add to during an epoch;
    `hook_times` keeps its value per epoch.
    """

    def __init__(self):
        self.times = []
        self.hook_times = []
        self.hook_seconds = 0.0
        timer = self

        class Start(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                timer.hook_seconds = 0.0
                timer._start = time.perf_counter()

        class Stop(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                timer.times.append(time.perf_counter() - timer._start)
                timer.hook_times.append(timer.hook_seconds)

        self.start, self.stop = Start(), Stop()


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]],
                    text_columns: set[int]) -> str:
    """A Markdown table, readable in a terminal too."""
    rows = [tuple(header), *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for i, row in enumerate(rows):
        cells = [c.ljust(w) if j in text_columns else c.rjust(w)
                 for j, (c, w) in enumerate(zip(row, widths))]
        lines.append("| " + " | ".join(cells) + " |")
        if i == 0:
            lines.append("|" + "|".join(
                "-" * (w + 1) + ("-" if j in text_columns else ":")
                for j, w in enumerate(widths)) + "|")
    return "\n".join(lines)
