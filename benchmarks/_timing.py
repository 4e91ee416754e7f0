"""Timing helpers shared by the benchmark scripts."""

import time

import keras


class EpochTimer:
    """A pair of callbacks timing each epoch: put one first, one last."""

    def __init__(self):
        self.times = []
        timer = self

        class Start(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                timer._start = time.perf_counter()

        class Stop(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                timer.times.append(time.perf_counter() - timer._start)

        self.start, self.stop = Start(), Stop()
