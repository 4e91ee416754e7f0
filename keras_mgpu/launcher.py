"""Runs a program as a local multi-worker cluster, once or supervised.

`run_local_workers` starts one process per worker, each with a `TF_CONFIG`
naming every worker on a free localhost port, and waits for them;
`launch` (what `keras-mgpu launch` runs) starts them again when a worker
dies. They live in `keras_mgpu.cluster`; this module names them.
"""

from keras_mgpu.cluster.attempts import Attempt  # noqa: F401
from keras_mgpu.cluster.attempts import LaunchError  # noqa: F401
from keras_mgpu.cluster.attempts import LaunchResult  # noqa: F401
from keras_mgpu.cluster.exit_codes import LAUNCH_RESTART_EXIT_CODES  # noqa: F401
from keras_mgpu.cluster.options import RESULT_ENV  # noqa: F401
from keras_mgpu.cluster.options import Target  # noqa: F401
from keras_mgpu.cluster.output import WorkerError  # noqa: F401
from keras_mgpu.cluster.output import WorkerResult  # noqa: F401
from keras_mgpu.cluster.supervisor import ATTEMPT_ENV  # noqa: F401
from keras_mgpu.cluster.supervisor import launch  # noqa: F401
from keras_mgpu.cluster.workers import free_ports  # noqa: F401
from keras_mgpu.cluster.workers import run_local_workers  # noqa: F401

__all__ = [
    "launch", "run_local_workers", "free_ports", "LaunchResult", "LaunchError",
    "Attempt", "WorkerResult", "WorkerError", "Target", "ATTEMPT_ENV",
    "RESULT_ENV", "LAUNCH_RESTART_EXIT_CODES",
]
