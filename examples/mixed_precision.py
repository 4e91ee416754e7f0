"""Mixed precision with a float32 output head, an audit and loss-scale telemetry.

    python examples/mixed_precision.py [--smoke]

On a GPU, `set_policy("auto")` picks bfloat16 or float16; on a CPU this
example forces mixed_float16 to show the mechanics (it is slower there).
"""

# _common first: it quiets TensorFlow's start-up logs.
from _common import digits, parse_args
from _interrupt import stops_cleanly

import keras_mgpu  # noqa: E402

strategy = keras_mgpu.auto_strategy(virtual_cpus=2)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_mgpu import mixed_precision  # noqa: E402
from keras_mgpu.layers import FP32OutputHead  # noqa: E402

args = parse_args(__doc__.splitlines()[0])
gpu = bool(tf.config.list_physical_devices("GPU"))
policy = mixed_precision.set_policy("auto" if gpu else "mixed_float16",
                                    verbose=True)
(x, y), (x_test, y_test) = digits()
with strategy.scope():
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        FP32OutputHead(10, activation="softmax", name="head"),
    ])
    model.compile(keras.optimizers.Adam(3e-3),
                  "sparse_categorical_crossentropy", metrics=["accuracy"])

findings = mixed_precision.audit(model)
print(f"policy {policy}; audit findings: {findings or 'none'}")
monitor = mixed_precision.LossScaleMonitor(min_scale=1.0)
with stops_cleanly() as progress:  # Ctrl-C: one line, exit code 130
    history = model.fit(x, y, batch_size=64, epochs=2 if args.smoke else 15,
                        verbose=0, callbacks=[monitor, progress.callback()])
print("output dtype:", model.outputs[0].dtype)
print("loss scale:", history.history.get("loss_scale", ["n/a"])[-1],
      "skipped steps:", history.history.get("skipped_steps_total", [0])[-1])
print("non-finite head inputs:",
      model.get_layer("head").nonfinite_counts["inputs"])
print(f"test accuracy: {model.evaluate(x_test, y_test, verbose=0)[1]:.3f}")
