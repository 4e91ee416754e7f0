"""`keras-mgpu doctor` on TensorFlow: how many processes the strategy
`auto_strategy()` would build trains in, and, where the cluster is
malformed, what to fix, named by where it was read (on JAX:
tests/jax/test_auto_strategy_jax.py)."""

import json

from keras_mgpu import _doctor

CPU = {"name": "/physical_device:CPU:0", "type": "CPU"}
BAD_STEP = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0",
            "SLURM_LOCALID": "0", "SLURM_JOB_ID": "600",
            "SLURM_STEP_NODELIST": "n[2-1]",
            "SLURM_STEP_TASKS_PER_NODE": "2"}


def doctor(env, **kwargs):
    return _doctor.collect(nvidia_smi_runner=lambda args: None,
                           devices=[CPU], env=env, **kwargs)


def test_doctor_counts_the_processes_auto_strategy_trains_in():
    assert doctor({})["strategy"] == {
        "kind": "default", "processes": 1,
        "description": "the default strategy (one device: the CPU)"}
    cluster = doctor({"TF_CONFIG": json.dumps({
        "cluster": {"chief": ["h0:1"], "worker": ["h1:1", "h2:1"]},
        "task": {"type": "worker", "index": 0}})})
    assert cluster["strategy"]["kind"] == "multi_worker"
    assert cluster["strategy"]["processes"] == 3
    # JAX's devices say nothing about a tf.distribute strategy.
    assert doctor({}, jax_devices=["gpu:0", "gpu:1"])["strategy"] == (
        doctor({})["strategy"])


def test_doctor_names_the_source_to_fix():
    """A malformed SLURM step said "none: fix TF_CONFIG first", where
    there was no TF_CONFIG."""
    step = doctor(BAD_STEP)
    assert step["strategy"] == {
        "kind": None, "processes": 1,
        "description": "none: fix the SLURM step's variables first"}
    assert "none: fix the SLURM step's variables first" in (
        _doctor.format_report(step))
    assert doctor({"TF_CONFIG": "{not json"})["strategy"]["description"] == (
        "none: fix TF_CONFIG first")
