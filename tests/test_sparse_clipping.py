"""Exact clipping of sparse gradients (issue #43): under
`compat.enable_exact_clipping`, a `tf.IndexedSlices` gradient (a token
embedding's, one row per token occurrence, duplicates included) is clipped
and applied as its dense equivalent, on one replica and under
MirroredStrategy(2), in plain `fit` and in `GradientAccumulationModel`.

The reference every run is held to is a hand loop on one device that makes
every gradient dense (`tf.convert_to_tensor`, which sums duplicate rows)
before `optimizer.apply`: Keras clips a dense gradient right.
"""

import functools

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

from keras_mgpu import GradientAccumulationModel, compat
from tests.conftest import mirrored
from tests.test_accumulation import CountingAllReduce, on_replicas

VOCAB, SEQ, HIDDEN = 64, 8, 8
GLOBAL_BATCH, STEPS = 16, 4
# The token embedding's (sparse) gradient: the shape `CountingAllReduce`
# recognises an all-reduce of the gradients by (statically known, also in a
# traced step, unlike the Dense head's).
EMBEDDING = (VOCAB, HIDDEN)

# Clipping that binds: a batch's gradient has a global norm of about 4 and
# elements up to about 0.4 (the unmerged rows: a norm 0.02 lower, elements
# up to about 0.3). Without the merge, these runs end 2e-4 (Adam,
# global_clipnorm) to 1.6e-1 (SGD, clipvalue) away from the reference.
OPTIMIZERS = {
    "sgd_clipnorm": lambda: keras.optimizers.SGD(
        0.5, momentum=0.9, clipnorm=0.1),
    "sgd_clipvalue": lambda: keras.optimizers.SGD(
        0.5, momentum=0.9, clipvalue=0.02),
    "sgd_global_clipnorm": lambda: keras.optimizers.SGD(
        0.5, momentum=0.9, global_clipnorm=0.1),
    "adam_clipnorm": lambda: keras.optimizers.Adam(0.01, clipnorm=0.1),
    "adam_clipvalue": lambda: keras.optimizers.Adam(0.01, clipvalue=0.02),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(
        0.01, global_clipnorm=0.1),
    # No clipping: Adam's update squares each row (2.4e-3 off unmerged).
    "adam": lambda: keras.optimizers.Adam(0.01),
}
TOLERANCE = 1e-6


@pytest.fixture(autouse=True)
def exact_clipping():
    compat.enable_exact_clipping()
    assert compat.exact_clipping_enabled()


def build_gpt2():
    """The tiny GPT2 backbone (dropout 0) with a Dense next-token head,
    seeded: every call builds the same weights."""
    keras.utils.set_random_seed(43)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=HIDDEN,
        intermediate_dim=16, max_sequence_length=SEQ, dropout=0.0)
    token_ids = keras.Input((SEQ,), dtype="int32", name="token_ids")
    padding_mask = keras.Input((SEQ,), dtype="int32", name="padding_mask")
    hidden = backbone({"token_ids": token_ids, "padding_mask": padding_mask})
    logits = keras.layers.Dense(VOCAB, name="head")(hidden)
    return keras.Model([token_ids, padding_mask], logits)


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@functools.lru_cache(maxsize=None)
def token_data():
    """`STEPS` global batches of next-token pairs: (token ids, padding
    mask) and the ids shifted by one."""
    rng = np.random.default_rng(43)
    tokens = rng.integers(0, VOCAB, size=(GLOBAL_BATCH * STEPS, SEQ + 1))
    tokens = tokens.astype("int32")
    x = (tokens[:, :-1], np.ones((len(tokens), SEQ), "int32"))
    return x, tokens[:, 1:]


def dataset(batch):
    return tf.data.Dataset.from_tensor_slices(token_data()).batch(batch)


def weights_of(model):
    return [v.numpy() for v in model.trainable_variables]


def max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


@functools.lru_cache(maxsize=None)
def dense_reference(name):
    """The weights after `STEPS` steps on one device, each gradient made
    dense before `optimizer.apply` (a hand loop: the trainer's step,
    without its sparse gradient)."""
    model = build_gpt2()
    optimizer = OPTIMIZERS[name]()
    loss = loss_fn()
    for x, y in dataset(GLOBAL_BATCH):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        assert any(isinstance(g, tf.IndexedSlices) for g in grads)
        optimizer.apply([tf.convert_to_tensor(g) for g in grads],
                        model.trainable_variables)
    return weights_of(model)


