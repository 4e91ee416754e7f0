"""Timing helpers shared by the benchmark scripts."""

import time

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
