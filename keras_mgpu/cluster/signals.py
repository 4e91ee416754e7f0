"""The stop signals `launch` passes on to its workers: a scheduler's
SIGTERM, a closed terminal's SIGHUP and Ctrl-C become a request to stop
the workers gracefully rather than the launcher's sudden end."""

from __future__ import annotations

import signal
import threading
from typing import Optional


# What a scheduler (SLURM's `--signal`, Kubernetes), a closed terminal and
# Ctrl-C send a job.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
# Asks a launch that went on with fewer workers to start every one again.
GROW_SIGNAL = signal.SIGUSR1
# Why an attempt ended that was stopped for it.
GROW_REASON = ("stopped by SIGUSR1 to start every worker again (a "
               "BackupAndRestore with save_on_sigterm saves first)")


class Stopped(Exception):
    """The launcher was asked to stop (`signum`); its workers are gone."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """While entered (on the main thread), SIGTERM, SIGHUP and SIGINT
    become a request to stop the workers, not the launcher's sudden end
    (which left them running, in their own sessions). A second signal
    asks to stop at once. With `grow`, `GROW_SIGNAL` (SIGUSR1) sets
    `grow_requested` instead of ending the launcher. Elsewhere than on the
    main thread, where Python cannot handle signals, nothing changes."""

    def __init__(self, grow: bool = False):
        self.signum: Optional[int] = None
        self.at_once = False
        self.grow_requested = False
        self._signals = STOP_SIGNALS + ((GROW_SIGNAL,) if grow else ())
        self._event = threading.Event()
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in self._signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame) -> None:
        if signum == GROW_SIGNAL:
            self.grow_requested = True
            return
        if self.signum is not None:
            self.at_once = True
        self.signum = signum
        self._event.set()

    def check(self) -> None:
        """Raises `Stopped` if a stop was asked for."""
        if self.signum is not None:
            raise Stopped(self.signum)

    def sleep(self, seconds: float) -> None:
        """Sleeps, or raises `Stopped` when asked to stop meanwhile."""
        self._event.wait(seconds)
        self.check()


def stopped_message(signum: int, grace_period: float) -> str:
    """`launch`'s one line when a signal stopped it."""
    name = signal.Signals(signum).name
    return (f"keras-mgpu launch: stopped by {name}: passed on to every "
            f"worker as SIGTERM (a BackupAndRestore saves and exits), the "
            f"rest killed after {grace_period:g} s. Run the same command "
            "again to resume.")
