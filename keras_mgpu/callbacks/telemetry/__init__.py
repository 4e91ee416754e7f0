"""Training telemetry: `DistributedLogger` and the parts it is made of.

`logger` (the callback: when a window or an epoch closes), `records` (the
JSONL schema and a record's figures), `reader` (what a record reads from the
device), `workers` (cross-worker figures), `summaries` (the model's own
`tf.summary` calls), `profiler` (`profile_steps`), `sinks` (TensorBoard,
JSONL, wandb), `tensorboard` (the TensorBoard layout of a record), `claims`
(one writer per `log_dir`), `console` (the epoch line), `hand_loop` (a
hand-written loop's figures), `state` and `options`.
"""

from keras_mgpu.callbacks.telemetry.claims import LogDirInUse  # noqa: F401
from keras_mgpu.callbacks.telemetry.logger import DistributedLogger  # noqa: F401
from keras_mgpu.callbacks.telemetry.records import JSONL_KEYS  # noqa: F401
from keras_mgpu.callbacks.telemetry.records import input_wait_summary  # noqa: F401
