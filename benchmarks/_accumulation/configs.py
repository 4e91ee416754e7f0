"""The configurations the accumulation benchmark compares, and its targets.

How each configuration wraps and compiles a model (`make_config`), the
labels its tables and JSON use, and issue #20's targets for in-step mode.
"""

from __future__ import annotations

from typing import Callable

import keras_mgpu  # sets KERAS_BACKEND before keras loads

import keras

MODELS = ("mlp", "convnet")
PLAIN = "plain fit"
BUILTIN = "keras built-in"
# Window mode keeps the label of the runs before in-step mode existed, so
# their JSON and the docs' tables still line up with this one's.
WRAPPER = "GradientAccumulationModel"
IN_STEP = "GradientAccumulationModel in_step"
IN_STEP_XLA = "GradientAccumulationModel in_step+XLA"
IN_STEP_CONFIGS = (IN_STEP, IN_STEP_XLA)
DESCRIPTIONS = {
    PLAIN: "plain fit, one optimizer step per micro-batch",
    BUILTIN: "Adam(gradient_accumulation_steps=N), data batched to the "
             "micro-batch (1 replica only)",
    WRAPPER: "GradientAccumulationModel(accum_steps=N), mode='window': data "
             "batched to the micro-batch, one fit step per micro-batch",
    IN_STEP: "GradientAccumulationModel(accum_steps=N, mode='in_step'): data "
             "batched to N x the micro-batch, one fit step per optimizer "
             "step",
    IN_STEP_XLA: "the same, compiled with jit_compile=True (XLA compiles "
                 "the replica-local micro-batch loop only)",
}
NUM_CLASSES = 10
LEARNING_RATE = 1e-3
SEED = 0
# Issue #20's targets for in-step mode, time per micro-batch.
IN_STEP_VS_BUILTIN_TARGET = 0.85   # 1 replica, against Keras's built-in
IN_STEP_VS_WINDOW_TARGET = 0.90    # several replicas, against window mode
IN_STEP_VS_WINDOW_MEMORY_TARGET = 1.5   # peak memory


def make_config(
    inner: keras.Model, config: str, accum_steps: int, loss: keras.losses.Loss
) -> keras.Model:
    """Wraps (or not) and compiles `inner` as `config` trains it."""
    if config == BUILTIN:
        optimizer = keras.optimizers.Adam(
            LEARNING_RATE, gradient_accumulation_steps=accum_steps
        )
    else:
        optimizer = keras.optimizers.Adam(LEARNING_RATE)
    if config == WRAPPER:
        model = keras_mgpu.GradientAccumulationModel(
            inner, accum_steps=accum_steps)
    elif config in IN_STEP_CONFIGS:
        model = keras_mgpu.GradientAccumulationModel(
            inner, accum_steps=accum_steps, mode="in_step")
    else:
        model = inner
    # XLA off except for in-step+XLA: Keras's "auto" already turns it off on
    # CPU and under tf.distribute; pinning it keeps GPU runs comparable too.
    # The in-step wrapper compiles only its replica-local loop with XLA.
    model.compile(optimizer=optimizer, loss=loss,
                  jit_compile=config == IN_STEP_XLA)
    return model


def short_label(config: str) -> str:
    """The in-step configurations' labels in the ratio lines."""
    return {IN_STEP: "in_step", IN_STEP_XLA: "in_step+XLA"}.get(config, config)


def ratio_lines(title: str, ratios: list[dict],
                label: Callable[[dict], str], missing: str) -> list[str]:
    """One comparison of the report: its title, then a line per ratio with
    its verdict against the target, or `missing` when none was measured."""
    lines = [title]
    for r in ratios:
        verdict = "met" if r["met"] else "NOT met"
        lines.append(f"    {label(r)}: {r['ratio']:.2f}  {verdict}")
    return lines + ([] if ratios else [f"    {missing}"])
