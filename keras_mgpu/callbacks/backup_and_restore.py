"""`BackupAndRestore` and its names, importable from this module path; the
code is the `keras_mgpu.callbacks.backup` package.

Example:

>>> from keras_mgpu.callbacks.backup_and_restore import (
...     BackupAndRestore, RESTART_EXIT_CODE)
>>> BackupAndRestore.__module__
'keras_mgpu.callbacks.backup.callback'
>>> RESTART_EXIT_CODE
143
"""

from keras_mgpu.callbacks.backup import RESTART_EXIT_CODE  # noqa: F401
from keras_mgpu.callbacks.backup import RETRIED_EXIT_CODES  # noqa: F401
from keras_mgpu.callbacks.backup import BackupAndRestore  # noqa: F401
from keras_mgpu.callbacks.backup import BackupDirInUse  # noqa: F401
from keras_mgpu.callbacks.backup import list_presets  # noqa: F401
from keras_mgpu.callbacks.backup import register_callback_state  # noqa: F401
