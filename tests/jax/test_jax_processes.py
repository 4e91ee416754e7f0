"""Two local JAX processes (`jax.distributed` on 127.0.0.1, CPU collectives
over gloo, one device each): the distribution facts and the host
collectives the logger and the backup use, as each process sees them."""

import json
import os
import subprocess
import sys

from keras_mgpu.launcher import free_ports

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
