"""A complete training script for one process, local workers or a SLURM job.

    .venv/bin/python examples/train.py --epochs 3
    .venv/bin/keras-mgpu launch --workers 2 -- .venv/bin/python examples/train.py
    srun .venv/bin/python examples/train.py --backup-dir /nfs/runs/train/backup

`keras_mgpu.auto_strategy()` reads the cluster (the launcher's `TF_CONFIG`,
or the `srun` step's variables) and returns a MultiWorkerMirroredStrategy
over its workers, else one for this machine's GPUs. The "multi_worker"
backup preset saves every `--save-freq` batches and, on SIGTERM, on every
worker at the same batch, then exits with code 143: run the same command
again (or let the launcher, or SLURM's requeue, do it) and it resumes at
that batch. `DistributedLogger` writes TensorBoard and JSONL logs from the
chief. The data is synthetic and the model small: a few seconds an epoch on
a CPU. Outputs go under `--workdir` (default `runs/train`, from the working
directory).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# First: _common quiets TensorFlow's start-up logs (and the workers').
from _common import shown  # noqa: E402
from _interrupt import stops_cleanly  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=32,
                    help="examples per replica per step (default: 32)")
parser.add_argument("--examples", type=int, default=2048,
                    help="synthetic training examples (default: 2048)")
parser.add_argument("--save-freq", type=int, default=25,
                    help="batches between backups (default: 25)")
parser.add_argument("--workdir", default=os.path.join("runs", "train"))
parser.add_argument("--backup-dir", default=None,
                    help="storage every worker reads the same (default: "
                         "WORKDIR/backup)")
parser.add_argument("--log-dir", default=None,
                    help="the chief's logs (default: WORKDIR/logs)")
parser.add_argument("--smoke", action="store_true",
                    help="2 epochs, as the test suite runs it")
args = parser.parse_args()
if args.smoke:
    args.epochs = 2
backup_dir = args.backup_dir or os.path.join(args.workdir, "backup")
log_dir = args.log_dir or os.path.join(args.workdir, "logs")

import keras_mgpu  # noqa: E402

# First, before TensorFlow sets up its devices: the srun step's tasks or
# the launcher's workers, else all local GPUs, else this process alone.
strategy = keras_mgpu.auto_strategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_mgpu.callbacks import BackupAndRestore, DistributedLogger  # noqa: E402

if keras_mgpu.is_chief():
    # (TensorFlow's class for MultiWorkerMirroredStrategy has another name.)
    kind = ("MultiWorkerMirroredStrategy" if keras_mgpu.num_workers() > 1
            else type(strategy).__name__.lstrip("_"))
    print(f"{kind}: {strategy.num_replicas_in_sync} replica(s), "
          f"{keras_mgpu.num_workers()} worker(s); backup in "
          f"{shown(backup_dir)}, logs in {shown(log_dir)}", flush=True)

# The same data on every worker; a fixed order, for an exact resume.
rng = np.random.RandomState(0)
x = rng.rand(args.examples, 16).astype("float32")
y = (x.sum(axis=1) > 8).astype("int64")
global_batch = keras_mgpu.global_batch_size(args.batch_size, strategy)
train = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)

keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(2),
    ])
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

# A SIGTERM on any worker: all save at the same batch, then exit 143.
backup = BackupAndRestore.from_preset("multi_worker", backup_dir,
                                      save_freq=args.save_freq)
logger = DistributedLogger(log_dir, update_freq=20)
with stops_cleanly(backup_dir) as progress:  # Ctrl-C: one line, exit 130
    # The backup last: it saves the state the other callbacks leave.
    model.fit(train, epochs=args.epochs, verbose=0, shuffle=False,
              callbacks=[logger, progress.callback(), backup])
    loss, accuracy = model.evaluate(train, verbose=0)
if keras_mgpu.is_chief():
    print(f"optimizer steps: {int(model.optimizer.iterations.numpy())}; "
          f"accuracy {accuracy:.3f}")
