"""The logger's wandb files stay under its log_dir when wandb-core runs
elsewhere: a process reuses its parent's wandb-core (WANDB_SERVICE), whose
working directory is the parent's."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("wandb")

CODE = textwrap.dedent("""
    import os, sys
    import wandb
    # wandb-core starts here, in the "parent" folder...
    wandb.init(mode="offline", project="p", dir=sys.argv[1]).finish()
    # ...and the program moves on, as a child started elsewhere would.
    os.chdir(sys.argv[2])
    import numpy as np
    import keras
    from keras_mgpu.callbacks import DistributedLogger

    x = np.random.RandomState(0).rand(32, 4).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    logger = DistributedLogger("logs/run1", console=True,
                               wandb={"project": "p", "mode": "offline"})
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0,
              callbacks=[logger])
    print("trained")
""")


def test_wandb_files_stay_under_a_relative_log_dir(tmp_path):
    parent, child, first = (tmp_path / n for n in ("parent", "child", "first"))
    for folder in (parent, child, first):
        folder.mkdir()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="-1", TF_CPP_MIN_LOG_LEVEL="3")
    for name in ("WANDB_SERVICE", "WANDB_MODE", "WANDB_DIR"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", CODE, str(first), str(child)],
                          cwd=parent, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0 and "trained" in done.stdout, (
        done.stdout[-2000:] + done.stderr[-4000:])
    assert sorted(os.listdir(parent)) == [], sorted(
        str(p.relative_to(parent)) for p in parent.rglob("*"))
    logs = list((child / "logs" / "run1" / "wandb").glob(
        "offline-run-*/files/output.log"))
    assert len(logs) == 1, sorted(str(p) for p in child.rglob("*"))
