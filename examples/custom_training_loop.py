"""What the components save you: a custom training loop next to `fit`.

    python examples/custom_training_loop.py [--smoke]

Both train the same model on the same batches; the loop needs
`strategy.run`, `strategy.reduce`, `experimental_distribute_dataset` and
hand-made loss scaling, `fit` needs none of it.
"""

# _common first: it quiets TensorFlow's start-up logs.
from _common import digits, parse_args
from _interrupt import stops_cleanly

import keras_mgpu  # noqa: E402

strategy = keras_mgpu.auto_strategy(virtual_cpus=2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


args = parse_args(__doc__.splitlines()[0])
(x, y), _ = digits()
epochs = 1 if args.smoke else 5
global_batch = keras_mgpu.global_batch_size(32, strategy)
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)


def build():
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    rng = np.random.RandomState(0)  # the same start for both
    model.set_weights([0.1 * rng.randn(*w.shape).astype("float32")
                       for w in model.get_weights()])
    return model


# --- The custom training loop -------------------------------------------------
with strategy.scope():
    loop_model = build()
    optimizer = keras.optimizers.SGD(0.1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="none")


@tf.function
def train_step(batch):
    def step(features, labels):
        with tf.GradientTape() as tape:
            per_sample = loss_fn(labels, loop_model(features, training=True))
            # Divide by the global batch, not the replica's: the gradients
            # are summed across replicas.
            loss = tf.nn.compute_average_loss(
                per_sample, global_batch_size=tf.shape(per_sample)[0]
                * strategy.num_replicas_in_sync)
        grads = tape.gradient(loss, loop_model.trainable_variables)
        optimizer.apply(grads, loop_model.trainable_variables)
        return loss

    losses = strategy.run(step, args=batch)
    return strategy.reduce("SUM", losses, axis=None)


distributed = strategy.experimental_distribute_dataset(dataset)
# Ctrl-C: one line, exit code 130; the loop reports its own progress.
with stops_cleanly() as progress:
    for epoch in range(epochs):
        progress.epoch_begin(epoch)
        for step, batch in enumerate(distributed):
            loss = train_step(batch)
            progress.batch_end(step)
        progress.epoch_end(epoch)
print(f"custom loop: last batch loss {float(loss):.4f}")

# --- The same with fit --------------------------------------------------------
with strategy.scope():
    fit_model = build()
    fit_model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
# shuffle=False: the dataset's own order, as the loop saw it (fit's default
# shuffle=True does not apply to a dataset; Keras 3.15 warns it is ignored).
with stops_cleanly(announce=False) as progress:
    fit_model.fit(dataset, epochs=epochs, verbose=0, shuffle=False,
                  callbacks=[progress.callback()])
difference = max(float(np.abs(a - b).max()) for a, b in
                 zip(loop_model.get_weights(), fit_model.get_weights()))
print(f"fit: same weights as the loop within {difference:.1e}")
assert difference < 1e-5
