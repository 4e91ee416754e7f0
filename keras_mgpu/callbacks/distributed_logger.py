"""`DistributedLogger` and its names, importable from this module path; the
code is the `keras_mgpu.callbacks.telemetry` package.

Example:

>>> from keras_mgpu.callbacks.distributed_logger import (
...     DistributedLogger, input_wait_summary)
>>> DistributedLogger.__module__
'keras_mgpu.callbacks.telemetry.logger'
>>> input_wait_summary(0.03)
'3.0% of step time (not input-bound)'
"""

from keras_mgpu.callbacks.telemetry import JSONL_KEYS  # noqa: F401
from keras_mgpu.callbacks.telemetry import DistributedLogger  # noqa: F401
from keras_mgpu.callbacks.telemetry import LogDirInUse  # noqa: F401
from keras_mgpu.callbacks.telemetry import input_wait_summary  # noqa: F401
