"""keras_mgpu.mixed_precision: policy choice, audit, what the progress bar shows.

LossScaleMonitor has its own file, tests/test_loss_scale_monitor.py.
"""

import keras
import numpy as np
import pytest

from keras_mgpu import GradientAccumulationModel
from keras_mgpu import mixed_precision
from keras_mgpu.layers import FP32OutputHead
from keras_mgpu.mixed_precision import LossScaleMonitor, audit


# --- set_policy ---------------------------------------------------------------


@pytest.mark.parametrize("capabilities,expected", [
    ([], "float32"),
    ([(9, 0)], "mixed_bfloat16"),
    ([(8, 0), (8, 6)], "mixed_bfloat16"),
    ([(8, 0), (7, 5)], "mixed_float16"),  # the weakest GPU decides
    ([(7, 0)], "mixed_float16"),
    ([(6, 1)], "float32"),
    ([(8, 0), None], "float32"),
])
def test_choose_policy(capabilities, expected):
    chosen, reason = mixed_precision.choose_policy(capabilities)
    assert chosen == expected
    assert reason


def test_set_policy_auto_on_cpu_is_float32(reset_policy, capsys):
    keras.mixed_precision.set_global_policy("mixed_float16")
    assert mixed_precision.set_policy("auto", verbose=True) == "float32"
    assert keras.mixed_precision.global_policy().name == "float32"
    assert "no GPU" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["float32", "mixed_float16",
                                  "mixed_bfloat16"])
def test_set_policy_explicit(reset_policy, name):
    assert mixed_precision.set_policy(name) == name
    assert keras.mixed_precision.global_policy().name == name


def test_set_policy_rejects_bad_names(reset_policy):
    with pytest.raises(ValueError, match="mixed_bfloat16"):
        mixed_precision.set_policy("mixed_float8")


# --- audit --------------------------------------------------------------------


def problems(findings):
    return [f.problem for f in findings]


@pytest.mark.parametrize("policy", ["float32", "mixed_float16",
                                    "mixed_bfloat16"], indirect=True)
def test_clean_models_have_no_findings(policy):
    def build():
        return keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.LayerNormalization(),
            FP32OutputHead(3, activation="softmax"),
        ])

    model = build()
    assert audit(model) == []
    model.compile("adam", "sparse_categorical_crossentropy")
    assert audit(model, strict=True) == []
    wrapped = GradientAccumulationModel(build(), accum_steps=2)
    wrapped.compile("adam", "sparse_categorical_crossentropy")
    assert audit(wrapped) == []


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_clean_recommended_pattern_float32_activation_layer(policy):
    """Dense in float16, then Activation("softmax", dtype="float32")."""
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(3),
        keras.layers.Activation("softmax", dtype="float32"),
    ])
    model.compile("adam", "categorical_crossentropy")
    assert audit(model) == []


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"],
                         indirect=True)
def test_finds_half_precision_output(policy):
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(2, name="last")])
    findings = audit(model)
    assert len(findings) == 1
    assert findings[0].layer == "last"
    assert findings[0].problem.startswith(
        f"output is {policy.split('_')[1]}, not float32")
    assert "FP32OutputHead" in findings[0].fix


@pytest.mark.parametrize("policy", ["mixed_bfloat16"], indirect=True)
@pytest.mark.parametrize("activation", ["softmax", "sigmoid", "exponential",
                                        "log_softmax"])
def test_finds_sensitive_activation_in_half_precision(policy, activation):
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(4, activation=activation, name="act"),
        keras.layers.Dense(2, dtype="float32"),
    ])
    assert problems(audit(model)) == [
        f"{activation} computed in bfloat16: it saturates or overflows in "
        "half precision"]


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_finds_loss_fed_half_precision_probabilities(policy):
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(3, activation="softmax", name="probs"),
    ])
    model.compile("adam", keras.losses.CategoricalCrossentropy())
    found = [f for f in audit(model) if f.problem.startswith("loss gets")]
    assert len(found) == 1 and found[0].layer == "probs"
    # from_logits=True means the user already feeds logits: not this finding.
    model.compile("adam", keras.losses.CategoricalCrossentropy(
        from_logits=True))
    assert not [f for f in audit(model) if f.problem.startswith("loss gets")]
    # Uncompiled: nothing to say about the loss.
    fresh = keras.Sequential([keras.Input((8,)), keras.layers.Dense(
        1, activation="sigmoid")])
    assert not [f for f in audit(fresh) if f.problem.startswith("loss gets")]
    fresh.compile("adam", "binary_crossentropy")
    assert [f for f in audit(fresh) if f.problem.startswith("loss gets")]


