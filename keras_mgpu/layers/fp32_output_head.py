"""`FP32OutputHead`: a final Dense layer whose output is float32 under any policy."""

from __future__ import annotations

import warnings
from typing import Any

import keras
import tensorflow as tf
from keras import ops

from keras_mgpu import compat
from keras_mgpu._checks import is_flag, is_positive_integer

# Activations whose output Keras's cross-entropy losses can map back to the
# logits they came from (softmax -> categorical, sigmoid -> binary).
_LOGIT_ACTIVATIONS = ("softmax", "sigmoid")

# Keys of `Dense.get_config()` that the head sets itself or passes to `Layer`.
_NOT_DENSE_KWARGS = ("name", "units", "activation", "dtype", "trainable")


class _ReplicaSummedCount(keras.metrics.Sum):
    """A `Sum` whose result is the total over all replicas, in every context.

    Metric variables are per-replica (sync on read, summed on read): read
    outside the replica step (a callback, `nonfinite_counts`) the result is
    already the total. Read inside the replica step, where Keras would then
    average it over replicas, it would come out divided by the replica
    count, so the replica-context result is all-reduced first.
    """

    def result(self):
        total = super().result()
        if tf.distribute.in_cross_replica_context():
            return total
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return total
        # A multi-worker all-reduce sends its result to its input's device,
        # which must be named.
        with tf.device(self.variables[0].value.device):
            total = tf.identity(total)
        return context.all_reduce(tf.distribute.ReduceOp.SUM, total)


