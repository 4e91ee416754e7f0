"""`StrategyAwareHyperModel`: KerasTuner trials that scale batch and
learning rate to the strategy, with a per-trial backup."""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import keras
import keras_tuner
import tensorflow as tf

from keras_mgpu import compat
from keras_mgpu import data as data_lib
from keras_mgpu import strategy as strategy_lib
from keras_mgpu.callbacks.backup import BackupAndRestore, register_callback_state
from keras_mgpu.tuner.model import (_accum_steps_of, _check_compiled,
                                    _current_learning_rate, _maybe_accumulate,
                                    _overwritten_rate, _set_learning_rate)
from keras_mgpu.tuner.options import (_DEFAULT_BATCH, _PRECISIONS,
                                      ACCUM_STEPS_HP, EFFECTIVE_KEYS,
                                      LEARNING_RATE_HP, LR_SCALING_RULES,
                                      PER_REPLICA_BATCH_HP, PRECISION_HP,
                                      _as_list, _choices, _dataset_batch,
                                      _positive_int)
from keras_mgpu.tuner.trial import _TrialHistory


class StrategyAwareHyperModel(keras_tuner.HyperModel):
    """A `keras_tuner.HyperModel` whose trials scale batch and learning rate.

    The contract with `build_fn(hp)`: it returns a compiled Keras model and
    reads the base learning rate (the rate for one replica's batch, without
    accumulation) as the hyperparameter named `learning_rate_hp`, e.g.
    `hp.Float("learning_rate", 1e-4, 1e-2, sampling="log")`. After
    `build_fn` returns, the hypermodel owns the optimizer's learning rate: it
    sets it to `base * scale` (a float learning rate), or multiplies a
    `LearningRateSchedule` (build the schedule from the base rate) by `scale`.
    `scale` is `ratio` (`"linear"`) or `sqrt(ratio)` (`"sqrt"`) with
    `ratio = effective_batch / reference_batch_size`, where
    `effective_batch = per_replica_batch * replicas * accum_steps`. The
    hyperparameter wins over a fixed rate given to the optimizer: with
    `SGD(0.5)` in `build_fn` and a tuned `learning_rate`, the trial trains
    with `learning_rate * scale`, and the hypermodel warns once (a rate
    left at the optimizer's default is replaced without a warning).

    An existing `keras_tuner.HyperModel` is wrapped as it is: its `build`
    builds, its `declare_hyperparameters` declares its space, and its `fit`
    trains, called with the arguments this hypermodel adjusted (the global
    batch, the re-batched data, the trial's callbacks with the backup).

    To retrain the best trial, build and fit through the hypermodel:
    `tuner.hypermodel.fit(hp, tuner.hypermodel.build(hp), train, ...)`
    under the strategy's scope. A plain `model.fit(train)` on the built model
    trains with the data's own batch and a rate scaled for the trial's.

    Per trial it:

    - declares `per_replica_batch_size` (`hp.Fixed` for an int,
      `hp.Choice` for a list), `accum_steps` and `precision` (`hp.Choice`
      for lists) in `declare_hyperparameters`, so they are in the search
      space before the first trial, or reads `per_replica_batch_size` from
      `hp` when `build_fn` declared it itself; a per-replica batch taken
      from `search` or the data is not a hyperparameter (it is recorded as
      the `effective/per_replica_batch_size` metric);
    - builds under the tuner's `distribution_strategy` (KerasTuner enters its
      scope) with the precision policy set, and wraps the model in
      `keras_mgpu.GradientAccumulationModel` when `accum_steps > 1` (the
      model is rebuilt uncompiled from its `get_config()`, its weights
      copied, and the wrapper compiled with the model's
      `get_compile_config()`);
    - in `fit`, gives Keras the global batch `per_replica * replicas`:
      `tf.data` input (batched, any batch size) is re-batched with
      `keras_mgpu.data.rebatch` (every sample kept, `ceil(samples / global)`
      steps per epoch), numpy input gets `batch_size=global`; a `batch_size`
      passed to `search` is per replica;
    - scales the learning rate in `build` for the strategy in scope, so a
      model rebuilt for a finished trial (`get_best_models()`) is compiled
      with the rate its trial trained with;
    - adds a `keras_mgpu.callbacks.BackupAndRestore` under
      `<project_dir>/trial_<id>/backup/execution_<k>`, so a trial interrupted
      by a killed search resumes from its last backup when the search is
      rerun with `overwrite=False` (KerasTuner itself skips completed trials
      and retries the interrupted one with its hyperparameters; the first
      trial too, as its `fit` saves the tuner's file, which KerasTuner
      reloads from but itself writes only as a trial ends); the resumed
      trial keeps the epochs trained before the kill in its history and
      its best value, so its score, best step and best checkpoint are the
      uninterrupted trial's;
    - adds the `EFFECTIVE_KEYS` metrics to the trial (constant per epoch).

    Args:
        build_fn: `build_fn(hp) -> compiled keras.Model`, or a
            `keras_tuner.HyperModel` whose `build` returns one.
        per_replica_batch_size: Defaults to `None`: the `per_replica_batch_size`
            hyperparameter if `build_fn` declares it, else the `batch_size`
            given to `search`, else the batch size of the `tf.data` input
            (static or not) divided over the replicas, else 32. An int fixes
            it (`hp.Fixed("per_replica_batch_size")`); a list or tuple tunes
            it as `hp.Choice("per_replica_batch_size")`.
        lr_scaling: Defaults to `"linear"`. One of `"linear"`, `"sqrt"` or
            `None` (leave the learning rate as `build_fn` set it).
        reference_batch_size: Defaults to `None`: the per-replica batch, so
            `ratio = replicas * accum_steps` and the base rate is the rate
            for one device. An int: the batch the base rate was tuned for;
            then `build` must know the per-replica batch (given here, or
            declared by `build_fn`).
        learning_rate_hp: Defaults to `"learning_rate"`. Name of the base
            learning-rate hyperparameter.
        accum_steps: Defaults to `None` (no wrapping; a
            `GradientAccumulationModel` returned by `build_fn` is used as it
            is). An int wraps with it; a list tunes it as
            `hp.Choice("accum_steps")`.
        precision: Defaults to `None` (the global policy). A policy name
            (`"float32"`, `"mixed_float16"`, `"mixed_bfloat16"`) or a list of
            them to tune as `hp.Choice("precision")`; set during `build_fn`
            only.
        rebatch: Defaults to `True`. If `False`, `tf.data` input is used as
            batched, and its (static) batch must equal
            `per_replica_batch_size * replicas`.
        backup: Defaults to `"epoch"`. Per-trial backup frequency:
            `"epoch"`, a number of batches, or `False` for none.
        **kwargs: Passed to `keras_tuner.HyperModel` (`name`, `tunable`);
            `name` defaults to a wrapped `HyperModel`'s.

    Example:

    >>> import keras, keras_tuner, numpy as np, tempfile
    >>> from keras_mgpu.tuner import StrategyAwareHyperModel
    >>> def build(hp):
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    ...     model.compile(keras.optimizers.SGD(hp.Float("learning_rate",
    ...                   1e-3, 1e-2)), "mse")
    ...     return model
    >>> hypermodel = StrategyAwareHyperModel(build, per_replica_batch_size=8,
    ...                                      accum_steps=2)
    >>> tuner = keras_tuner.RandomSearch(hypermodel, objective="loss",
    ...     max_trials=1, directory=tempfile.mkdtemp(), seed=1)
    >>> tuner.search(np.ones((32, 4)), np.ones((32, 1)), epochs=1, verbose=0)
    >>> trial = tuner.oracle.get_best_trials()[0]
    >>> float(trial.metrics.get_last_value("effective/batch_size"))  # 8*1*2
    16.0
    >>> float(trial.metrics.get_last_value("effective/lr_scale"))
    2.0
    """

    def __init__(
        self,
        build_fn: Callable[[Any], keras.Model],
        *,
        per_replica_batch_size: Union[None, int, Sequence[int]] = None,
        lr_scaling: Optional[str] = "linear",
        reference_batch_size: Optional[int] = None,
        learning_rate_hp: str = LEARNING_RATE_HP,
        accum_steps: Union[None, int, Sequence[int]] = None,
        precision: Union[None, str, Sequence[str]] = None,
        rebatch: bool = True,
        backup: Union[bool, str, int] = "epoch",
        **kwargs: Any,
    ):
        wrapped = None
        if isinstance(build_fn, StrategyAwareHyperModel):
            raise TypeError(
                f"build_fn is already a StrategyAwareHyperModel "
                f"({build_fn!r}): wrapping it again would scale the batch and "
                "learning rate twice. Pass it to the tuner as it is."
            )
        if isinstance(build_fn, keras_tuner.HyperModel):
            wrapped = build_fn
            # A subclass that skips `HyperModel.__init__` has no name.
            kwargs.setdefault("name", getattr(wrapped, "name", None))
            # Its `build` attribute is KerasTuner's wrapper, which honours
            # the wrapped hypermodel's own `tunable`.
            build_fn = wrapped.build
        super().__init__(**kwargs)
        if not callable(build_fn):
            raise TypeError(
                f"build_fn must be a function hp -> compiled keras.Model or a "
                f"keras_tuner.HyperModel, got {build_fn!r}."
            )
        if lr_scaling not in LR_SCALING_RULES:
            raise ValueError(
                f"Unknown lr_scaling rule {lr_scaling!r}. Valid rules: "
                f"{list(LR_SCALING_RULES)} ('linear': lr = base * ratio, "
                "'sqrt': lr = base * sqrt(ratio), None: no scaling)."
            )
        per_replica_batch_size = _choices(
            "per_replica_batch_size", per_replica_batch_size)
        accum_steps = _choices("accum_steps", accum_steps)
        if reference_batch_size is not None:
            reference_batch_size = _positive_int(
                "reference_batch_size", reference_batch_size)
        if precision is not None:
            if not _as_list(precision):
                raise ValueError(
                    f"precision must be a policy name or a non-empty list of "
                    f"them to tune, got {precision!r}. Pass None for the "
                    f"global policy, or names from {list(_PRECISIONS)}."
                )
            for name in _as_list(precision):
                if name not in _PRECISIONS:
                    raise ValueError(
                        f"Unknown precision policy {name!r}. Valid policies: "
                        f"{list(_PRECISIONS)}."
                    )
        if backup is not False and backup != "epoch":
            backup = _positive_int("backup", backup)
        self.build_fn = build_fn
        self.wrapped = wrapped
        self.per_replica_batch_size = per_replica_batch_size
        self.lr_scaling = lr_scaling
        self.reference_batch_size = reference_batch_size
        self.learning_rate_hp = learning_rate_hp
        self.accum_steps = accum_steps
        self.precision = precision
        self.rebatch = bool(rebatch)
        self.backup = backup
        self._executions: dict[str, int] = {}
        self._warned_rate = False
        # `keras.backend.clear_session()`, which KerasTuner calls before
        # each trial, drops a `keras.distribution` setting: each trial's
        # build and fit set it again.
        self._distribution = strategy_lib.current()
        # Every process of a search builds its hypermodel, the chief too.
        compat.enable_tuner_state_fix()
        if backup is not False:
            # A resumed trial keeps its best value, so its best checkpoint
            # is that of the uninterrupted trial.
            register_callback_state(compat.save_best_epoch_class(),
                                    compat.save_best_epoch_state,
                                    compat.set_save_best_epoch_state)

    # --- hyperparameters ----------------------------------------------------

    def declare_hyperparameters(
            self, hp: keras_tuner.HyperParameters) -> None:
        """Declares the wrapped `HyperModel`'s space and this hypermodel's
        own hyperparameters, before the first trial.

        KerasTuner calls it when the tuner is created, so
        `per_replica_batch_size` (when given to the constructor),
        `accum_steps` and `precision` (when tuned) are in the search space
        from the first trial on, and the space does not change during the
        search.
        """
        if self.wrapped is not None:
            self.wrapped.declare_hyperparameters(hp)
        self._per_replica_batch(hp)
        self._accum_steps(hp)
        self._precision(hp)

    def _declared(self, hp, name, value):
        """A constructor value, or its `hp.Choice` when given as a list."""
        if isinstance(value, (list, tuple)):
            return hp.Choice(name, list(value))
        return value

    def _accum_steps(self, hp) -> Optional[int]:
        return self._declared(hp, ACCUM_STEPS_HP, self.accum_steps)

    def _precision(self, hp) -> Optional[str]:
        return self._declared(hp, PRECISION_HP, self.precision)

    def _per_replica_batch(self, hp) -> Optional[int]:
        if isinstance(self.per_replica_batch_size, int):
            # Fixed, so every trial's hyperparameters show it.
            return hp.Fixed(PER_REPLICA_BATCH_HP, self.per_replica_batch_size)
        value = self._declared(
            hp, PER_REPLICA_BATCH_HP, self.per_replica_batch_size
        )
        if value is None and PER_REPLICA_BATCH_HP in hp:
            value = hp.get(PER_REPLICA_BATCH_HP)
        return value

    # --- build --------------------------------------------------------------

    def build(self, hp: keras_tuner.HyperParameters) -> keras.Model:
        """Builds one trial's model: precision, `build_fn`, accumulation, LR.

        The learning rate is scaled here whenever the scale is known without
        the data (always with the default `reference_batch_size`), so a
        model rebuilt for a finished trial, as `get_best_models()` does, is
        compiled with the rate the trial trained with on this strategy.
        """
        strategy_lib.restore(self._distribution)
        per_replica = self._per_replica_batch(hp)  # First: a stable space.
        accum_steps = self._accum_steps(hp)
        policy = self._precision(hp)
        previous = keras.mixed_precision.global_policy()
        if policy is not None:
            keras.mixed_precision.set_global_policy(policy)
        try:
            model = _check_compiled(self.build_fn(hp))
            model = _maybe_accumulate(model, accum_steps)
        finally:
            # Layers captured the policy when they were created; restoring it
            # keeps the trial's policy out of everything built later.
            keras.mixed_precision.set_global_policy(previous)
        if self.lr_scaling is not None:
            if self.learning_rate_hp not in hp:
                raise keras_tuner.errors.FatalValueError(
                    f"lr_scaling={self.lr_scaling!r} scales the base learning "
                    f"rate read from the hyperparameter "
                    f"{self.learning_rate_hp!r}, but build_fn did not define "
                    f"it. In build_fn, read the base rate with "
                    f"hp.Float({self.learning_rate_hp!r}, 1e-4, 1e-2, "
                    "sampling='log') and pass it to the optimizer, or pass "
                    "learning_rate_hp='<your hp name>', or lr_scaling=None."
                )
            scale = self._lr_scale(model, per_replica)
            if scale is None:
                raise keras_tuner.errors.FatalValueError(
                    f"reference_batch_size={self.reference_batch_size} makes "
                    "the learning rate depend on the per-replica batch, which "
                    "build must know, so that a model rebuilt for a trial "
                    "(get_best_models, hypermodel.build) gets the rate the "
                    "trial trained with; here it would come from search() or "
                    "the data. Pass per_replica_batch_size=<int, or a list to "
                    "tune> to StrategyAwareHyperModel, or declare "
                    f"hp.Choice({PER_REPLICA_BATCH_HP!r}, [...]) in build_fn, "
                    "or leave reference_batch_size=None."
                )
            base = hp.get(self.learning_rate_hp)
            self._warn_if_rate_overwritten(model, base, scale)
            _set_learning_rate(model, base, scale)
        return model

    def _warn_if_rate_overwritten(self, model, base, scale: float) -> None:
        if self._warned_rate:
            return
        fixed = _overwritten_rate(model, base)
        if fixed is None:
            return
        self._warned_rate = True
        warnings.warn(
            f"build_fn compiled the optimizer with learning_rate={fixed:g}, "
            f"but the hypermodel sets it from the {self.learning_rate_hp!r} "
            f"hyperparameter: {base:g} x scale {scale:g} = "
            f"{base * scale:g} is used and {fixed:g} is not. Give the "
            f"optimizer the hyperparameter (e.g. keras.optimizers.SGD("
            f"hp.Float({self.learning_rate_hp!r}, ...))), or pass "
            "lr_scaling=None to keep the rate build_fn sets. (Warned once.)",
            UserWarning,
            stacklevel=2,
        )

    def _lr_scale(self, model, per_replica: Optional[int]) -> Optional[float]:
        replicas = strategy_lib.num_replicas(strategy_lib.of_model(model))
        accum = _accum_steps_of(model)
        ratio: float
        if self.reference_batch_size is None:
            # The reference is the per-replica batch itself.
            ratio = replicas * accum
        elif per_replica is None:
            return None
        else:
            ratio = per_replica * replicas * accum / self.reference_batch_size
        return {"linear": ratio, "sqrt": math.sqrt(ratio), None: 1.0}[
            self.lr_scaling
        ]

    def _effective(self, model, per_replica: int) -> dict:
        accum = _accum_steps_of(model)
        global_batch = strategy_lib.global_batch_size(
            per_replica, strategy_lib.of_model(model))
        return {
            "effective/replicas": strategy_lib.num_replicas(
                strategy_lib.of_model(model)),
            "effective/per_replica_batch_size": per_replica,
            "effective/global_batch_size": global_batch,
            "effective/accum_steps": accum,
            "effective/batch_size": global_batch * accum,
            "effective/lr_scale": self._lr_scale(model, per_replica),
        }

    # --- fit ----------------------------------------------------------------

    def fit(self, hp: keras_tuner.HyperParameters, model: keras.Model,
            *args: Any, **kwargs: Any) -> Any:
        """Trains one trial: global batch, scaled LR, per-trial backup.

        Then calls the wrapped `HyperModel`'s `fit` (or `model.fit`) with
        the adjusted arguments. Also the way to retrain a trial outside the
        search: `hypermodel.fit(hp, hypermodel.build(hp), train, ...)`.

        Args:
            hp: The trial's `HyperParameters`.
            model: The model `build` returned.
            *args: `search`'s positional arguments (`x`, `y`, ...).
            **kwargs: `search`'s keyword arguments; `batch_size` is per
                replica.

        Returns:
            What the wrapped `fit` returned (by default the `History` of
            `model.fit`), with the `EFFECTIVE_KEYS` added to a `History` or a
            dict of metrics (a float is returned as it is).
        """
        strategy_lib.restore(self._distribution)
        positional = list(args)
        x = positional[0] if positional else kwargs.get("x")
        user_batch = kwargs.pop("batch_size", None)
        if user_batch is not None:
            user_batch = _positive_int("search(batch_size=...)", user_batch)
        declared = self._per_replica_batch(hp)
        if declared is not None and user_batch is not None and (
            user_batch != declared
        ):
            raise keras_tuner.errors.FatalValueError(
                f"search(batch_size={user_batch}) conflicts with the trial's "
                f"per-replica batch size {declared} (the "
                f"{PER_REPLICA_BATCH_HP!r} hyperparameter, given to "
                "StrategyAwareHyperModel or declared by build_fn). Pass one "
                "of them: batch_size to search() is per replica."
            )
        replicas = strategy_lib.num_replicas(strategy_lib.of_model(model))
        per_replica = declared if declared is not None else user_batch
        if isinstance(x, tf.data.Dataset) and (
            per_replica is None or not self.rebatch
        ):
            per_replica = _dataset_batch(
                x, replicas, None if self.rebatch else per_replica
            )
        if per_replica is None:
            per_replica = _DEFAULT_BATCH
        callbacks = list(kwargs.pop("callbacks", None) or [])
        found = compat.tuner_and_trial(callbacks)
        if found is not None:
            # KerasTuner reloads a search (overwrite=False) only from the
            # tuner's file, which it writes as a trial ends: the rerun of a
            # search killed in its first trial started anew, and its new
            # trial 0 (other hyperparameters) met the old one's backup.
            # Saved before the trial's first backup, the search is reloaded
            # and the trial retried with its own hyperparameters.
            found[0].save()
        if self.backup is not False:
            compat.check_save_best_epoch(callbacks)
        info = self._effective(model, per_replica)
        global_batch = info["effective/global_batch_size"]
        info["effective/learning_rate"] = self._apply_learning_rate(
            hp, model, info["effective/lr_scale"]
        )

        if isinstance(x, tf.data.Dataset):
            if self.rebatch:
                x = data_lib.rebatch(x, global_batch)
            if positional:
                positional[0] = x
            else:
                kwargs["x"] = x
        else:
            kwargs["batch_size"] = global_batch
        validation = kwargs.get("validation_data")
        if isinstance(validation, tf.data.Dataset):
            if self.rebatch:
                kwargs["validation_data"] = data_lib.rebatch(
                    validation, global_batch
                )
        elif validation is not None:
            kwargs.setdefault("validation_batch_size", global_batch)

        backup = self._backup_callback(found)
        if backup is not None:
            # First: restores the model before other callbacks look at it.
            callbacks.insert(0, backup)
            # Last, as Keras places its own History: every callback has
            # added to an epoch's logs before it records them.
            callbacks.append(_TrialHistory())
        if self.wrapped is not None:
            results = self.wrapped.fit(hp, model, *positional,
                                       callbacks=callbacks, **kwargs)
        else:
            results = model.fit(*positional, callbacks=callbacks, **kwargs)
        if isinstance(results, keras.callbacks.History):
            epochs = len(results.epoch)
            for key in EFFECTIVE_KEYS:
                results.history[key] = [float(info[key])] * epochs
        elif isinstance(results, dict):
            results = {**results, **{k: float(info[k]) for k in EFFECTIVE_KEYS}}
        return results

    def _apply_learning_rate(self, hp, model, scale: float) -> Optional[float]:
        # The optimizer's variables are the strategy's (mirrored) variables.
        with strategy_lib.scope_of(model):
            if self.lr_scaling is not None:
                _set_learning_rate(model, hp.get(self.learning_rate_hp), scale)
            return _current_learning_rate(model)

    def _backup_callback(self, found) -> Optional[BackupAndRestore]:
        if self.backup is False:
            return None
        if found is None:
            return None  # Not called by a KerasTuner tuner: nothing to key on.
        tuner, trial = found
        trial_id = str(trial.trial_id)
        # One directory per execution: with executions_per_trial > 1 a
        # finished execution's (deleted) backup must not be resumed by the
        # next one. Numbered per process, so a rerun counts from 0 again and
        # reruns finished executions from scratch, resuming the killed one.
        execution = self._executions.get(trial_id, 0)
        self._executions[trial_id] = execution + 1
        directory = os.path.join(
            tuner.get_trial_dir(trial_id), "backup", f"execution_{execution}"
        )
        return BackupAndRestore(directory, save_freq=self.backup, keep=2)
