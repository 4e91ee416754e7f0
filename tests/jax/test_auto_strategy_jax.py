"""`auto_strategy()` on Keras's JAX backend: a `keras.distribution`
`DataParallel` over this process's 2 forced host devices, or over the
devices of the processes a `TF_CONFIG` or a SLURM step describes (joined
with `jax.distributed`, one device each, training as one process with both
devices does); the errors where it cannot; and `keras-mgpu doctor` saying
the same."""

import json
import socket

import jax
import keras
import pytest
import tensorflow as tf

import keras_mgpu
from keras_mgpu import _doctor
from keras_mgpu import GradientAccumulationModel
from keras_mgpu.launcher import free_ports
from keras_mgpu.slurm import job_port
from tests.workers import FEATURES, build_mlp, max_diff, regression_data

GLOBAL_BATCH = 16
ACCUM_STEPS = 2
CPU = {"name": "/physical_device:CPU:0", "type": "CPU"}
# One device per process: the 2 replicas span the 2 processes.
ONE_DEVICE_EACH = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1",
                   "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "-1"}


@pytest.fixture(autouse=True)
def no_distribution():
    """No distribution set before the test, and none after it."""
    assert keras.distribution.distribution() is None
    yield
    keras.distribution.set_distribution(None)


def train(seed=None) -> dict:
    """The same program for one process with 2 devices and for each of 2
    processes: `auto_strategy()` first (after `seed`, where given), then
    one optimizer step of a `GradientAccumulationModel` (2 micro-batches
    of the global batch) fed by one `tf.data` pipeline. Returns what this
    process sees."""
    if seed is not None:
        keras.utils.set_random_seed(seed)
    distribution = keras_mgpu.auto_strategy()
    facts = {
        "workers": keras_mgpu.num_workers(),
        "worker_index": keras_mgpu.worker_index(),
        "chief": keras_mgpu.is_chief(),
        "replicas": keras_mgpu.num_replicas(),
        "global_batch": keras_mgpu.global_batch_size(8),
        "multi": keras_mgpu.strategy.is_multi_worker(),
        "set": keras.distribution.distribution() is distribution,
        "again": keras_mgpu.auto_strategy() is distribution,
    }
    # Initialized from the random seed: without one, the processes must
    # still start their replicas alike; with one, as one process does.
    initial = keras.Sequential([keras.Input((FEATURES,)),
                                keras.layers.Dense(3)])
    x, y = regression_data(GLOBAL_BATCH * ACCUM_STEPS)
    # Keras gives each process its rows of every global batch.
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    with distribution.scope():  # as on TensorFlow; a no-op here
        inner = build_mlp()
        model = GradientAccumulationModel(inner, accum_steps=ACCUM_STEPS)
        model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(data, epochs=1, shuffle=False, verbose=0)
    return {
        "facts": facts,
        "devices": len(inner.weights[0].value.sharding.device_set),
        "initial": [w.tolist() for w in initial.get_weights()],
        "iterations": int(model.optimizer.iterations.numpy()),
        "weights": [w.tolist() for w in inner.get_weights()],
    }


def test_auto_strategy_sets_data_parallel_over_every_device():
    """It raised RuntimeError naming keras.distribution.DataParallel()."""
    result = train()
    assert result["facts"] == {
        "workers": 1, "worker_index": 0, "chief": True, "replicas": 2,
        "global_batch": 16, "multi": False, "set": True, "again": True}
    assert result["devices"] == 2 and result["iterations"] == 1
    distributed = result["weights"]
    # The same step on one device, without a distribution.
    keras.distribution.set_distribution(None)
    x, y = regression_data(GLOBAL_BATCH * ACCUM_STEPS)
    inner = build_mlp()
    model = GradientAccumulationModel(inner, accum_steps=ACCUM_STEPS)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    assert max_diff(distributed, inner.get_weights()) <= 1e-6
    assert max_diff(distributed, build_mlp().get_weights()) > 1e-3


def test_auto_strategy_arguments_on_jax():
    jax.devices()  # JAX has started, with the 2 forced devices
    one = keras_mgpu.auto_strategy(devices=["cpu:1"])
    assert keras_mgpu.num_replicas(one) == 1
    assert keras.distribution.distribution() is one
    keras.distribution.set_distribution(None)
    # TensorFlow's spellings name the same devices.
    two = keras_mgpu.auto_strategy(devices=["/device:CPU:0", "/cpu:1"])
    assert list(two.device_mesh.devices) == ["cpu:0", "cpu:1"]
    assert keras_mgpu.auto_strategy(virtual_cpus=2) is two
    keras.distribution.set_distribution(None)
    with pytest.raises(ValueError, match=r"cross_device_ops=.*XLA chooses"):
        keras_mgpu.auto_strategy(
            cross_device_ops=tf.distribute.HierarchicalCopyAllReduce())
    with pytest.raises(ValueError, match=r"no device 'gpu:0'; it sees "
                       r"cpu:0, cpu:1\."):
        keras_mgpu.auto_strategy(devices=["cpu:1", "gpu:0"])
    with pytest.raises(ValueError, match="names a device twice"):
        keras_mgpu.auto_strategy(devices=["cpu:0", "/cpu:0"])
    with pytest.raises(ValueError, match="non-empty list of device names"):
        keras_mgpu.auto_strategy(devices="cpu:0")
    with pytest.raises(RuntimeError, match=r"into 3 devices: JAX has already "
                       r"started.*xla_force_host_platform_device_count=3"):
        keras_mgpu.auto_strategy(virtual_cpus=3)
    with pytest.raises(ValueError, match="positive integer"):
        keras_mgpu.auto_strategy(virtual_cpus=0)
    assert keras.distribution.distribution() is None


