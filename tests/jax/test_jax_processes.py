"""Two local JAX processes (`jax.distributed` on 127.0.0.1, CPU collectives
over gloo, one device each): the distribution facts and the host
collectives the logger and the backup use, as each process sees them;
training across them against one process with both devices; the backup's
resume after a SIGKILL of both and a SIGTERM of one."""

import json
import os
import signal
import subprocess
import sys

from keras_mgpu.callbacks.backup import RESTART_EXIT_CODE
from keras_mgpu.launcher import free_ports
from tests.jax import backup_workers
from tests.workers import max_diff

WORKER = r"""
import json, os, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
index, port = int(sys.argv[1]), sys.argv[2]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2,
                           process_id=index,
                           initialization_timeout=120)
import keras, numpy as np, keras_mgpu
from keras_mgpu import backend
keras.distribution.set_distribution(keras.distribution.DataParallel())
collectives = backend.active()
rows = collectives.gather_rows(None, np.array([index + 0.25, 1e9 + index]), 2)
total = collectives.sum_over_workers(None, index + 1.0, 2)
print("RESULT " + json.dumps({
    "index": index, "workers": keras_mgpu.num_workers(),
    "worker_index": keras_mgpu.worker_index(),
    "chief": keras_mgpu.is_chief(), "replicas": keras_mgpu.num_replicas(),
    "global_batch": keras_mgpu.global_batch_size(8),
    "multi": keras_mgpu.strategy.is_multi_worker(),
    "rows": rows.tolist(), "total": total}), flush=True)
"""


def test_two_processes_agree_on_the_facts_and_exchange_rows(tmp_path):
    port = free_ports(1)[0]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="jax")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    children = [subprocess.Popen(
        [sys.executable, str(script), str(i), str(port)], cwd=tmp_path,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    outputs = []
    try:
        for child in children:
            out, err = child.communicate(timeout=240)
            assert child.returncode == 0, f"worker failed:\n{err[-4000:]}"
            outputs.append(out)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.communicate()
    results = [json.loads(next(line[len("RESULT "):] for line in out.splitlines()
                               if line.startswith("RESULT ")))
               for out in outputs]
    for index, result in enumerate(results):
        assert result == {
            "index": index, "workers": 2, "worker_index": index,
            "chief": index == 0, "replicas": 2, "global_batch": 16,
            "multi": True,
            "rows": [[0.25, 1e9], [1.25, 1e9 + 1]], "total": 3.0}


# One device per process: the 2 replicas span the 2 processes.
ONE_DEVICE_EACH = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1",
                   "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "-1"}


def train(run_workers, backup_dir, num_workers, kill_at=None,
          kill_workers=None, kill_signal=signal.SIGKILL, **kwargs):
    """`backup_workers.train` in `num_workers` processes (one device each
    when 2, both devices of one process when 1); `kill_signal` to
    `kill_workers` (all: None) at `STEP <kill_at>;`."""
    options = {"env": ONE_DEVICE_EACH} if num_workers > 1 else {}
    if kill_at is not None:
        options.update(kill_when_printed=f"STEP {kill_at};",
                       kill_workers=kill_workers, kill_signal=kill_signal,
                       check=kill_signal == signal.SIGKILL)
    return run_workers(backup_workers.train, num_workers,
                       kwargs={"backup_dir": str(backup_dir),
                               "kill_at": kill_at, **kwargs}, **options)


def test_two_processes_train_and_resume_as_one_process(run_workers,
                                                       tmp_path):
    # Window accumulation with dropout and a metric, each process feeding
    # its half of every global batch; killed mid-window, then preempted on
    # one process only. A local tier saves every batch: each resume is
    # from the local copies both processes have.
    kwargs = {"accum_steps": 3, "save_freq": 4, "local_save_freq": 1}
    one = train(run_workers, tmp_path / "one", 1, **kwargs)[0].result
    two = train(run_workers, tmp_path / "two", 2, **kwargs)
    for worker in two:
        assert worker.result["iterations"] == one["iterations"] == 9
        assert max_diff(worker.result["weights"], one["weights"]) <= 1e-6
    backup_dir = tmp_path / "backup"
    killed = train(run_workers, backup_dir, 2, kill_at=5, **kwargs)
    assert all(w.killed and w.returncode == -signal.SIGKILL for w in killed)
    # SIGTERM to process 1 only: both save at the same batch and exit.
    stopped = train(run_workers, backup_dir, 2, kill_at=13,
                    kill_workers=[1], hold_workers=[1],
                    kill_signal=signal.SIGTERM, **kwargs)
    for worker in stopped:
        assert worker.returncode == RESTART_EXIT_CODE, worker.stderr[-3000:]
        assert "SIGTERM received" in worker.stderr
    # The kill came after the local save of step 6 (batch 5 from 0).
    assert "resumed from local generation 6 at epoch 1, step 6" in (
        stopped[0].stdout)
    resumed = train(run_workers, backup_dir, 2, **kwargs)
    assert "resumed from local generation" in resumed[0].stdout  # chief
    for worker in resumed:
        assert worker.result["iterations"] == one["iterations"]
        assert worker.result["global_step"] == 24
        assert max_diff(worker.result["weights"], one["weights"]) <= 1e-6


def test_a_layer_split_over_two_processes_is_saved_whole_and_resumed(
        run_workers, tmp_path):
    # ModelParallel: the hidden kernel's columns half in each process, so
    # neither can read it alone; the backup gathers it for the save and
    # places it back on the restore.
    kwargs = {"model_parallel": True, "save_freq": 4}
    full = train(run_workers, tmp_path / "full", 2, **kwargs)
    backup_dir = tmp_path / "backup"
    killed = train(run_workers, backup_dir, 2, kill_at=13, **kwargs)
    assert all(w.killed for w in killed)
    resumed = train(run_workers, backup_dir, 2, **kwargs)
    assert "resumed from backup generation 3" in resumed[0].stdout
    for worker, reference in zip(resumed, full):
        assert worker.result["iterations"] == reference.result[
            "iterations"] == 24
        assert max_diff(worker.result["weights"],
                        reference.result["weights"]) <= 1e-6
