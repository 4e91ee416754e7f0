"""The logger's epoch lines on the console, after Keras's progress bar."""

from keras_mgpu.callbacks._console import print_msg
from keras_mgpu.callbacks.telemetry.records import _summary


class _EpochLines:
    """The logger's console lines, printed where Keras's progress bar has
    finished its own.

    Keras's progress bar (`ProgbarLogger`, after the logger in `fit`'s
    list) ends its epoch line in its own `on_epoch_end`, which runs after
    the logger's: with a progress bar (`verbose` 1, 2 or "auto"; the
    default "auto" is 1) the epoch line waits for the next epoch's begin
    or the end of training, where Keras's line is complete, so it never
    lands inside the bar's line nor before Keras's own epoch summary.
    """

    def __init__(self):
        self._pending = None

    def epoch_end(self, record: dict, params) -> None:
        """The epoch line of `record`: printed now without a progress bar,
        else at the next `flush`."""
        self._pending = _console_line(record)
        if not _shows_progress_bar(params):
            self.flush()

    def flush(self) -> None:
        """Prints the pending epoch line."""
        if self._pending is not None:
            line, self._pending = self._pending, None
            print_msg(line)


def _shows_progress_bar(params) -> bool:
    """Whether `fit` (or a `CallbackList` with `add_progbar=True`) shows
    Keras's progress bar: `verbose` 1, 2 or "auto" in the callback params."""
    return bool((params or {}).get("verbose", 0))


def _console_line(record: dict) -> str:
    # 1-based, as Keras's progress bar counts epochs ("Epoch 3/12").
    head = f"DistributedLogger epoch {record['epoch'] + 1}"
    if record["resumed_after"]:
        # The interrupted run trained the epoch's first batches: the figures
        # are this run's, over the batches it trained.
        head += (f" (resumed after batch {record['resumed_after']}: "
                 f"{_batches(record['steps'])} trained here)")
    parts = [head + ":"]
    loss = record["metrics"].get("loss")
    if loss is not None:
        parts.append(f"loss {loss:.4g},")
    if record["examples_per_sec"] is not None:
        parts.append(
            f"{record['examples_per_sec']:.0f} examples/s "
            f"({record['examples_per_sec_per_replica']:.0f}/replica),"
        )
    parts.append(
        f"step {1000 * record['step_time_mean']:.1f} ms mean, "
        f"{1000 * record['step_time_max']:.1f} ms max,"
    )
    parts.append(
        f"input wait {_summary(record['input_wait'], record['input_bound'])}")
    if record["workers"] > 1:
        parts.append(f"(slowest worker {record['slowest_worker']})")
    return " ".join(parts)


def _batches(count: int) -> str:
    return f"{count} batch{'' if count == 1 else 'es'}"
