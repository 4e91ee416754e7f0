"""`model_overhead.py`'s child process: one model's fits on one backend.

The backend is fixed at import, so `model_overhead.py` runs this once per
backend and model (`model_overhead.py --child BACKEND ...` calls `run`).
It trains the model in each configuration, the configurations taking turns
fit by fit, and appends JSON lines to the progress file: one before each
fit (so that the parent knows where a child that died was), the result
last. Standard library only at import: Keras and the backend load inside
`run`, after the parent has set the environment.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The configurations; the parent's ratios and table name them too.
PLAIN, LOGGER, BACKUP, BOTH, IN_ORDER = (
    "plain", "DistributedLogger", "BackupAndRestore", "both", "in-order")
CONFIGS = (PLAIN, LOGGER, BACKUP, BOTH, IN_ORDER)
# What `_time_hooks` times, where a callback overrides it.
_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
          "on_train_batch_begin", "on_train_batch_end", "on_batch_begin",
          "on_batch_end")


def _scope(backend: str):
    """2 replicas: the scope to build and train in."""
    if backend == "tensorflow":
        import keras_mgpu

        return keras_mgpu.auto_strategy(virtual_cpus=2).scope
    import jax
    import keras

    if len(jax.devices()) < 2:
        raise SystemExit(f"JAX sees {jax.devices()}: set XLA_FLAGS first")
    return keras.distribution.DataParallel(devices=jax.devices()[:2]).scope


def _callbacks(config: str, root: str, freq: int) -> list:
    import keras

    from keras_mgpu.callbacks import BackupAndRestore, DistributedLogger

    callbacks = []
    if config in (LOGGER, BOTH):
        callbacks.append(DistributedLogger(os.path.join(root, "logs"),
                                           update_freq=freq, console=False))
    if config in (BACKUP, BOTH):
        callbacks.append(BackupAndRestore(os.path.join(root, "backup"),
                                          save_freq=freq))
    if config == IN_ORDER:
        callbacks.append(keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: None))
    return callbacks


def _time_hooks(callback, spent: dict) -> None:
    """Adds the seconds `callback`'s own hooks take on the training thread
    to `spent[hook]`; only the hooks it overrides are wrapped."""
    import keras

    main = threading.main_thread()
    for name in _HOOKS:
        if getattr(type(callback), name) is getattr(keras.callbacks.Callback,
                                                    name):
            continue

        @functools.wraps(getattr(callback, name))
        def timed(*args, _method=getattr(callback, name), _name=name,
                  **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                if threading.current_thread() is main:
                    spent[_name] = (spent.get(_name, 0.0)
                                    + time.perf_counter() - start)

        setattr(callback, name, timed)


def run(args) -> None:
    """Measures one model on this process's backend. Appends JSON lines to
    `args.progress`: one before each fit, the result last."""
    sys.path.insert(0, ROOT)
    scope = _scope(args.child)
    import importlib.metadata

    import keras

    from tests.models.catalogue import MODELS

    def note(**record):
        with open(args.progress, "a") as f:
            f.write(json.dumps(record) + "\n")

    entry = MODELS[args.models]
    configs = args.configs.split(",")
    x, y = entry.data(max(args.steps, args.warmup) * args.batch)
    times = {c: [] for c in configs}
    wall_times = {c: [] for c in configs}
    hooks = {c: [] for c in configs}
    # The timed span: from before every other callback's `on_train_begin`
    # to after every other callback's `on_train_end` (no batch hook: the
    # dispatch stays Keras's choice).
    span = {}
    first = keras.callbacks.LambdaCallback(
        on_train_begin=lambda logs: span.update(begin=time.perf_counter()))
    last = keras.callbacks.LambdaCallback(
        on_train_end=lambda logs: span.update(end=time.perf_counter()))
    warmup_hooks, kept = {}, {}
    work = tempfile.mkdtemp(prefix="model_overhead_", dir=args.dir)
    try:
        with scope():
            models = {}
            for config in configs:
                models[config] = entry.build(seed=0)
                models[config].compile(
                    keras.optimizers.Adam(1e-3),
                    keras.losses.SparseCategoricalCrossentropy(
                        from_logits=True))
            for round_ in range(-1, args.rounds):  # -1: the warm-up
                n = (args.warmup if round_ < 0 else args.steps) * args.batch
                shift = max(round_, 0) % len(configs)
                for config in configs[shift:] + configs[:shift]:
                    root = os.path.join(work, f"{config}_{round_}"
                                        if args.fresh_callbacks else config)
                    if args.fresh_callbacks or config not in kept:
                        kept[config] = (_callbacks(config, root, args.freq),
                                        {})
                        for callback in kept[config][0]:
                            _time_hooks(callback, kept[config][1])
                    callbacks, spent = kept[config]
                    spent.clear()
                    note(fit=config, round=round_)
                    start = time.perf_counter()
                    models[config].fit(
                        keras.tree.map_structure(lambda a: a[:n], x), y[:n],
                        batch_size=args.batch, epochs=1, shuffle=False,
                        verbose=0, callbacks=[first, *callbacks, last])
                    wall = time.perf_counter() - start
                    seconds = span["end"] - span["begin"]
                    if args.fresh_callbacks:
                        shutil.rmtree(root, ignore_errors=True)
                    if round_ >= 0:
                        times[config].append(seconds)
                        wall_times[config].append(wall)
                        hooks[config].append(dict(spent))
                    else:
                        warmup_hooks[config] = dict(spent)
                if round_ >= 0:
                    print(f"  {args.child} {entry.name} round {round_ + 1}: "
                          + ", ".join(f"{c} {times[c][-1]:.2f} s"
                                      for c in configs), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    versions = {p: importlib.metadata.version(p) for p in (
        "keras", "keras-hub",
        "tensorflow" if args.child == "tensorflow" else "jax")}
    note(result={"times": times, "wall_times": wall_times, "hooks": hooks,
                 "family": entry.family,
                 "warmup_hooks": warmup_hooks,
                 "versions": versions,
                 "params": int(models[configs[0]].count_params())})
