"""What the workers of `run_local_workers` leave behind, and how it is shown.

Their results (`WorkerResult`), their output echoed line by line under each
worker's label, and the `WorkerError` message that puts the first failure's
stderr first.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from typing import Any, Optional, Sequence


@dataclasses.dataclass
class WorkerResult:
    """What one worker process left behind.

    Args:
        index: The worker's rank.
        returncode: Its exit status (negative: killed by that signal).
        result: The JSON value it reported, or `None`.
        stdout: Everything it printed.
        stderr: Everything it printed to stderr.
        killed: Whether the launcher ended it on request: killed on
            `kill_when_printed`, or stopped because the workers killed then
            had exited (a requested kill ends the cluster, as a failure
            does).
        stopped: Whether the launcher stopped it (SIGKILL) while it still
            ran, because another worker failed or the cluster timed out:
            its `returncode` is then the launcher's signal, not a failure
            of its own.
    """

    index: int
    returncode: Optional[int]
    result: Any
    stdout: str
    stderr: str
    killed: bool = False
    stopped: bool = False


class WorkerError(RuntimeError):
    """A worker failed or the cluster timed out; the message holds stderr.

    `first_failed` holds the indices of the workers whose failure the
    launcher saw first (empty after a timeout).
    """

    def __init__(self, message: str, results: Sequence[WorkerResult],
                 first_failed: Sequence[int] = ()):
        super().__init__(message)
        self.results = list(results)
        self.first_failed = list(first_failed)


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


class _Echo:
    """Copies the workers' output files to a stream, line by line, each
    line after its worker's label."""

    def __init__(self, stream, files, labels):
        self.stream, self.files, self.labels = stream, files, labels
        self.offsets, self.partial = {}, {}

    def copy(self, final: bool = False) -> None:
        if self.stream is None:
            return
        for i, pair in enumerate(self.files):
            for f in pair:
                with open(f.name, "rb") as again:
                    again.seek(self.offsets.get(f.name, 0))
                    data = again.read()
                self.offsets[f.name] = self.offsets.get(f.name, 0) + len(data)
                data = self.partial.pop(f.name, b"") + data
                lines = data.split(b"\n")
                last = lines.pop()
                if final and last:
                    lines.append(last)
                elif last:
                    # A line still being written waits for its end.
                    self.partial[f.name] = last
                for line in lines:
                    self.stream.write(f"[{self.labels[i]}] "
                                      f"{line.decode(errors='replace')}\n")
        self.stream.flush()


def _read(f) -> str:
    """A worker's output so far, whatever its bytes: text that is not
    UTF-8 (a C library's message, a binary dump) is decoded with
    replacement characters, not an error that ends the supervision."""
    f.flush()
    with open(f.name, "rb") as again:
        return again.read().decode(errors="replace")


def _collect(procs, files, workdir, killed, stopped=()):
    results = []
    for i, (p, (out, err)) in enumerate(zip(procs, files)):
        result = None
        path = workdir and os.path.join(workdir, f"result{i}.json")
        if path and os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
        results.append(
            WorkerResult(i, p.poll(), result, _read(out), _read(err),
                         i in killed, i in stopped)
        )
    return results


def _how(returncode) -> str:
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name} (exit {returncode})"
    return f"exit code {returncode}"


def _describe(results, what: str, labels, first=()) -> str:
    parts = [f"Local cluster {what}."]
    codes = {r.index: r.returncode for r in results}
    if first:
        parts.append("First to fail: " + "; ".join(
            f"{labels[i]}, {_how(codes[i])}" for i in first) + ".")
    stopped = [labels[r.index] for r in results if r.stopped]
    if stopped:
        parts.append(f"Stopped by the launcher (SIGKILL) after that: "
                     f"{', '.join(stopped)}.")
    # The first failure's stderr first: it holds the cause.
    for r in sorted(results, key=lambda r: (r.index not in first, r.index)):
        state = ("stopped by the launcher" if r.stopped
                 else "killed on request" if r.killed else _how(r.returncode))
        parts.append(
            f"--- [{labels[r.index]}: {state}] worker {r.index} "
            f"(exit {r.returncode}) stderr tail:\n{_tail(r.stderr)}"
        )
    return "\n".join(parts)
