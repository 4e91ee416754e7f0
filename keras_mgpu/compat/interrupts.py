"""Ctrl-C during `fit`: taken at the next batch, where neither Keras nor
TensorFlow can lose it.

Python raises a Ctrl-C's KeyboardInterrupt in whatever Python code runs
when the signal lands, and during a `fit` two places drop it there:

- Keras converts the logs to Python floats before every callback inside a
  bare `except:` (`pythonify_logs` in keras/src/utils/python_utils.py),
  while it waits for the step's results;
- TensorFlow's eager fast path (`TFE_Py_FastPathExecute`, which runs the
  ops making the data iterator Keras makes at each epoch) clears an error
  raised in the Python it calls (`TensorShape.__len__`, as measured), then
  goes on with a shape it never read: the run goes on, or dies of a
  corrupted heap (`free(): invalid next size`, SIGABRT or SIGSEGV).

So, while a `fit` with keras-mgpu's runtime runs, the first Ctrl-C raises
nothing where it lands: `keep_ctrl_c()`'s handler notes it, and the runtime
raises the KeyboardInterrupt at the next batch (training or validation),
or as `fit` returns (`raise_deferred_ctrl_c()`). A second Ctrl-C before
then raises at once, as Python's own handler does; so does any Ctrl-C
outside such a `fit`.
"""

from __future__ import annotations

import signal
import threading
import weakref
from typing import Any, Callable, Optional

# The running fit whose batches take a Ctrl-C (its `RunningFit`), weakly:
# it holds the fit's callbacks.
_deferred_to: Callable[[], Optional[Any]] = lambda: None
# A Ctrl-C noted, not raised yet.
_noted = False


def _on_sigint(signum, frame):
    global _noted
    fit = _deferred_to()
    if fit is None or not fit.running or _noted:
        raise KeyboardInterrupt
    _noted = True


def keep_ctrl_c() -> None:
    """Puts keras-mgpu's SIGINT handler in place of Python's own: the same
    KeyboardInterrupt, deferred to the next batch inside a `fit` that
    `defer_ctrl_c` names.

    Only on the main thread (where Python runs signal handlers) and only
    where Python's own handler is in place: a program's own is kept.
    Called where keras-mgpu's callbacks and runtime are made.
    """
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        signal.signal(signal.SIGINT, _on_sigint)


def defer_ctrl_c(fit: Optional[Any]) -> None:
    """Defers a first Ctrl-C to the next batch until `fit` (a running
    `RunningFit`) ends; None: raises each where it lands (a hand-driven
    loop). A Ctrl-C noted before is forgotten: it ended an earlier `fit`."""
    global _deferred_to, _noted
    _deferred_to = (lambda: None) if fit is None else weakref.ref(fit)
    _noted = False


def raise_deferred_ctrl_c() -> None:
    """Raises KeyboardInterrupt if a Ctrl-C was deferred to now."""
    global _noted
    if _noted:
        _noted = False
        raise KeyboardInterrupt