def plain_fit(strategy, name, **compile_kwargs):
    with strategy.scope():
        model = build_gpt2()
        model.compile(OPTIMIZERS[name](), loss_fn(), **compile_kwargs)
    model.fit(dataset(GLOBAL_BATCH), epochs=1, verbose=0, shuffle=False)
    assert int(model.optimizer.iterations.numpy()) == STEPS
    return model


# Each kind of clipping with one optimizer of each on 2 replicas, and Adam
# unclipped (the rest: `make test-all`).
@pytest.mark.parametrize("name, replicas", on_replicas(
    OPTIMIZERS, (1, 2), "adam_global_clipnorm", "{name}-{replicas}replicas",
    keep=("adam", "adam_clipnorm", "sgd_clipvalue", "sgd_global_clipnorm",
          "adam_global_clipnorm")))
def test_fit_clips_the_sparse_gradient_as_the_dense_one(name, replicas):
    reference = dense_reference(name)
    start = weights_of(build_gpt2())
    assert max_diff(reference, start) > 1e-3
    model = plain_fit(mirrored(replicas), name)
    assert max_diff(weights_of(model), reference) < TOLERANCE


# Each clipping with each optimizer in one mode or the other (and each
# mode with both optimizers): the wrapper accumulates dense gradients, so
# which optimizer clips them matters less here than in plain `fit`, and
# each run costs a trace of the GPT2 step.
ACCUMULATION_CASES = [
    ("sgd_clipnorm", "window"), ("adam_clipnorm", "in_step"),
    ("adam_clipvalue", "window"), ("sgd_clipvalue", "in_step"),
    ("sgd_global_clipnorm", "window"), ("adam_global_clipnorm", "in_step"),
]


@pytest.mark.parametrize("name,mode", ACCUMULATION_CASES)
def test_accumulation_clips_as_the_dense_gradient(name, mode):
    # Window mode: micro-batches of half the global batch; in-step mode:
    # the global batch, split in two inside the step.
    batch = GLOBAL_BATCH // 2 if mode == "window" else GLOBAL_BATCH
    with mirrored(2).scope():
        model = GradientAccumulationModel(build_gpt2(), accum_steps=2,
                                          mode=mode)
        model.compile(OPTIMIZERS[name](), loss_fn())
    model.fit(dataset(batch), epochs=1, verbose=0, shuffle=False)
    assert int(model.optimizer.iterations.numpy()) == STEPS
    assert max_diff(weights_of(model), dense_reference(name)) < TOLERANCE


def test_merging_under_xla_on_one_device():
    # `jit_compile=True` (what "auto" picks on one GPU): the merge's
    # dynamic shapes compile.
    model = plain_fit(mirrored(1), "adam_clipvalue", jit_compile=True)
    assert max_diff(weights_of(model),
                    dense_reference("adam_clipvalue")) < TOLERANCE


@pytest.mark.parametrize("run_eagerly", [True, False])
def test_one_all_reduce_per_step_with_sparse_gradients(run_eagerly):
    # The sparse gradient travels with the dense ones in the all-reduce
    # that comes before clipping, and the merge adds none.
    ops = CountingAllReduce(EMBEDDING)
    cls = type("CountingMirrored", (tf.distribute.MirroredStrategy,),
               {"_collective_key_base": 43_000})
    strategy = cls(["/cpu:0", "/cpu:1"], cross_device_ops=ops)
    model = plain_fit(strategy, "adam_global_clipnorm",
                      run_eagerly=run_eagerly)
    # Eagerly every step runs in Python: the executed all-reduces; traced,
    # the one all-reduce in the graph.
    assert ops.calls == (STEPS if run_eagerly else 1)
    assert max_diff(weights_of(model),
                    dense_reference("adam_global_clipnorm")) < TOLERANCE


