"""Gradient accumulation: a 4x larger logical batch inside plain `fit`.

    python examples/accumulation.py [--smoke]

Each optimizer step averages 4 micro-batches of 32 per replica, exactly as one
step on the big batch would, with one all-reduce per step.
"""

# _common first: it quiets TensorFlow's start-up logs.
from _common import digits, parse_args, workdir
from _interrupt import stops_cleanly

import keras_mgpu  # noqa: E402

strategy = keras_mgpu.auto_strategy(virtual_cpus=2)  # first: it sets devices

import keras  # noqa: E402


args = parse_args(__doc__.splitlines()[0])
(x, y), (x_test, y_test) = digits()
with strategy.scope():
    inner = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model = keras_mgpu.GradientAccumulationModel(inner, accum_steps=4)
    model.compile(keras.optimizers.Adam(3e-3),
                  "sparse_categorical_crossentropy", metrics=["accuracy"])

micro_batch = keras_mgpu.global_batch_size(32, strategy)
with stops_cleanly() as progress:  # Ctrl-C: one line, exit code 130
    model.fit(x, y, batch_size=micro_batch, epochs=2 if args.smoke else 20,
              verbose=0, callbacks=[progress.callback()])
print(f"micro-batches per epoch: {-(-len(x) // micro_batch)}, "
      f"optimizer steps in all: {int(model.optimizer.iterations.numpy())}")
print(f"last gradient norm: {model.grad_norm:.3f}")
print(f"test accuracy: {model.evaluate(x_test, y_test, verbose=0)[1]:.3f}")
# Export the plain model, without the wrapper.
path = f"{workdir(args.workdir, 'accumulation')}/digits.keras"
model.inner.save(path)
print(f"inner model saved to {path}")
