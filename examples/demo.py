"""keras-mgpu demo: train a digit classifier on every local replica.

Runs on a laptop CPU (split into 2 logical devices) or on all local GPUs. The
data is scikit-learn's bundled handwritten digits: nothing is downloaded.

    make demo
"""

import time

import numpy as np

import keras_mgpu

# The strategy comes first: it may have to configure devices.
import tensorflow as tf  # noqa: E402

NO_GPU = not tf.config.list_physical_devices("GPU")
strategy = keras_mgpu.auto_strategy(virtual_cpus=2 if NO_GPU else None)

import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402


def main() -> None:
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.RandomState(0).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    per_replica = 32
    batch = keras_mgpu.global_batch_size(per_replica, strategy)
    train = tf.data.Dataset.from_tensor_slices((x[:split], y[:split]))
    train = train.shuffle(split, seed=0).batch(batch).prefetch(2)
    test = tf.data.Dataset.from_tensor_slices((x[split:], y[split:]))
    test = test.batch(batch)

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ])
        model.compile(keras.optimizers.Adam(3e-3),
                      "sparse_categorical_crossentropy", metrics=["accuracy"])
    start = time.perf_counter()
    model.fit(train, epochs=15, verbose=2)
    seconds = time.perf_counter() - start
    _, accuracy = model.evaluate(test, verbose=0)

    print()
    print(f"replicas:      {strategy.num_replicas_in_sync} "
          f"({'logical CPUs' if NO_GPU else 'GPUs'})")
    print(f"global batch:  {batch} ({per_replica} per replica)")
    print(f"throughput:    {15 * split / seconds:,.0f} examples/s")
    print(f"test accuracy: {accuracy:.3f} on {len(x) - split} held-out digits")
    assert accuracy > 0.9, f"accuracy {accuracy:.3f} is too low: a bug?"


if __name__ == "__main__":
    main()
