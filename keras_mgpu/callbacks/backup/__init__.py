"""`BackupAndRestore` and its parts: one module per job (see
docs/architecture.md)."""

from keras_mgpu.callbacks.backup.callback import BackupAndRestore  # noqa: F401
from keras_mgpu.cluster.exit_codes import RESTART_EXIT_CODE  # noqa: F401
from keras_mgpu.cluster.exit_codes import RETRIED_EXIT_CODES  # noqa: F401
from keras_mgpu.callbacks.backup.lock import BackupDirInUse  # noqa: F401
from keras_mgpu.callbacks.backup.presets import list_presets  # noqa: F401
from keras_mgpu.callbacks.backup.state import register_callback_state  # noqa: F401
