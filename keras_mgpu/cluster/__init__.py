"""Where a cluster comes from and how a local one is run.

The cluster this process belongs to: `tf_config` (the only module that
reads `TF_CONFIG`; its public names are re-exported here) and `slurm` (a
SLURM step's `SLURM_*` variables as the `TF_CONFIG` of this task). The
local cluster `keras-mgpu launch` supervises: `workers` (one process per
worker, waited for), `supervisor` (`launch`: attempts and restarts),
`attempts` (why an attempt ended, and what comes next), `options` (the
command and options, checked before any worker starts), `output` (the
workers' output and results), `processes` (their limits and ends),
`signals` (the stop signals passed on) and `exit_codes` (the codes job
runners rerun a job for). `keras_mgpu.launcher` and `keras_mgpu.slurm` name
their public parts.

Standard library only: `keras-mgpu launch` starts no TensorFlow.
"""

from keras_mgpu.cluster.tf_config import GRPC_START_FAILED  # noqa: F401
from keras_mgpu.cluster.tf_config import ClusterInfo  # noqa: F401
from keras_mgpu.cluster.tf_config import cluster_info  # noqa: F401
from keras_mgpu.cluster.tf_config import make_tf_config  # noqa: F401
from keras_mgpu.cluster.tf_config import parse_tf_config  # noqa: F401

__all__ = [
    "ClusterInfo", "cluster_info", "make_tf_config", "parse_tf_config",
    "GRPC_START_FAILED",
]
