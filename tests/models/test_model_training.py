"""The tested-models matrix, training maths: keras-hub transformers and
keras.applications convnets (tests/models/catalogue.py) on the active
backend, 2 replicas (`MirroredStrategy` over 2 logical CPUs on TensorFlow,
`DataParallel` over 2 host devices on JAX): both accumulation modes
against the reference docs/accumulation.md states; the float32 head's loss
from float32 logits under both half-precision policies, and the audit;
clipping of sparse embedding gradients. (The run's life around it:
test_model_lifecycle.py.)
"""

import contextlib

import keras
import numpy as np
import pytest

from keras_mgpu import GradientAccumulationModel, mixed_precision
from keras_mgpu.layers import FP32OutputHead
from tests.models.catalogue import MODELS
from tests.models.matrix import (
    ACCUM, BACKEND, MICRO, MODE_PARAMS, MODEL_PARAMS, SAMPLES, crossentropy, fit,
    max_diff, record, reference_order, subset)


# --- accumulation ------------------------------------------------------------


@pytest.mark.parametrize("name, mode", MODE_PARAMS)
def test_accumulation_meets_the_reference(two_replicas, float64, name, mode):
    """Without BatchNormalization: the big-batch step on one device.
    With it, plain `fit` at the micro-batch size with its updates summed
    into one per window (Keras's own `gradient_accumulation_steps`): on
    TensorFlow each replica normalises its share of the micro-batch (one
    device at the per-replica micro-batch, trainable weights compared:
    each replica keeps moving statistics of its own, as under stock
    Keras, which one device cannot reproduce); on JAX the global
    micro-batch (under the same distribution, every weight compared).

    In float64 (the fixture): the convnets' last blocks normalise 4
    samples at 1x1, which amplifies float32 rounding past what the check
    could tell from a bug. EfficientNetV2B0 on TensorFlow, one window of
    plain SGD at 1e-3: in-step mode (a loop TensorFlow compiles with other
    kernels) ends 3.6e-4 from the reference in float32, on one device too;
    in float64 2e-16. ResNet50V2 on JAX with BatchNormalization in
    float32: its first convolution moves 1% differently after one step
    at 1e-4; in float64 2e-15."""
    entry = MODELS[name]
    x, y = entry.data(SAMPLES)
    if not entry.token_inputs:
        x = x.astype("float64")
    # SGD with momentum: linear in the gradient, so summing in another
    # order stays at rounding level (Adam divides a near-zero gradient
    # component by its own magnitude, a step of up to the learning rate
    # whose sign is rounding noise).
    sgd = lambda steps=None: keras.optimizers.SGD(  # noqa: E731
        0.05, momentum=0.9, gradient_accumulation_steps=steps)
    model = fit(entry, two_replicas,
                MICRO if mode == "window" else MICRO * ACCUM, x, y, sgd,
                wrap=lambda m: GradientAccumulationModel(
                    m, accum_steps=ACCUM, mode=mode))
    compared = model.get_weights()
    if not entry.batch_norm:
        reference = fit(entry, contextlib.nullcontext, MICRO * ACCUM, x, y,
                        sgd).get_weights()
    elif BACKEND == "tensorflow":
        replicas = 2
        reference = fit(entry, contextlib.nullcontext, MICRO // replicas, x,
                        y, lambda: sgd(ACCUM * replicas))
        trainable = {id(v) for v in reference.trainable_variables}
        keep = [id(v) in trainable for v in reference.weights]
        reference = [w for w, k in zip(reference.get_weights(), keep) if k]
        compared = [w for w, k in zip(compared, keep) if k]
    else:
        if mode == "in_step":
            order = np.concatenate([
                start + reference_order(MICRO * ACCUM, 2, ACCUM, MICRO)
                for start in range(0, SAMPLES, MICRO * ACCUM)])
            x, y = subset(x, order), y[order]
        reference = fit(entry, two_replicas, MICRO, x, y,
                        lambda: sgd(ACCUM)).get_weights()
    diff = max_diff(compared, reference)
    record(name, f"accumulation_{mode}", max_abs_diff=diff)
    # Float64's rounding, amplified where BatchNormalization normalises 4
    # or 8 samples at 1x1: ResNet50V2's in-step mode ends 4e-8 away on
    # both backends. keras-hub's Llama computes its RMS norm in float32
    # (1.5e-9 on JAX). Normalising over other samples is far off: 0.69 on
    # MobileNetV3Small with each JAX device's share instead of the global
    # micro-batch.
    assert diff < (1e-6 if entry.batch_norm else 1e-8)


# --- the float32 head ----------------------------------------------------------


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"],
                         indirect=True)