def test_finds_float16_without_loss_scale_optimizer():
    # Per-layer float16 policies under a float32 global policy: compile does
    # not wrap the optimizer, since the model's own policy is float32.
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, dtype="mixed_float16"),
        keras.layers.Dense(1, dtype="float32", name="out"),
    ])
    model.compile("sgd", "mse")
    findings = audit(model)
    assert len(findings) == 1
    assert "not a LossScaleOptimizer" in findings[0].problem
    model.compile(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD()), "mse")
    assert audit(model) == []


class Float32Scale(keras.layers.Layer):
    """A custom layer that pins a float32 variable in its float16 path."""

    def __init__(self, autocast_variable=False, **kwargs):
        super().__init__(**kwargs)
        self.autocast_variable = autocast_variable

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), dtype="float32",
                                     initializer="ones",
                                     autocast=self.autocast_variable)

    def call(self, x):
        return keras.ops.cast(x, "float32") * self.scale


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_finds_custom_layer_with_float32_variables(policy):
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(4),
        Float32Scale(name="pinned"),
        keras.layers.Dense(1, dtype="float32"),
    ])
    findings = audit(model)
    assert [f.layer for f in findings] == ["pinned"]
    assert "reads float32 variables without autocast" in findings[0].problem
    model.compile(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD()), "mse")
    with pytest.raises(ValueError, match="pinned"):
        audit(model, strict=True)
    # The same layer letting Keras autocast its variable is fine.
    fine = keras.Sequential([keras.Input((8,)),
                             Float32Scale(autocast_variable=True),
                             keras.layers.Dense(1, dtype="float32")])
    assert audit(fine) == []


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_strict_lists_every_finding(policy):
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(3, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy")
    with pytest.raises(ValueError) as error:
        audit(model, strict=True)
    assert "3 problem(s)" in str(error.value)


# --- What keras-mgpu adds to Keras's progress bar -------------------------------


LOSS_SCALE_KEYS = ["loss_scale", "skipped_steps", "skipped_steps_total"]


def progress_bar_keys(out: str) -> set:
    """The `name:` fields Keras's progress bar printed."""
    import re

    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    return set(re.findall(r" - ([A-Za-z_][\w/]*): ", plain))


@pytest.mark.parametrize("policy, extra", [
    ("float32", []),
    ("mixed_bfloat16", []),  # half precision without a loss scale
    ("mixed_float16", LOSS_SCALE_KEYS),  # compile adds a LossScaleOptimizer
], indirect=["policy"], ids=["float32", "mixed_bfloat16", "mixed_float16"])
def test_progress_bar_shows_only_what_the_run_has(policy, extra, capsys,
                                                  tmp_path):
    from keras_mgpu.callbacks import DistributedLogger

    rng = np.random.RandomState(0)
    x = rng.randn(32, 4).astype("float32")
    y = (np.arange(32) % 3).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                              FP32OutputHead(3, activation="softmax",
                                             name="head")])
    model.compile("adam", "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer) \
        == bool(extra)
    capsys.readouterr()
    history = model.fit(
        x, y, batch_size=8, epochs=2, verbose=1, validation_data=(x, y),
        callbacks=[LossScaleMonitor(),
                   DistributedLogger(tmp_path, update_freq=2, console=False)])
    out = capsys.readouterr().out
    keras_keys = ["accuracy", "loss", "val_accuracy", "val_loss"]
    assert sorted(history.history) == sorted(keras_keys + extra)
    assert progress_bar_keys(out) == set(keras_keys + extra)
    if extra:
        assert history.history["skipped_steps_total"] == [0, 0]
        assert history.history["loss_scale"] == [2.0 ** 15] * 2
    # Nothing was non-finite, and the head counted nothing.
    assert model.get_layer("head").nonfinite_counts == \
        {"inputs": 0, "outputs": 0}
