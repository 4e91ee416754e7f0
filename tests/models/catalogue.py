"""The models users train, built from constructor arguments at test size
(no download): keras-hub transformers and keras.applications convnets.

Each `Entry` builds its model with a given head, makes seeded data for it
and says what sets it apart (sparse embedding gradients on TensorFlow,
BatchNormalization). Used by the model matrix (`tests/models/`) and by
`benchmarks/model_overhead.py`; it imports no test fixture, so a benchmark
can import it without configuring devices.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import keras
import numpy as np

from keras_mgpu import compat

SEQUENCE = 8
VOCABULARY = 64
IMAGE = (32, 32, 3)
CLASSES = 10


def dense_head(units: int):
    """The default head: logits, for a `from_logits=True` loss."""
    return keras.layers.Dense(units, name="head")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One model of the matrix.

    Args:
        name: The matrix's name for it.
        family: `"transformer"` or `"convnet"`.
        make: `make(head)` builds the model, its last layer `head(units)`.
        units: The head's outputs.
        token_inputs: Whether inputs are token ids (a dict of arrays).
        batch_norm: Whether it has BatchNormalization.
    """

    name: str
    family: str
    make: Callable
    units: int
    token_inputs: bool
    batch_norm: bool

    def build(self, head: Callable = dense_head, seed: int = 0):
        keras.utils.set_random_seed(seed)
        model = self.make(head)
        for layer in compat.sublayers(model):
            # Dropout 0 (EfficientNetV2's stochastic depth is Dropout too):
            # a micro-batch then computes what the big batch does.
            if isinstance(layer, keras.layers.Dropout):
                layer.rate = 0.0
        return model

    def data(self, samples: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        if self.token_inputs:
            tokens = rng.integers(1, VOCABULARY, (samples, SEQUENCE + 1))
            x = {"token_ids": tokens[:, :-1].astype("int32"),
                 "padding_mask": np.ones((samples, SEQUENCE), "int32")}
            if self.name == "bert":
                x["segment_ids"] = np.zeros((samples, SEQUENCE), "int32")
                y = (tokens[:, 0] % self.units).astype("int32")
            else:
                y = tokens[:, 1:].astype("int32")  # the next token
            return x, y
        x = rng.uniform(0, 255, (samples,) + IMAGE).astype("float32")
        y = rng.integers(0, self.units, (samples,)).astype("int32")
        return x, y


def _token_inputs(names):
    return {name: keras.Input((SEQUENCE,), dtype="int32", name=name)
            for name in names}


def _causal_lm(backbone_class, **kwargs):
    def make(head):
        inputs = _token_inputs(("token_ids", "padding_mask"))
        backbone = backbone_class(vocabulary_size=VOCABULARY,
                                  dropout=0.0, **kwargs)
        return keras.Model(inputs, head(VOCABULARY)(backbone(inputs)))
    return make


def _gpt2(head):
    import keras_hub

    return _causal_lm(keras_hub.models.GPT2Backbone, num_layers=2,
                      num_heads=2, hidden_dim=16, intermediate_dim=32,
                      max_sequence_length=SEQUENCE)(head)


def _llama(head):
    import keras_hub

    return _causal_lm(keras_hub.models.LlamaBackbone, num_layers=2,
                      num_query_heads=2, num_key_value_heads=1,
                      hidden_dim=16, intermediate_dim=32)(head)


def _bert(head):
    import keras_hub

    inputs = _token_inputs(("token_ids", "segment_ids", "padding_mask"))
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, dropout=0.0, max_sequence_length=SEQUENCE)
    pooled = backbone(inputs)["pooled_output"]
    return keras.Model(inputs, head(CLASSES)(pooled))


def _application(constructor, **kwargs):
    def make(head):
        base = constructor(include_top=False, weights=None,
                           input_shape=IMAGE, pooling="avg", **kwargs)
        # One input, not a list of one: what a serving signature takes.
        return keras.Model(base.inputs[0], head(CLASSES)(base.outputs[0]))
    return make


def _entries():
    apps = keras.applications
    return [
        Entry("gpt2", "transformer", _gpt2, VOCABULARY, True, False),
        Entry("bert", "transformer", _bert, CLASSES, True, False),
        Entry("llama", "transformer", _llama, VOCABULARY, True, False),
        Entry("resnet50v2", "convnet", _application(apps.ResNet50V2),
              CLASSES, False, True),
        Entry("mobilenetv3small", "convnet",
              _application(apps.MobileNetV3Small), CLASSES, False, True),
        Entry("efficientnetv2b0", "convnet",
              _application(apps.EfficientNetV2B0), CLASSES, False, True),
        Entry("convnexttiny", "convnet", _application(apps.ConvNeXtTiny),
              CLASSES, False, False),
    ]


MODELS = {entry.name: entry for entry in _entries()}
# What `make test` and `.ci/run` run, per Keras backend: one transformer and
# one convnet on TensorFlow; the transformer on JAX, whose XLA build of the
# convnet on a CPU costs more than the rest of the JAX run (its
# BatchNormalization under `DataParallel`: tests/jax/test_jax_batch_norm.py).
# `nox -s models` runs every model on both.
CI_MODELS = {"tensorflow": ("gpt2", "mobilenetv3small"), "jax": ("gpt2",)}
# Of those, the ones whose run's life (test_model_lifecycle.py: the kill and
# resume, saving and exporting, Keras's accumulation under every callback)
# and in-step accumulation `make test` checks: the transformer's. The
# convnet's costs more than the rest of the matrix there, on code paths the
# transformer's take too; `make test-all` (pytest's `exhaustive` marker)
# runs it.
CI_LIFECYCLE_MODELS = {"tensorflow": ("gpt2",), "jax": ("gpt2",)}
# Of those, the ones the kill and resume runs on in `make test`: none on
# JAX, where tests/jax/test_jax_backup.py kills and resumes every
# accumulation mode (the transformer's run: `make test-all`).
CI_KILL_MODELS = {"tensorflow": ("gpt2",), "jax": ()}