def test_auto_strategy_refuses_what_it_cannot_set(monkeypatch):
    devices = jax.devices()[:2]
    mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), devices)
    model_parallel = keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="batch")
    for distribution, name in (
            (model_parallel, "ModelParallel over 2 device"),
            (keras.distribution.DataParallel(devices=devices[:1]),
             r"DataParallel over 1 device\(s\) \(cpu:0\)")):
        keras.distribution.set_distribution(distribution)
        with pytest.raises(RuntimeError, match=(
                rf"would set a DataParallel over 2 device.*already has a "
                rf"{name}.*set_distribution\(None\)")):
            keras_mgpu.auto_strategy()
        assert keras.distribution.distribution() is distribution
    keras.distribution.set_distribution(None)
    port = free_ports(1)[0]
    # Worker 0 serves the coordinator, so nothing waits: JAX refuses to
    # join once it has started, as it has in this process.
    monkeypatch.setenv("TF_CONFIG", keras_mgpu.strategy.make_tf_config(
        [f"localhost:{port}", "localhost:1"], 0))
    with pytest.raises(RuntimeError, match=(
            r"join the cluster of TF_CONFIG as process 0 of 2 .* Call "
            r"keras_mgpu.auto_strategy\(\) first in the program")):
        keras_mgpu.auto_strategy()
    with pytest.raises(ValueError, match="virtual_cpus=2.*multi-worker"):
        keras_mgpu.auto_strategy(virtual_cpus=2)
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["h0:1", "h1:1"], "evaluator": ["h2:1"]},
        "task": {"type": "evaluator", "index": 0}}))
    with pytest.raises(ValueError, match=(
            r"the cluster's 'evaluator' task.*Run it without TF_CONFIG")):
        keras_mgpu.auto_strategy()
    assert keras.distribution.distribution() is None
    assert not jax.distributed.is_initialized()


def test_two_processes_train_as_one_process(run_workers):
    reference = train()
    keras.distribution.set_distribution(None)
    workers = run_workers(train, 2, env=ONE_DEVICE_EACH)
    check_processes(workers, reference)
    # No seed: each process drew its own; auto_strategy() made them agree
    # (JAX refuses to place differing values on the replicas).
    assert workers[0].result["initial"] == workers[1].result["initial"]


def free_slurm_job() -> int:
    """A job id whose 2 ports (`keras_mgpu.slurm.job_port`) are free here."""
    for job in range(1000, 1600):
        sockets = []
        try:
            for port in (job_port(job), job_port(job) + 1):
                s = socket.socket()
                sockets.append(s)
                s.bind(("localhost", port))
            return job
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free pair of SLURM job ports on this machine")


def test_two_tasks_of_a_slurm_step_train_as_one_process(run_workers):
    reference = train(seed=5)
    keras.distribution.set_distribution(None)
    step = {"TF_CONFIG": "", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_JOB_ID": str(free_slurm_job()),
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_STEP_TASKS_PER_NODE": "2", **ONE_DEVICE_EACH}
    workers = run_workers(train, 2, kwargs={"seed": 5}, env=lambda i: {
        **step, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)})
    check_processes(workers, reference)
    # The seed set before auto_strategy() is kept: the same initial
    # weights as in one process.
    for worker in workers:
        assert worker.result["initial"] == reference["initial"]


def check_processes(workers, reference):
    for index, worker in enumerate(workers):
        result = worker.result
        assert result["facts"] == {
            "workers": 2, "worker_index": index, "chief": index == 0,
            "replicas": 2, "global_batch": 16, "multi": True, "set": True,
            "again": True}, worker.stderr[-3000:]
        assert result["devices"] == 2 and result["iterations"] == 1
        assert max_diff(result["weights"], reference["weights"]) <= 1e-6


def test_a_process_in_another_cluster_is_refused(run_workers):
    # jax.distributed joined as 1 process; TF_CONFIG then names 2.
    [worker] = run_workers(joined_alone_then_asked_for_two, 1,
                           env=ONE_DEVICE_EACH)
    assert worker.result["error"].startswith(
        "jax.distributed is already initialized, as process 0 of 1, but "
        "auto_strategy() would make this process 0 of 2 (from TF_CONFIG)")
    assert "Drop the earlier jax.distributed.initialize()" in (
        worker.result["error"])
    # With TF_CONFIG unset it takes the process's devices as they are.
    assert worker.result["alone"] == ["cpu:0"]


