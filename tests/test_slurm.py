"""`keras_mgpu.slurm`: a SLURM step's cluster read from its variables (the
training run under them is tests/test_launch.py's)."""

import json

import pytest

from keras_mgpu import slurm

STEP = {"SLURM_STEP_NUM_TASKS": "6", "SLURM_PROCID": "4",
        "SLURM_LOCALID": "0", "SLURM_JOB_ID": "600",
        "SLURM_STEP_NODELIST": "a[1-2],b",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2),2"}


def test_every_task_is_a_worker_on_its_node_in_block_placement():
    task = slurm.slurm_task(STEP)
    config = json.loads(task.tf_config)
    port = slurm.job_port(600)
    assert port == 20000  # job 600 wraps to the first block
    assert config["cluster"]["worker"] == [
        f"{host}:{port + i}" for host in ("a1", "a2", "b") for i in (0, 1)]
    assert config["task"] == {"type": "worker", "index": 4}
    assert (task.rank, task.local_rank, task.local_tasks) == (4, 0, 2)
    assert not task.gpus_bound
    assert slurm.slurm_task({**STEP, "SLURM_GPUS_PER_TASK": "1"}).gpus_bound


@pytest.mark.parametrize("environ", [
    {},  # not under SLURM
    {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"},  # sbatch
    {**STEP, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"},  # one task
])
def test_no_step_of_several_tasks_is_no_cluster(environ):
    assert slurm.slurm_task(environ) is None


@pytest.mark.parametrize("change, message", [
    ({"SLURM_DISTRIBUTION": "cyclic"}, "SLURM_DISTRIBUTION='cyclic'"),
    ({"SLURM_STEP_TASKS_PER_NODE": "3,2,2"}, "do not place"),
    ({"SLURM_STEP_NODELIST": "a[1-2"}, "is not a host list"),
    ({"SLURM_STEP_NODELIST": "a[x-2]"}, r"\[x-2\] in 'a\[x-2\]' is not a number"),
    ({"SLURM_STEP_NODELIST": "a[3-1]"}, r"\[3-1\] .* an ascending range"),
    ({"SLURM_STEP_NODELIST": "a]1-2["}, r"'a\]1-2\[' is not a host list"),
    ({"SLURM_STEP_NODELIST": "a[1-2]]"}, r"'a\[1-2\]\]' is not a host list"),
    ({"SLURM_STEP_NODELIST": "a[1-[2]]"}, "is not a host list"),
    ({"SLURM_STEP_TASKS_PER_NODE": "two"}, "'two' is not a count"),
    ({"SLURM_PROCID": "6"}, "SLURM_PROCID=6 is not a task"),
    ({"SLURM_JOB_ID": ""}, "SLURM_JOB_ID is not set"),
    ({"SLURM_LOCALID": "x"}, "SLURM_LOCALID='x' is not an integer"),
])
def test_variables_that_place_no_cluster_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        slurm.slurm_task({**STEP, **change})


def test_gpus_are_shared_equally_or_refused():
    assert slurm.gpu_share(0, 1, 8) is None  # one task: all of them
    assert slurm.gpu_share(1, 2, 0) is None  # no GPUs
    assert slurm.gpu_share(3, 4, 4) == range(3, 4)
    with pytest.raises(ValueError, match="3 tasks .* 4 GPUs"):
        slurm.gpu_share(0, 3, 4)


@pytest.mark.parametrize("variable, value, count", [
    ("SLURM_STEP_NODELIST", "node[1-10000000000]", 10**10),
    ("SLURM_STEP_NODELIST", "r[1-100000]-n[1-100000]", 10**10),
    ("SLURM_STEP_NODELIST", "n[0-" + "9" * 30 + "]", 10**30),
    ("SLURM_STEP_TASKS_PER_NODE", "1(x10000000000)", 10**10),
])
def test_lists_are_counted_before_they_are_expanded(variable, value, count):
    """A corrupt list that would expand past memory is refused at once,
    with its count (expanding `node[1-10000000000]` ran out of memory)."""
    with pytest.raises(ValueError, match=f"names {count} .*more than the "
                       f"{slurm.MAX_HOSTS}"):
        slurm.slurm_task({**STEP, variable: value})
    # The limit itself expands.
    assert len(slurm.expand_hostlist(f"n[1-{slurm.MAX_HOSTS}]")) == (
        slurm.MAX_HOSTS)