@keras.saving.register_keras_serializable(package="keras_mgpu")
class FP32OutputHead(keras.layers.Layer):
    """A drop-in final Dense layer that outputs float32 under any dtype policy.

    Under `mixed_float16` or `mixed_bfloat16`, a final
    `Dense(n, activation="softmax")` computes its softmax in half precision
    and the model's output is cast to float32 afterwards, so the loss only
    sees (clipped) probabilities. This head casts the logits to float32
    before the activation and hands them to the loss with its output:
    Keras's cross-entropy losses (categorical, sparse categorical, binary,
    with the default `from_logits=False`, as a name, a class or a function)
    then compute the loss from the float32 logits, while `predict` still
    returns probabilities. How the logits travel depends on the backend,
    not on the user's script: on TensorFlow they are attached to the output
    tensor as the attribute Keras's cross-entropy reads; on JAX, whose
    arrays take no attribute, the head remembers its output object and its
    logits while that object lives, and keras-mgpu wraps Keras's JAX
    cross-entropy functions to compute the loss from the logits when given
    exactly that object (`keras_mgpu.compat.jax_nn`; identity holds under
    `jit`, `grad`, `scan` and `shard_map`, so plain `fit`/`evaluate` and
    `GradientAccumulationModel` in both modes get it). Softmax goes with
    the categorical losses (over the last axis), sigmoid with the binary
    one; an output changed before the loss (squeezed, masked by
    `ignore_class`) gets the probabilities' loss on both backends. Where the
    installed Keras's losses cannot be given the logits, building the head warns and
    `keras_mgpu.mixed_precision.audit` says so.

    It also counts the non-finite values (inf, NaN) of its input and its
    output in every forward pass (`fit`, `evaluate`, `predict`), summed over
    replicas, which tells a forward-pass overflow apart from a gradient
    overflow. The counts are not Keras metrics, so they do not fill `fit`'s
    progress bar and logs with zeros: read them with `nonfinite_counts`
    (totals since the head was created or loaded: they are not saved;
    exact up to 2**24), restart them with `reset_nonfinite_counts()`, or add
    `keras_mgpu.callbacks.LossScaleMonitor` to `fit`, which logs them per
    epoch as `<name>_nonfinite_inputs` and `<name>_nonfinite_outputs` once
    one is non-zero (for a nested model and a
    `keras_mgpu.GradientAccumulationModel` too).

    Args:
        units: Number of outputs (classes, or 1 for a binary head): a
            positive `int` (a NumPy integer too; not a float or a bool).
        activation: Defaults to `None` (linear). Usually `"softmax"`,
            `"sigmoid"` or `None`; computed in float32. Any name, callable or
            serialized activation that `keras.activations.get` accepts.
        float32_matmul: Defaults to `False`. `True` or `False`. If `True`,
            the matmul runs in float32 too (inputs are upcast), so logits
            beyond the float16 range (65504) do not overflow. Costs one
            float32 matmul.
        **dense_kwargs: Passed to the inner `keras.layers.Dense`
            (`use_bias`, `kernel_initializer`, ...) or to `keras.layers.Layer`
            (`name`, `dtype`, `trainable`).

    Example:

    >>> import numpy as np, keras
    >>> from keras_mgpu.layers import FP32OutputHead
    >>> keras.mixed_precision.set_global_policy("mixed_float16")
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
    ...     FP32OutputHead(3, activation="softmax")])
    >>> model.outputs[0].dtype
    'float32'
    >>> model.predict(np.ones((2, 4)), verbose=0).sum(axis=-1).round(3)
    array([1., 1.], dtype=float32)
    >>> # One NaN feature reaches all 8 hidden units, then every output.
    >>> _ = model.predict(np.array([[1.0, np.nan, 0.0, 0.0]]), verbose=0)
    >>> model.layers[-1].nonfinite_counts
    {'inputs': 8, 'outputs': 3}
    >>> keras.mixed_precision.set_global_policy("float32")
    """

    def __init__(
        self,
        units: int,
        activation: Any = None,
        float32_matmul: bool = False,
        **dense_kwargs: Any,
    ):
        # Checked before anything is built: int(2.7) would silently give a
        # 2-class head, and bool("False") a float32 matmul.
        if not is_positive_integer(units):
            raise ValueError(
                f"units must be a positive integer (the number of outputs: "
                f"classes, or 1 for a binary head), got {units!r}. Pass an "
                "int, e.g. FP32OutputHead(10, activation='softmax')."
            )
        if not is_flag(float32_matmul):
            raise TypeError(
                f"float32_matmul must be True or False, got "
                f"{float32_matmul!r} (a non-empty string such as 'false' "
                "would count as True)."
            )
        try:
            activation_fn = keras.activations.get(activation)
        except ValueError:
            raise ValueError(
                f"activation must be the name of a Keras activation (e.g. "
                f"'softmax', 'sigmoid', 'linear'), a callable or None, got "
                f"{activation!r}."
            ) from None
        layer_kwargs = {
            key: dense_kwargs.pop(key)
            for key in ("name", "dtype", "trainable")
            if key in dense_kwargs
        }
        # Inputs are counted as they arrive, before any cast could overflow
        # or hide them; the inner Dense casts them to its own compute dtype.
        dense_kwargs.pop("autocast", None)
        super().__init__(autocast=False, **layer_kwargs)
        self.units = int(units)
        self.activation = activation_fn
        self.float32_matmul = bool(float32_matmul)
        self.dense = keras.layers.Dense(
            self.units,
            dtype="float32" if self.float32_matmul else self.dtype_policy,
            name="dense",
            **dense_kwargs,
        )
        self.nonfinite_inputs = _ReplicaSummedCount(
            name=f"{self.name}_nonfinite_inputs"
        )
        self.nonfinite_outputs = _ReplicaSummedCount(
            name=f"{self.name}_nonfinite_outputs"
        )

    @property
    def metrics(self):
        # The non-finite counters are the head's own state, not metrics of
        # the model: Keras would log (and reset) every metric of its layers
        # at every batch, zeros included.
        counters = (getattr(self, "nonfinite_inputs", None),
                    getattr(self, "nonfinite_outputs", None))
        return [m for m in super().metrics
                if not any(m is counter for counter in counters)]

    @property
    def nonfinite_counts(self) -> dict:
        """Non-finite values seen so far, over all replicas.

        `{"inputs": n, "outputs": n}`: inf and NaN entries of the head's
        inputs and outputs, over every forward pass since the head was
        created or loaded, or since `reset_nonfinite_counts()`. Reading
        them waits for the device; under `MultiWorkerMirroredStrategy` it
        is a collective, for every worker to make.
        """
        return {
            "inputs": int(round(float(self.nonfinite_inputs.result()))),
            "outputs": int(round(float(self.nonfinite_outputs.result()))),
        }

    def reset_nonfinite_counts(self) -> None:
        """Sets both non-finite counts back to 0."""
        self.nonfinite_inputs.reset_state()
        self.nonfinite_outputs.reset_state()

    @property
    def activation_name(self) -> str:
        return getattr(self.activation, "__name__", str(self.activation))

    def build(self, input_shape):
        # On JAX this also wraps Keras's cross-entropy, once, to read the
        # logits `call` hands over.
        problem = (compat.attached_logits_problem()
                   if self.activation_name in _LOGIT_ACTIVATIONS else None)
        if problem is not None:
            warnings.warn(
                f"{problem}: the loss of {self.name!r}, a "
                f"{self.activation_name} output, is computed from clipped "
                "probabilities, not from its float32 logits. Use "
                "activation=None with a from_logits=True loss.",
                compat.UntestedKerasWarning, stacklevel=2)
        self.dense.build(input_shape)
        self.built = True

    def call(self, inputs):
        self.nonfinite_inputs.update_state(_count_nonfinite(inputs))
        logits = ops.cast(self.dense(inputs), "float32")
        outputs = self.activation(logits)
        if self.activation_name in _LOGIT_ACTIVATIONS:
            # On TensorFlow, Keras's softmax/sigmoid attach the logits
            # already; attaching again keeps this true if that ever moves
            # out of the activation. On JAX this is the only way.
            compat.attach_logits(outputs, logits, self.activation_name)
        self.nonfinite_outputs.update_state(_count_nonfinite(outputs))
        return outputs

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.units,)

    def compute_output_spec(self, inputs):
        return keras.KerasTensor(
            self.compute_output_shape(inputs.shape), dtype="float32"
        )

    def get_config(self):
        config = super().get_config()
        dense_config = self.dense.get_config()
        for key in _NOT_DENSE_KWARGS:
            dense_config.pop(key, None)
        config.update(dense_config)
        config.update(
            {
                "units": self.units,
                "activation": keras.activations.serialize(self.activation),
                "float32_matmul": self.float32_matmul,
            }
        )
        return config


def _count_nonfinite(x):
    x = ops.convert_to_tensor(x)
    if not keras.backend.is_float_dtype(x.dtype):
        return ops.zeros((), "float32")
    return ops.sum(ops.cast(ops.logical_not(ops.isfinite(x)), "float32"))
