"""The training state copied into host memory, the only part of a save
that stalls training."""

from __future__ import annotations

from typing import Any

import numpy as np

from keras_mgpu import compat
from keras_mgpu.callbacks.backup.compatibility import unsaved_variables


class HostSnapshot:
    """The model's variables in host memory, read into the same arrays at
    each save (one copy from the first save to the end of `fit`)."""

    def __init__(self):
        self._layout = None
        self._key = None
        self._check_key = True
        self._weights = None

    def check_layout(self) -> None:
        """At the next read, walk the model again if what it saves changed
        since the last walk (a recompile, a new optimizer): called at each
        `fit`'s start, as nothing changes it during one. The walk is most
        of a small model's save."""
        self._check_key = True

    def read(self, model, runtime) -> tuple:
        """(what `save_weights` writes, the RNG states it leaves out).

        Collectives under MultiWorkerMirroredStrategy (replica-local
        variables are all-reduced on read) and for arrays sharded across
        JAX processes: every worker reads, in this order.
        """
        if self._check_key:
            self._check_key = False
            key = compat.layout_key(model)
            if key != self._key:
                self._key, self._layout = key, None
        if self._layout is None:
            self._layout = compat.weights_layout(model)
            self._weights = None
        # Keras's JAX `fit` trains on a state outside the variables.
        runtime.sync_variables()
        to_host = runtime.host_array
        # A `GradientAccumulationModel` across TensorFlow replicas: their
        # moving statistics part within a window, and the save keeps their
        # mean (a collective).
        means: dict[int, Any] = getattr(
            model, "_replica_statistics_means", dict)()
        if means:
            def to_host(value, read=to_host):
                mean = means.get(id(value))
                return read(value) if mean is None else mean
        # Into the previous save's arrays: its write has finished.
        self._weights = self._layout.read(into=self._weights, to_host=to_host)
        extra = [np.array(to_host(v)) for v in unsaved_variables(model)]
        return self._weights, extra

    def free(self) -> None:
        """Drops the arrays: host memory the size of the saved state."""
        self._weights = None
