"""The `fit` running on a model, as its callbacks cannot see it
(keras/src/backend/<backend>/trainer.py, keras/src/trainers/epoch_iterator.py):
the callbacks it was given and the epoch iterator feeding its train function.

Keras gives a callback its model and `params`, not the list of callbacks it
runs in nor the epoch iterator whose position a resume continues. From
`import keras_mgpu` on, the trainer's `fit` records itself while it runs,
and an `EpochIterator` made inside it is recorded as that fit's (the first:
the training data's; validation's comes later). Both wrappers only record
(and `fit` raises, as it returns, a Ctrl-C deferred to a next batch that did
not come: compat/interrupts.py); what `fit` does is Keras's own.
`record_fits()` checks, where keras-mgpu's callbacks and runtime are made,
that this Keras has what they rely on.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Optional

import keras

from keras_mgpu.compat._core import (
    _internals_error, _module_if_present, _require, _require_module)
from keras_mgpu.compat.interrupts import raise_deferred_ctrl_c
from keras_mgpu.compat.keras_trainer import active_trainer_module
from keras_mgpu.compat.keras_trainer import trainer_class
from keras_mgpu.compat.registry import _RUNNING_FIT

_EPOCH_ITERATOR = "keras.src.trainers.epoch_iterator"
# `fit`'s leading parameters: `callbacks` is read by position or name.
_FIT_PARAMS = ("self", "x", "y", "batch_size", "epochs", "verbose",
               "callbacks")


@dataclasses.dataclass
class RunningFit:
    """A `fit` in progress on one model.

    Args:
        model: The model `fit` was called on.
        callbacks: The callbacks it was given, in their order (a
            `CallbackList`'s own list where it was given one).
        epoch_iterator: Keras's epoch iterator of its training data, once
            made (None before).
        running: Defaults to `True`; False once `fit` has returned or
            raised (readable from any thread).
    """

    model: object
    callbacks: list
    epoch_iterator: object = None
    running: bool = True


# The fits running on this thread, innermost last: an epoch iterator made
# on a thread belongs to the fit running there.
_local = threading.local()
_lock = threading.Lock()
_recording = False


def _running() -> list:
    if not hasattr(_local, "fits"):
        _local.fits = []
    return _local.fits


def record_fits() -> None:
    """Checks that this Keras has what the recording needs, and makes every
    later `fit` record itself while it runs (wrapped once per process).
    Called where keras-mgpu's callbacks and runtime are made."""
    trainer = trainer_class(_RUNNING_FIT, active_trainer_module())
    _require(trainer, "fit", _RUNNING_FIT, params=_FIT_PARAMS)
    iterator_class = _require(_require_module(_EPOCH_ITERATOR, _RUNNING_FIT),
                              "EpochIterator", _RUNNING_FIT)
    make_iterator = iterator_class.__init__
    make_iterator = getattr(make_iterator, "keras_stock", make_iterator)
    # What the runtime reads of an epoch iterator, set by its `__init__`.
    missing = [name for name in ("steps_per_epoch", "_current_iterator",
                                 "_steps_seen")
               if name not in make_iterator.__code__.co_names]
    if missing:
        raise _internals_error(
            f"`EpochIterator.__init__` setting {', '.join(missing)}",
            _RUNNING_FIT)
    _wrap(trainer, iterator_class)


def record_fits_from_import() -> None:
    """`record_fits()` as keras-mgpu is imported, unchecked and silent.

    `model.fit(x, callbacks=[DistributedLogger(...)])` looks `fit` up
    before it makes the callback, so the wrapper must be in place before
    any callback is made. Where this Keras lacks what it needs, nothing is
    wrapped here: `record_fits()` says so where it is first used.
    """
    trainer = next((cls for cls in keras.Model.__mro__
                    if cls.__module__ == active_trainer_module()), None)
    iterator_class = getattr(_module_if_present(_EPOCH_ITERATOR),
                             "EpochIterator", None)
    if (trainer is not None and iterator_class is not None
            and callable(getattr(trainer, "fit", None))):
        _wrap(trainer, iterator_class)


def _wrap(trainer, iterator_class) -> None:
    """Wraps `trainer.fit` and `iterator_class.__init__` to record the
    running fit (once per process)."""
    global _recording
    with _lock:
        if _recording:
            return
        fit = trainer.fit
        make_iterator = iterator_class.__init__

        @functools.wraps(fit)
        def recorded_fit(self, *args, **kwargs):
            callbacks = kwargs.get("callbacks", args[5] if len(args) > 5
                                   else None)
            fits = _running()
            fits.append(RunningFit(self, _flat_callbacks(callbacks)))
            try:
                history = fit(self, *args, **kwargs)
            finally:
                fits.pop().running = False
            # A Ctrl-C deferred to a next batch that did not come.
            raise_deferred_ctrl_c()
            return history

        @functools.wraps(make_iterator)
        def recorded_init(self, *args, **kwargs):
            make_iterator(self, *args, **kwargs)
            fits = _running()
            if fits and fits[-1].epoch_iterator is None:
                fits[-1].epoch_iterator = self

        setattr(recorded_fit, "keras_stock", fit)
        setattr(recorded_init, "keras_stock", make_iterator)
        trainer.fit = recorded_fit
        iterator_class.__init__ = recorded_init
        _recording = True


def running_fit(model) -> Optional[RunningFit]:
    """The innermost `fit` running on `model` on this thread, or None (not
    inside Keras's `fit`: a hand-written loop, or `fit` has returned)."""
    for fit in reversed(_running()):
        if fit.model is model:
            return fit
    return None


def given_to_running_fit(callback) -> bool:
    """Whether `callback` is among the callbacks of a `fit` running on
    this thread (Keras reads a callback's `async_safe` as `fit` makes its
    `CallbackList`, before any hook runs)."""
    return any(any(c is callback for c in fit.callbacks)
               for fit in _running())


def _flat_callbacks(callbacks) -> list:
    if callbacks is None:
        return []
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return list(callbacks.callbacks)
    return list(keras.tree.flatten(callbacks))
