"""The cluster of a SLURM job step, read from the `SLURM_*` variables
`srun` sets: what `auto_strategy()` uses when `TF_CONFIG` is not set. It
lives in `keras_mgpu.cluster.slurm`; this module names its public parts.
"""

from keras_mgpu.cluster.slurm import MAX_HOSTS  # noqa: F401
from keras_mgpu.cluster.slurm import SlurmTask  # noqa: F401
from keras_mgpu.cluster.slurm import cluster_task  # noqa: F401
from keras_mgpu.cluster.slurm import expand_hostlist  # noqa: F401
from keras_mgpu.cluster.slurm import expand_tasks_per_node  # noqa: F401
from keras_mgpu.cluster.slurm import gpu_share  # noqa: F401
from keras_mgpu.cluster.slurm import job_port  # noqa: F401
from keras_mgpu.cluster.slurm import slurm_task  # noqa: F401

__all__ = [
    "slurm_task", "SlurmTask", "cluster_task", "gpu_share", "job_port",
    "expand_hostlist", "expand_tasks_per_node", "MAX_HOSTS",
]
