"""Worker entry points for keras_mgpu.data's multi-worker tests."""


def read_sharded(pattern):
    import keras_mgpu

    strategy = keras_mgpu.auto_strategy()
    import tensorflow as tf

    from keras_mgpu import data

    ds = data.tfrecord_dataset(pattern, per_replica_batch_size=4,
                               strategy=strategy)
    policy = ds.options().experimental_distribute.auto_shard_policy
    labels, steps = [], 0
    for batch in strategy.experimental_distribute_dataset(ds):
        for value in strategy.experimental_local_results(batch[1]):
            labels.extend(value.numpy().tolist())
        steps += 1
    return {"policy": tf.data.experimental.AutoShardPolicy(policy).name,
            "steps": steps, "labels": labels}