def _sparse_gradients():
    model = build_gpt2()
    (x, y), = dataset(GLOBAL_BATCH).take(1)
    with tf.GradientTape() as tape:
        value = loss_fn()(y, model(x, training=True))
    grads = tape.gradient(value, model.trainable_variables)
    embedding = next(i for i, g in enumerate(grads)
                     if isinstance(g, tf.IndexedSlices))
    indices = grads[embedding].indices.numpy()
    assert len(np.unique(indices)) < len(indices)  # duplicate rows
    return grads, embedding


def _clipped(optimizer, grads, exact, monkeypatch):
    """`optimizer`'s clipping of `grads`, made dense, with the fix on or off
    (Keras's own, as if never enabled)."""
    monkeypatch.setattr(compat.optimizer, "_exact_clipping_enabled", exact)
    try:
        clipped = optimizer._clip_gradients(list(grads))
    finally:
        monkeypatch.undo()
    return [tf.convert_to_tensor(g) for g in clipped]


def _global_norm(grads):
    return float(tf.linalg.global_norm(grads))


def test_stock_keras_still_clips_unmerged_rows(monkeypatch):
    """What the sparse part of compat.enable_exact_clipping works around, in
    the installed Keras's own optimizer (the fix off): the clipped sparse
    gradient, made dense, is not clipped to the bound. If this fails, Keras
    merges duplicate rows before clipping, and the merge can go."""
    grads, embedding = _sparse_gradients()
    dense = [tf.convert_to_tensor(g) for g in grads]
    # The norm Keras takes, of the unmerged rows, is not the gradient's.
    values = [g.values if isinstance(g, tf.IndexedSlices) else g
              for g in grads]
    assert abs(_global_norm(values) - _global_norm(dense)) > 1e-2

    bound = 0.1
    cases = {
        "clipnorm": (lambda c: float(tf.norm(c[embedding])),
                     keras.optimizers.SGD(clipnorm=bound)),
        "global_clipnorm": (_global_norm,
                            keras.optimizers.SGD(global_clipnorm=bound)),
        "clipvalue": (lambda c: float(tf.reduce_max(tf.abs(c[embedding]))),
                      keras.optimizers.SGD(clipvalue=0.02)),
    }
    stock, exact = {}, {}
    for kind, (measure, optimizer) in cases.items():
        stock[kind] = measure(_clipped(optimizer, grads, False, monkeypatch))
        exact[kind] = measure(_clipped(optimizer, grads, True, monkeypatch))
    bounds = {"clipnorm": bound, "global_clipnorm": bound, "clipvalue": 0.02}
    for kind, limit in bounds.items():
        assert exact[kind] == pytest.approx(limit, rel=1e-6), kind
        assert abs(stock[kind] - limit) > 1e-4 * limit, (
            f"Keras {keras.__version__} clips the sparse gradient as the "
            f"dense one ({kind}: {stock[kind]!r} for a bound of {limit}): "
            "the merge of duplicate rows in compat.enable_exact_clipping is "
            "no longer needed.")


def test_stock_keras_adam_squares_unmerged_rows(monkeypatch):
    """What the merge before the update works around (the fix off): one
    Adam step on the sparse gradient leaves another second moment than on
    its dense equivalent. If this fails, Keras's Adam merges duplicate rows
    itself, and the merge can go (with the clipping one above)."""
    grads, _ = _sparse_gradients()
    model = build_gpt2()
    velocities = {}
    for kind, given in (("sparse", list(grads)),
                        ("dense", [tf.convert_to_tensor(g) for g in grads])):
        optimizer = keras.optimizers.Adam(0.01)
        optimizer.build(model.trainable_variables)
        monkeypatch.setattr(compat.optimizer, "_exact_clipping_enabled",
                            False)
        try:
            optimizer.apply(given, model.trainable_variables)
        finally:
            monkeypatch.undo()
        # Its moments (the second one differs).
        velocities[kind] = [v.numpy() for v in optimizer.variables]
    assert max_diff(velocities["sparse"], velocities["dense"]) > 1e-6, (f"Keras {keras.__version__}'s Adam updates a sparse "
                 "gradient as its dense equivalent: the merge before the "
                 "update in compat.enable_exact_clipping is no longer "
                 "needed.")