def joined_alone_then_asked_for_two() -> dict:
    import os

    jax.distributed.initialize(f"localhost:{free_ports(1)[0]}",
                               num_processes=1, process_id=0)
    os.environ["TF_CONFIG"] = keras_mgpu.strategy.make_tf_config(
        [f"localhost:{port}" for port in free_ports(2)], 0)
    try:
        keras_mgpu.auto_strategy()
    except RuntimeError as e:
        error = str(e)
    del os.environ["TF_CONFIG"]
    alone = keras_mgpu.auto_strategy()
    return {"error": error, "alone": list(alone.device_mesh.devices)}


def test_the_coordinator_unreached_or_unserved_is_named(run_workers):
    """JAX alone aborted worker 1 (SIGABRT, DEADLINE_EXCEEDED) naming no
    address, and told worker 0 'Failed to start RPC server'."""
    [worker] = run_workers(coordinator_never_comes, 1, env=ONE_DEVICE_EACH)
    waited, busy = worker.result["waited"], worker.result["busy"]
    assert waited.startswith("Process 1 of 2 waited 1 s for "
                             "jax.distributed's coordinator at localhost:")
    assert "(worker 0's address in TF_CONFIG); nothing listens there" in (
        waited)
    assert "startup_timeout=None" in waited
    assert busy.startswith("auto_strategy(): process 0 of 2 (from "
                           "TF_CONFIG) serves jax.distributed's coordinator "
                           "at localhost:")
    assert "another process holds it" in busy


def coordinator_never_comes() -> dict:
    """Worker 1 of a cluster whose worker 0 never starts, then worker 0
    on a port another socket holds."""
    import os

    errors = {}
    ports = free_ports(2)
    with socket.socket() as holder:
        holder.bind(("localhost", ports[0]))
        holder.listen()
        for name, index, port in (("waited", 1, ports[1]),
                                  ("busy", 0, ports[0])):
            os.environ["TF_CONFIG"] = keras_mgpu.strategy.make_tf_config(
                [f"localhost:{port}", "localhost:1"], index)
            try:
                keras_mgpu.auto_strategy(startup_timeout=1)
            except RuntimeError as e:
                errors[name] = str(e)
    return errors


# --- keras-mgpu doctor on JAX ----------------------------------------------------


def doctor(env, jax_devices=("cpu:0", "cpu:1")):
    return _doctor.collect(nvidia_smi_runner=lambda args: None,
                           devices=[CPU], env=env, jax_devices=jax_devices)


def test_doctor_names_what_auto_strategy_sets_on_jax():
    """It said "the default strategy" and "MultiWorkerMirroredStrategy over
    2 workers" where auto_strategy() raised."""
    alone = doctor({})
    assert alone["strategy"] == {
        "kind": "data_parallel", "processes": 1,
        "description": "keras.distribution.DataParallel over 2 device(s) "
                       "(cpu:0, cpu:1), 1 process"}
    [no_gpu] = [f for f in alone["findings"] if f["code"] == "no_gpu"]
    assert "2 replica(s)" in no_gpu["message"]
    assert "DataParallel over N CPU devices" in no_gpu["advice"]
    # What auto_strategy() sets here, without arguments.
    assert list(keras_mgpu.auto_strategy().device_mesh.devices) == [
        "cpu:0", "cpu:1"]
    assert _doctor.collect(nvidia_smi_runner=lambda args: None,
                           devices=[CPU], env={})["strategy"] == (
        alone["strategy"])
    config = {"cluster": {"chief": ["h0:7"], "worker": ["h1:7", "h2:7"]},
              "task": {"type": "worker", "index": 1}}
    cluster = doctor({"TF_CONFIG": json.dumps(config)}, ["cpu:0"])
    assert cluster["ok"] and cluster["strategy"]["processes"] == 3
    text = _doctor.format_report(cluster)
    assert ("auto_strategy() would pick: keras.distribution.DataParallel "
            "over the devices of 3 JAX processes (jax.distributed, "
            "coordinator h0:7; this is process 2, with 1 device(s) "
            "(cpu:0))") in text
    step = doctor({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1",
                   "SLURM_LOCALID": "1", "SLURM_JOB_ID": "600",
                   "SLURM_STEP_NODELIST": "node7",
                   "SLURM_STEP_TASKS_PER_NODE": "2"})
    assert step["strategy"]["processes"] == 2
    assert "coordinator node7:20000; this is process 1" in (
        step["strategy"]["description"])
    config["task"] = {"type": "evaluator", "index": 0}
    config["cluster"]["evaluator"] = ["h3:7"]
    evaluator = doctor({"TF_CONFIG": json.dumps(config)})
    assert not evaluator["ok"] and evaluator["strategy"]["kind"] is None
    [error] = [f for f in evaluator["findings"] if f["level"] == "error"]
    assert error["code"] == "jax_task_unsupported"
    assert "'evaluator' task" in error["message"]
    bad = doctor({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0",
                  "SLURM_LOCALID": "0", "SLURM_JOB_ID": "600",
                  "SLURM_STEP_NODELIST": "n[2-1]",
                  "SLURM_STEP_TASKS_PER_NODE": "2"})
    assert bad["strategy"]["description"] == (
        "none: fix the SLURM step's variables first")
