"""Sharded TFRecords in, global batches out: a pipeline that keeps replicas fed.

    python examples/data_pipeline.py [--smoke] [--workdir DIR]
"""

import keras_mgpu

strategy = keras_mgpu.auto_strategy(virtual_cpus=2)

import time  # noqa: E402

from _common import digits, parse_args, workdir  # noqa: E402
from keras_mgpu import data  # noqa: E402

args = parse_args(__doc__.splitlines()[0])
root = workdir(args.workdir, "data")
(x, y), _ = digits()
data.write_tfrecords((x, y), f"{root}/train", num_shards=4)
print("records verified:", data.verify_tfrecords(f"{root}/train/*.tfrecord"))
dataset = data.tfrecord_dataset(f"{root}/train/*.tfrecord",
                                per_replica_batch_size=32, strategy=strategy,
                                shuffle=True, seed=0, cache=True)
for epoch in range(1 if args.smoke else 3):
    start, batches = time.perf_counter(), 0
    for features, labels in dataset:
        batches += 1
    seconds = time.perf_counter() - start
    print(f"epoch {epoch}: {batches} batches of "
          f"{keras_mgpu.global_batch_size(32, strategy)} in {seconds:.3f}s "
          f"({batches / seconds:.0f} batches/s{', cached' if epoch else ''})")
