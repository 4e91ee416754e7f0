"""What the workers of `run_local_workers` leave behind: their results
(`WorkerResult`), their output read back with bounded memory, and the
`WorkerError` message that puts the first failure's stderr first.
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
        stdout: What it printed: everything, or the last `KEPT_BYTES`
            of it after a line saying how much came before.
        stderr: What it printed to stderr, kept as `stdout` is.
        killed: Whether the launcher ended it on request: killed on
            `kill_when_printed`, or stopped because the workers killed then
            had exited (a requested kill ends the cluster, as a failure
            does).
        stopped: Whether the launcher stopped it (SIGKILL) while it still
            ran, because another worker failed or the cluster timed out:
            its `returncode` is then the launcher's signal, not a failure
            of its own.
        address: Its `"host:port"` in the cluster's `TF_CONFIG`.
    """

    index: int
    returncode: Optional[int]
    result: Any
    stdout: str
    stderr: str
    killed: bool = False
    stopped: bool = False
    address: Optional[str] = None


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


# The launcher's memory for a worker's output, whatever it prints: the
# tail kept per stream, and the longest piece of a line it holds (echoed in
# pieces) or reads at once.
KEPT_BYTES = 1 << 20
_CHUNK = 1 << 20


def _new_bytes(name: str, offsets: dict):
    """The bytes written to file `name` since the last call (`offsets`
    remembers where each file was read to), in pieces of at most
    `_CHUNK`."""
    with open(name, "rb") as f:
        f.seek(offsets.get(name, 0))
        while True:
            data = f.read(_CHUNK)
            if not data:
                return
            offsets[name] = offsets.get(name, 0) + len(data)
            yield data


class _Marker:
    """Whether a text has appeared in any worker's stdout, reading only
    what was written since the last look (the output was read whole at
    every poll)."""

    def __init__(self, text: str):
        self._text = text.encode()
        self._offsets: dict[str, int] = {}
        self._carry: dict[str, bytes] = {}

    def seen(self, files) -> bool:
        keep = len(self._text) - 1
        for out, _ in files:
            out.flush()
            for data in _new_bytes(out.name, self._offsets):
                data = self._carry.pop(out.name, b"") + data
                if self._text in data:
                    return True
                # The text may straddle two pieces.
                self._carry[out.name] = data[len(data) - keep:] if keep else b""
        return False


def _read(f) -> str:
    """A worker's output so far, whatever its bytes: text that is not
    UTF-8 (a C library's message, a binary dump) is decoded with
    replacement characters, not an error that ends the supervision. At
    most its last `KEPT_BYTES`, after a line saying how much came before,
    so the launcher's memory is bounded whatever a worker prints."""
    f.flush()
    with open(f.name, "rb") as again:
        size = again.seek(0, os.SEEK_END)
        dropped = max(0, size - KEPT_BYTES)
        again.seek(dropped)
        text = again.read().decode(errors="replace")
    if not dropped:
        return text
    return (f"[... {dropped} earlier bytes of this output not kept ...]\n"
            + text)


def _collect(procs, files, workdir, killed, stopped=(), addresses=()):
    results = []
    for i, (p, (out, err)) in enumerate(zip(procs, files)):
        result = None
        path = workdir and os.path.join(workdir, f"result{i}.json")
        if path and os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
        results.append(
            WorkerResult(i, p.poll(), result, _read(out), _read(err),
                         i in killed, i in stopped,
                         addresses[i] if i < len(addresses) else None)
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