@pytest.mark.parametrize("name", MODEL_PARAMS)
def test_the_float32_head_reaches_the_loss(two_replicas, name, policy):
    """`FP32OutputHead(activation="softmax")` with Keras's default
    `from_logits=False` loss: the loss is the cross-entropy of the head's
    float32 logits, also where the true class's probability underflows
    (the clipped-probability loss would cap each term at 16.1); the audit
    finds nothing wrong with the output or the loss. The same model with a
    half-precision softmax Dense is flagged."""
    entry = MODELS[name]
    x, y = entry.data(MICRO)
    with two_replicas():
        model = entry.build(lambda units: FP32OutputHead(
            units, activation="softmax", name="head"))
        model.compile("sgd", crossentropy(from_logits=False))
        head = model.get_layer("head")
        # The head's inputs of a training step (an untrained deep convnet's
        # vanish at inference: BatchNormalization's statistics are new).
        features = keras.ops.convert_to_numpy(keras.Model(
            model.inputs, head.input)(x, training=True)).astype("float32")
        kernel, bias = head.get_weights()
        # Logits up to about 2000: most probabilities underflow float32.
        scale = 2000.0 / max(float(np.abs(features @ kernel).max()), 1e-30)
        head.set_weights([kernel * scale, bias])
        y_pred = model(x, training=True)
    # Outside the scope: inside, Keras divides the loss by the replicas.
    loss = float(keras.ops.convert_to_numpy(model.compute_loss(
        x=x, y=y, y_pred=y_pred)))
    findings = mixed_precision.audit(model)
    logits = features @ (kernel * scale) + bias
    expected = float(np.mean(keras.ops.convert_to_numpy(
        keras.losses.sparse_categorical_crossentropy(
            y, logits, from_logits=True))))
    record(name, f"fp32_head_{policy}", loss=loss, expected=expected)
    assert expected > 100  # far past what clipped probabilities give
    # The head's matmul runs in half precision: its logits differ from
    # the float32 product by the inputs' rounding.
    assert loss == pytest.approx(expected, rel=2e-2)
    # Nothing about the output or the loss (a transformer's attention
    # softmax, computed in half precision, is a finding of its own).
    assert [f for f in findings if "clips probabilities" in f.problem
            or f.problem.startswith("output is")] == []
    with two_replicas():
        flagged = entry.build(lambda units: keras.layers.Dense(
            units, activation="softmax", name="head"))
        flagged.compile("sgd", crossentropy(from_logits=False))
    problems = [f.problem for f in mixed_precision.audit(flagged)]
    assert any("clips probabilities" in p for p in problems), problems


# --- clipping --------------------------------------------------------------


# Each kind of clipping has its own test on sparse gradients of small
# models (tests/test_sparse_clipping.py); here a real model's embedding,
# under the global norm by default (the others with `make test-all`). On
# JAX, whose embedding gradients are dense, with `make test-all` only:
# tests/backends/test_backend_accumulation.py checks both modes' clipped
# dense gradients against one device's step on either backend.
_DENSE_ON_JAX = (pytest.mark.exhaustive,) if BACKEND == "jax" else ()


@pytest.mark.parametrize("clip", [
    pytest.param({"clipnorm": 0.05}, marks=pytest.mark.exhaustive),
    pytest.param({"clipvalue": 0.002}, marks=pytest.mark.exhaustive),
    {"global_clipnorm": 0.05}], ids=lambda c: next(iter(c)))
@pytest.mark.parametrize("name", [
    pytest.param(*p.values, marks=(*p.marks, *_DENSE_ON_JAX))
    for p in MODEL_PARAMS if MODELS[p.values[0]].token_inputs])
def test_clipping_sparse_gradients_equals_the_dense_reference(
        two_replicas, name, clip):
    """The token embedding's gradient is sparse on TensorFlow, one row per
    token occurrence: plain `fit` (keras-mgpu's exact clipping, applied
    by the fixture's strategy) and both accumulation modes clip the dense
    gradient, as one device with a dense gradient does (the in-step
    window here holds one micro-batch, so all three take the same
    steps)."""
    from keras_mgpu import compat

    if BACKEND == "tensorflow":
        compat.enable_exact_clipping()
    entry = MODELS[name]
    x, y = entry.data(SAMPLES)
    sgd = lambda: keras.optimizers.SGD(0.5, momentum=0.9, **clip)  # noqa
    plain = fit(entry, two_replicas, MICRO, x, y, sgd).get_weights()
    window = fit(entry, two_replicas, MICRO, x, y, sgd,
                 wrap=lambda m: GradientAccumulationModel(m, accum_steps=1))
    in_step = fit(entry, two_replicas, MICRO, x, y, sgd,
                  wrap=lambda m: GradientAccumulationModel(
                      m, accum_steps=1, mode="in_step"))
    diffs = {"plain_vs_window": max_diff(plain, window.get_weights()),
             "in_step_vs_window": max_diff(in_step.get_weights(),
                                           window.get_weights())}
    record(name, f"clipping_{next(iter(clip))}", **diffs)
    assert max(diffs.values()) < 1e-6, diffs
