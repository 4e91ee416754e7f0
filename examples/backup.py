"""Exact resume: Ctrl-C (or kill) this script, run it again, same result.

    python examples/backup.py [--smoke] [--workdir DIR]

The "preemptible" preset saves every 50 batches (here 10) to the backup
folder, ten times as often to /dev/shm, and on SIGTERM; a rerun with the same
--workdir resumes at the next unseen batch.
"""

# _common first: it quiets TensorFlow's start-up logs.
from _common import digits, parse_args, workdir
from _interrupt import stops_cleanly

import keras_mgpu  # noqa: E402

strategy = keras_mgpu.auto_strategy(virtual_cpus=2)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_mgpu.callbacks import BackupAndRestore  # noqa: E402

args = parse_args(__doc__.splitlines()[0])
backup_dir = f"{workdir(args.workdir, 'backup', fresh=False)}/backup"
(x, y), (x_test, y_test) = digits()
# A fixed input order: resuming exactly needs the same batches again.
train = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dropout(0.2, seed=0),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile("adam", "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
backup = BackupAndRestore.from_preset("preemptible", backup_dir, save_freq=10)
# shuffle=False: a dataset keeps its own order (fit's default shuffle=True
# does not apply to one, and Keras 3.15 warns that it is ignored).
# Ctrl-C: one line saying that the backup resumes the run (exit code 130).
with stops_cleanly(backup_dir) as progress:
    model.fit(train, epochs=2 if args.smoke else 20, verbose=0,
              shuffle=False, callbacks=[progress.callback(), backup])
    accuracy = model.evaluate(x_test, y_test, verbose=0)[1]
print(f"optimizer steps: {int(model.optimizer.iterations.numpy())}; "
      f"test accuracy: {accuracy:.3f}")
