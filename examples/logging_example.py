"""Chief-only telemetry to TensorBoard and JSONL with DistributedLogger.

    python examples/logging_example.py [--smoke] [--workdir DIR]

Then run the TensorBoard command it prints.
"""

# _common first: it quiets TensorFlow's start-up logs.
from _common import digits, parse_args, tensorboard_command, workdir

import keras_mgpu  # noqa: E402

strategy = keras_mgpu.auto_strategy(virtual_cpus=2)

import json  # noqa: E402

import keras  # noqa: E402

from keras_mgpu.callbacks import DistributedLogger  # noqa: E402

args = parse_args(__doc__.splitlines()[0])
log_dir = f"{workdir(args.workdir, 'logging')}/logs"
(x, y), _ = digits()
with strategy.scope():
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile("adam", "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
model.fit(x, y, batch_size=64, epochs=2 if args.smoke else 10, verbose=0,
          callbacks=[DistributedLogger(log_dir, update_freq=5)])
with open(f"{log_dir}/metrics.jsonl") as f:
    last = json.loads(f.readlines()[-1])
print(f"last record: {last['kind']} {last['epoch']}: "
      f"{last['examples_per_sec']:.0f} examples/s")
print(f"view it: {tensorboard_command(log_dir)}")
