"""The workers' output as it comes, each line under its worker's label,
with a failure's aftermath held back.

When a worker dies, the others' collectives abort: each survivor prints
pages of `UnavailableError ... Collective ops is aborted` before the
launcher has even said which worker died. From the first failure the
launcher sees (or the first such error, whichever comes first), a
survivor's output is held back: kept whole in a file, and shown as one
line after the launcher's own line about the failure.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from typing import Optional, Sequence, TextIO

from keras_mgpu.cluster.output import _CHUNK, _new_bytes

# What a collective op says when a peer is gone (TensorFlow's gRPC and
# collective executors); a traceback ending in one of these is held too.
_ABORTED = re.compile(
    rb"Collective ops is aborted|UnavailableError|errors_impl\.CancelledError"
    rb"|Socket closed|Connection reset by peer|failed to connect to all "
    rb"addresses")
_TRACEBACK = b"Traceback (most recent call last):"
# A traceback longer than this is shown as it comes rather than buffered.
_TRACEBACK_LINES = 1000
_SHOWN = 160  # characters of the first aborted line in the summary


@dataclasses.dataclass
class _Stream:
    """One worker's stdout or stderr: the line being written, and a
    traceback waiting for its last line (which says whether it is a
    collective's abort)."""

    partial: bytes = b""
    traceback: Optional[list] = None


@dataclasses.dataclass
class _Held:
    """What one worker printed after the failure, kept in `path`."""

    path: str
    lines: int = 0
    aborted: Optional[str] = None  # the first line saying so


class Echo:
    """Copies the workers' output files to `stream` (`None`: nowhere),
    each line after its worker's label; a line longer than `_CHUNK` in
    pieces, each under the label.

    Args:
        stream: A text stream, or `None`.
        files: Each worker's (stdout, stderr) open files.
        labels: Each worker's label.
        held_as: The name the files of held-back output start with
            (`"attempt2"`): `<temp dir>/keras-mgpu-launch-<pid>/
            <held_as>-<label>.log`.
    """

    def __init__(self, stream, files: Sequence, labels: Sequence[str],
                 held_as: str = "run"):
        self.stream, self.files, self.labels = stream, files, labels
        self._held_as = held_as
        self._offsets: dict[str, int] = {}
        self._streams: dict[str, _Stream] = {}
        self._failed: Sequence[int] = ()
        self._held: dict[int, _Held] = {}

    def failed(self, first: Sequence[int]) -> None:
        """From now on, the output of every worker but `first` (whose
        failure the launcher saw first) is held back."""
        if not self._failed:
            self._failed = list(first)

    def copy(self, final: bool = False) -> None:
        """Echoes what the workers printed since the last call (`final`:
        their last, unfinished lines too)."""
        if self.stream is None:
            return
        for i, pair in enumerate(self.files):
            for f in pair:
                state = self._streams.setdefault(f.name, _Stream())
                for data in _new_bytes(f.name, self._offsets):
                    self._lines(i, state, data, final=False)
                self._lines(i, state, b"", final)
        self.stream.flush()

    def held_back(self) -> list:
        """One line per worker whose output was held back: how much, why
        and the file that has it whole."""
        lines = []
        for i, held in sorted(self._held.items()):
            failed = " and ".join(self.labels[j] for j in self._failed)
            after = f"after {failed} failed" if failed else "while it ran"
            what = (f": its collective ops aborted ({held.aborted})"
                    if held.aborted else "")
            lines.append(
                f"[{self.labels[i]}] {held.lines} line"
                f"{'' if held.lines == 1 else 's'} held back {after}{what}; "
                f"the full text is in {held.path}")
        return lines

    def _lines(self, i: int, state: _Stream, data: bytes,
               final: bool) -> None:
        lines = (state.partial + data).split(b"\n")
        last = lines.pop()
        state.partial = b""
        if last and (final or len(last) >= _CHUNK):
            lines.append(last)
        elif last:
            # A line still being written waits for its end.
            state.partial = last
        for line in lines:
            self._line(i, state, line)
        if final and state.traceback:
            block, state.traceback = state.traceback, None
            (self._hold if self._holding(i) else self._show)(i, block)

    def _holding(self, i: int) -> bool:
        return i in self._held or bool(self._failed and i not in self._failed)

    def _line(self, i: int, state: _Stream, line: bytes) -> None:
        if self._holding(i):
            # A traceback begun before is held with the rest.
            block, state.traceback = state.traceback or [], None
            self._hold(i, block + [line])
        elif state.traceback is not None:
            state.traceback.append(line)
            # A traceback ends with its one unindented line after the
            # frames: the exception.
            if line[:1] not in (b" ", b"\t", b"") and line != _TRACEBACK:
                block, state.traceback = state.traceback, None
                if _ABORTED.search(line):
                    self._hold(i, block)
                else:
                    self._show(i, block)
            elif len(state.traceback) > _TRACEBACK_LINES:
                self._show(i, state.traceback)
                state.traceback = None
        elif line.startswith(_TRACEBACK):
            state.traceback = [line]
        elif _ABORTED.search(line):
            self._hold(i, [line])
        else:
            self._show(i, [line])

    def _show(self, i: int, lines: list) -> None:
        for line in lines:
            self.stream.write(f"[{self.labels[i]}] "
                              f"{line.decode(errors='replace')}\n")

    def _hold(self, i: int, lines: list) -> None:
        held = self._held.get(i)
        if held is None:
            folder = os.path.join(tempfile.gettempdir(),
                                  f"keras-mgpu-launch-{os.getpid()}")
            os.makedirs(folder, exist_ok=True)
            name = re.sub(r"[^\w.-]+", "-", self.labels[i])
            held = self._held[i] = _Held(
                os.path.join(folder, f"{self._held_as}-{name}.log"))
            open(held.path, "wb").close()
        with open(held.path, "ab") as f:
            for line in lines:
                f.write(line + b"\n")
                if held.aborted is None and _ABORTED.search(line):
                    text = line.decode(errors="replace").strip()
                    held.aborted = (text if len(text) <= _SHOWN
                                    else text[:_SHOWN] + "...")
        held.lines += len(lines)


def say(stream: Optional[TextIO], *lines: str) -> None:
    """Writes `lines` to `stream` (`None`: nowhere), each on its own."""
    if stream is not None and lines:
        stream.write("".join(line + "\n" for line in lines))
        stream.flush()
