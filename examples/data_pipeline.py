"""Sharded TFRecords in, global batches out, and a starved pipeline next to a fed one.

    python examples/data_pipeline.py [--smoke] [--workdir DIR]

The second half trains the same model on two pipelines over the same files
and lets `DistributedLogger` measure how long each train step waited for its
batch: a slow per-example decode run one example at a time starves the
replicas; the same decode cached after the first epoch keeps them fed.
"""

# _common first: it quiets TensorFlow's start-up logs.
from _common import digits, parse_args, tensorboard_command, workdir
from _interrupt import stops_cleanly

import keras_mgpu  # noqa: E402

strategy = keras_mgpu.auto_strategy(virtual_cpus=2)

import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras_mgpu import data  # noqa: E402
from keras_mgpu.callbacks import DistributedLogger, input_wait_summary  # noqa: E402

args = parse_args(__doc__.splitlines()[0])
root = workdir(args.workdir, "data_pipeline")
(x, y), _ = digits()
data.write_tfrecords((x, y), f"{root}/train", num_shards=4)
pattern = f"{root}/train/*.tfrecord"
print("records verified:", data.verify_tfrecords(pattern))
dataset = data.tfrecord_dataset(pattern, per_replica_batch_size=32,
                                strategy=strategy, shuffle=True, seed=0,
                                cache=True)
for epoch in range(1 if args.smoke else 3):
    start, batches = time.perf_counter(), 0
    for features, labels in dataset:
        batches += 1
    seconds = time.perf_counter() - start
    print(f"epoch {epoch}: {batches} batches of "
          f"{keras_mgpu.global_batch_size(32, strategy)} in {seconds:.3f}s "
          f"({batches / seconds:.0f} batches/s{', cached' if epoch else ''})")


def slow_decode(image, label):
    # Stands in for an expensive per-example decode (JPEG, audio): 2 ms of
    # host time that does not use the CPU, so the figures hold on any machine.
    image = tf.numpy_function(lambda a: (time.sleep(0.002), a)[1], [image],
                              tf.float32, stateful=False)
    return tf.ensure_shape(image, (64,)), label


pipelines = {
    # One example at a time, every epoch: ~130 ms of decoding per batch.
    "starved": dict(num_parallel_calls=1),
    # Decoded in parallel once, then served from memory.
    "fed": dict(cache=True),
}
# The smoke run's smaller model trains in a fraction of the time; its
# starved pipeline waits all the more.
width = 256 if args.smoke else 1024
print("\ninput wait, measured by DistributedLogger (last epoch):")
for name, options in pipelines.items():
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
    log_dir = os.path.join(root, "logs", name)
    train = data.tfrecord_dataset(pattern, per_replica_batch_size=32,
                                  strategy=strategy, map_fn=slow_decode,
                                  **options)
    # shuffle=False: the dataset shuffles itself (fit's default shuffle=True
    # does not apply to one, and Keras 3.15 warns that it is ignored).
    # Ctrl-C: one line, exit code 130.
    with stops_cleanly(announce=name == "starved") as progress:
        model.fit(train, epochs=2, verbose=0, shuffle=False, callbacks=[
            DistributedLogger(log_dir, update_freq="epoch", console=False),
            progress.callback()])
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        last = [json.loads(line) for line in f][-1]
    print(f"  {name:<8} input wait {input_wait_summary(last['input_wait'])}, "
          f"{last['examples_per_sec']:,.0f} examples/s")
print(f"TensorBoard: {tensorboard_command(os.path.join(root, 'logs'))}")
