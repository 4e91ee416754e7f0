"""A quiet TensorFlow start: `quiet_tensorflow()`, the first call of a script.

    import keras_mgpu
    keras_mgpu.quiet_tensorflow()  # first: TensorFlow loads without its C++ log lines

While `import tensorflow` loads TensorFlow's C++ libraries, they print log
lines before absl's logging is set up, and so before `TF_CPP_MIN_LOG_LEVEL`
is applied: absl's "All log messages before absl::InitializeLog() is called
are written to STDERR" banner, then `I0000 ...` lines such as
`cudart_stub.cc:31] Could not find cuda drivers`, `port.cc:153] oneDNN custom
operations are on` and `cpu_feature_guard.cc:227] This TensorFlow binary is
optimized ...`. Exporting `TF_CPP_MIN_LOG_LEVEL=3` does not hide them (measured
on TensorFlow 2.21). The level is read once, at that import: set later, it
changes nothing. Lines printed after the import, such as `E0000 ...
cuda_platform.cc:52] failed call to cuInit` when TensorFlow first looks for
devices, do follow it.

It imports only the standard library, and `import keras_mgpu` imports
neither Keras nor TensorFlow, so the call can come first.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import warnings
from typing import Callable

__all__ = ["quiet_tensorflow"]

LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
# What `quiet_tensorflow()` sets when the user set no level: no INFO, WARNING
# or ERROR lines from TensorFlow's C++ code (FATAL ones still show).
QUIET_LEVEL = 3

# An absl/TensorFlow C++ log line: severity letter, date, time, thread,
# file:line]. Before absl is set up they read `I0000 00:00:<epoch seconds>`.
_LOG_LINE = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ [^\]\s]+\] ")
_SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}
_BANNER = "WARNING: All log messages before absl::InitializeLog() is called"
# Second lines of multi-line messages, which carry no prefix of their own.
_CONTINUATIONS = ("To enable the following instructions:",)

# True once TensorFlow was imported by `quiet_tensorflow()` in this process.
_done = False


def quiet_tensorflow() -> None:
    """Imports TensorFlow without the C++ log lines it prints while it loads.

    Call it first in a script, before importing TensorFlow or Keras
    (`import keras_mgpu` before it is fine: it imports neither). It imports TensorFlow with file descriptor 2 (stderr)
    captured, and writes the captured lines back without those that
    `TF_CPP_MIN_LOG_LEVEL` excludes: the level TensorFlow applies to its
    later lines is applied to the ones it prints while loading too.

    - `TF_CPP_MIN_LOG_LEVEL` unset: it is set to `3` for this process and
      the processes it starts (such as `keras_mgpu.launcher`'s workers), so
      TensorFlow's INFO, WARNING and ERROR lines are hidden, during the
      import and after it (the `E0000 ... failed call to cuInit` of a
      machine without a GPU included).
    - `TF_CPP_MIN_LOG_LEVEL` set, stricter or looser: your level wins and
      is left as it is. `0` shows every line, as plain `import tensorflow`
      does; `1` hides INFO, `2` also WARNING, `3` also ERROR. A value that
      is not an integer counts as `0`, as TensorFlow reads it.

    absl's "All log messages before absl::InitializeLog()" banner goes with
    the INFO lines. Everything else is written back in order: Python
    warnings and errors raised during the import, and any line not from
    TensorFlow's logging. If the import fails, every captured line is
    written back and the error is raised. Output after the import, your own
    included, is never touched. `TF_ENABLE_ONEDNN_OPTS` is left alone: the
    oneDNN notice is hidden as an INFO line, oneDNN stays as TensorFlow
    chooses.

    Calling it again is a no-op. Called after something else imported
    TensorFlow, it can hide nothing and warns so.

    Example:

    ```python
    import keras_mgpu
    keras_mgpu.quiet_tensorflow()  # before TensorFlow or Keras

    import keras
    ```
    """
    global _done
    if _done:
        return
    if "tensorflow" in sys.modules:
        warnings.warn(
            "quiet_tensorflow() was called after TensorFlow was imported, so "
            "its start-up log lines were already printed. Call it first, "
            "before importing tensorflow or keras.",
            stacklevel=2)
        return
    level = os.environ.get(LEVEL_ENV)
    if level is None:
        os.environ[LEVEL_ENV] = str(QUIET_LEVEL)
        level = str(QUIET_LEVEL)
    _import_tensorflow(_min_severity(level))
    _done = True


def _min_severity(level: str) -> int:
    # As TensorFlow parses TF_CPP_MIN_LOG_LEVEL: an unparsable value is 0.
    try:
        return int(level.strip())
    except ValueError:
        return 0


def _import_tensorflow(min_severity: int) -> None:
    if min_severity <= 0:
        import tensorflow  # noqa: F401  (every line shows: nothing to hide)
        return
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        # No stderr to capture (e.g. closed by a daemon): nothing to quiet.
        import tensorflow  # noqa: F401
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow  # noqa: F401
        except BaseException:
            _restore_stderr(saved)
            _write_back(captured, keep=lambda line: True)
            raise
        _restore_stderr(saved)
        _write_back(captured, keep=_shown_at(min_severity))


def _shown_at(min_severity: int) -> Callable[[str], bool]:
    """Whether a captured line shows at this level; it follows, line by line,
    whether the log message it continues showed."""
    previous_shown = True

    def keep(line: str) -> bool:
        nonlocal previous_shown
        match = _LOG_LINE.match(line)
        if match:
            shown = _SEVERITY[match.group(1)] >= min_severity
        elif line.startswith(_BANNER):
            shown = min_severity <= _SEVERITY["I"]
        elif line.startswith(_CONTINUATIONS):
            shown = previous_shown
        else:
            shown = True
        previous_shown = shown
        return shown

    return keep


def _restore_stderr(saved: int) -> None:
    # Python-level writes made during the import sit in sys.stderr's buffer
    # and belong in the capture, before the lines that follow it.
    try:
        sys.stderr.flush()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _write_back(captured, keep: Callable[[str], bool]) -> None:
    captured.seek(0)
    text = captured.read().decode("utf-8", errors="replace")
    lines = [line for line in text.splitlines(keepends=True) if keep(line)]
    if lines:
        sys.stderr.write("".join(lines))
        sys.stderr.flush()
