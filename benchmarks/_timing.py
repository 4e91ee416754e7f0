"""Helpers shared by the benchmark scripts: epoch timing, turns, tables."""

import statistics
import time
from typing import Callable, Sequence

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


def timed_epoch(model: keras.Model, *data, callbacks: Sequence = (),
                **fit_kwargs) -> float:
    """Seconds of one epoch of `model.fit(*data, ...)`, without `fit`'s
    per-call setup; `callbacks` run inside the timed span.

    Keras fetches the logs before `on_epoch_end`, which waits for the last
    step to finish, so the time covers all the work of the epoch.
    """
    timer = EpochTimer()
    model.fit(*data, epochs=1, shuffle=False, verbose=0,
              callbacks=[timer.start, *callbacks, timer.stop], **fit_kwargs)
    return timer.times[0]


def round_robin(count: int, rounds: int,
                run: Callable[[int], float]) -> list[list[float]]:
    """`run(i)` for each of `count` configurations, `rounds` times, in turns.

    One run per configuration per round, each round starting one place
    later: on a shared, noisy machine a burst of background load then hits
    every configuration alike rather than whichever happened to be running.

    Returns:
        Per configuration, what its runs returned, in order.
    """
    results: list[list[float]] = [[] for _ in range(count)]
    for round_index in range(rounds):
        for k in range(count):
            i = (k + round_index) % count
            results[i].append(run(i))
    return results


def spread(values: Sequence[float]) -> float:
    """(largest - smallest) / median: how far apart repeated timings are,
    to tell noise from a difference."""
    return (max(values) - min(values)) / statistics.median(values)


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
