"""`DistributedLogger`, importable from its former module path; the code is in
`keras_mgpu.callbacks.telemetry`."""

from keras_mgpu.callbacks.telemetry import JSONL_KEYS  # noqa: F401
from keras_mgpu.callbacks.telemetry import DistributedLogger  # noqa: F401
from keras_mgpu.callbacks.telemetry import LogDirInUse  # noqa: F401
from keras_mgpu.callbacks.telemetry import input_wait_summary  # noqa: F401
