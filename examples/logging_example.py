"""Chief-only telemetry to TensorBoard and JSONL with DistributedLogger.

    python examples/logging_example.py [--smoke] [--workdir DIR]

Then run the TensorBoard command it prints: `train` and `validation` loss
overlay on one chart. The console counts epochs from 1, as Keras's progress
bar does; the JSONL's `epoch` field is 0-based, as Keras's callbacks get it.
"""

# _common first: it quiets TensorFlow's start-up logs.
from _common import digits, parse_args, tensorboard_command, workdir
from _interrupt import stops_cleanly

import keras_mgpu  # noqa: E402

strategy = keras_mgpu.auto_strategy(virtual_cpus=2)

import json  # noqa: E402

import keras  # noqa: E402

from keras_mgpu.callbacks import DistributedLogger  # noqa: E402

args = parse_args(__doc__.splitlines()[0])
log_dir = f"{workdir(args.workdir, 'logging_example')}/logs"
(x, y), (x_test, y_test) = digits()
with strategy.scope():
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile("adam", "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
with stops_cleanly() as progress:  # Ctrl-C: one line, exit code 130
    model.fit(x, y, batch_size=64, epochs=2 if args.smoke else 10, verbose=0,
              validation_data=(x_test, y_test),
              callbacks=[DistributedLogger(log_dir, update_freq=5),
                         progress.callback()])
with open(f"{log_dir}/metrics.jsonl") as f:
    last = json.loads(f.readlines()[-1])
# The last record is the last epoch's.
print(f"last record: epoch {last['epoch'] + 1} "
      f"(\"epoch\": {last['epoch']}, 0-based in the JSONL): "
      f"{last['examples_per_sec']:.0f} examples/s, validation loss "
      f"{last['metrics']['val_loss']:.3f}")
print(f"view it: {tensorboard_command(log_dir)}")
