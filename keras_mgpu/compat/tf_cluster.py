"""TensorFlow's multi-worker start-up (its coordination service,
tensorflow/python/distribute/collective_all_reduce_strategy.py): a
registration deadline for `auto_strategy(startup_timeout=...)`.
"""

from __future__ import annotations

from keras_mgpu.compat._core import _internals_error, _require, _require_module
from keras_mgpu.compat.registry import _STARTUP_DEADLINE


# --- Multi-worker start-up deadline (keras_mgpu.strategy) ---------------------
def set_cluster_startup_timeout(seconds: float) -> None:
    """Makes TensorFlow's multi-worker start-up wait at most `seconds` for
    every training worker to connect, then raise `DeadlineExceededError`.

    `MultiWorkerMirroredStrategy` configures TensorFlow's coordination
    service itself, with no registration deadline: a worker whose peer
    never starts waits forever. This sets the same configuration (leader,
    chief and worker jobs), plus a registration barrier with a deadline,
    before the strategy is created; the strategy keeps a configuration it
    finds. Must run before the strategy, like the strategy itself.
    """
    import tensorflow as tf

    used_for = _STARTUP_DEADLINE
    multi_worker_util = _require_module(
        "tensorflow.python.distribute.multi_worker_util", used_for)
    context = _require_module("tensorflow.python.eager.context", used_for)
    proto = _require_module(
        "tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2",
        used_for)
    fields = proto.CoordinationServiceConfig.DESCRIPTOR.fields_by_name
    if "cluster_register_with_barrier" not in fields:
        raise _internals_error(
            "tensorflow's CoordinationServiceConfig with "
            "cluster_register_with_barrier", used_for)
    coordination_leader = _require(multi_worker_util, "coordination_leader",
                                   used_for, params=("cluster_spec",))
    ctx = _require(context, "context", used_for)()
    configure = _require(ctx, "configure_coordination_service", used_for)
    cluster_spec = (
        tf.distribute.cluster_resolver.TFConfigClusterResolver().cluster_spec()
    )
    configure(
        service_type="standalone",
        service_leader=coordination_leader(cluster_spec),
        coordinated_jobs=[
            proto.CoordinatedJob(name=job,
                                 num_tasks=cluster_spec.num_tasks(job))
            for job in ("chief", "worker") if job in cluster_spec.jobs
        ],
        cluster_register_timeout_in_ms=max(1, int(seconds * 1000)),
    )
    # Without the barrier the deadline is not enforced: the leader waits on.
    _require(ctx, "coordination_service",
             used_for).cluster_register_with_barrier = True
