"""Distributed-aware Keras callbacks."""

from keras_mgpu.callbacks.backup import RESTART_EXIT_CODE  # noqa: F401
from keras_mgpu.callbacks.backup import RETRIED_EXIT_CODES  # noqa: F401
from keras_mgpu.callbacks.backup import BackupAndRestore  # noqa: F401
from keras_mgpu.callbacks.backup import BackupDirInUse  # noqa: F401
from keras_mgpu.callbacks.backup import list_presets  # noqa: F401
from keras_mgpu.callbacks.backup import register_callback_state  # noqa: F401
from keras_mgpu.callbacks.telemetry import JSONL_KEYS  # noqa: F401
from keras_mgpu.callbacks.telemetry import LogDirInUse  # noqa: F401
from keras_mgpu.callbacks.telemetry import DistributedLogger  # noqa: F401
from keras_mgpu.callbacks.telemetry import input_wait_summary  # noqa: F401
from keras_mgpu.callbacks.loss_scale_monitor import LossScaleMonitor  # noqa: F401

__all__ = [
    "BackupAndRestore", "DistributedLogger", "LossScaleMonitor",
    "BackupDirInUse", "LogDirInUse", "register_callback_state",
    "list_presets", "input_wait_summary", "JSONL_KEYS", "RESTART_EXIT_CODE",
    "RETRIED_EXIT_CODES",
]
