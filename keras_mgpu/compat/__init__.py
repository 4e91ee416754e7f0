"""Every use of Keras, TensorFlow and KerasTuner private internals, one
module per upstream concern:

- `_core`: the checks every workaround goes through (`_require`,
  `_require_module`, `KerasInternalsError`, `TESTED_KERAS`, the shapes of
  the Keras functions keras-mgpu runs a copy of);
- `registry`: one `Workaround` record per workaround (`WORKAROUNDS`);
- `jax_trainer`: Keras's JAX trainer and backend (the accumulation's JAX
  step, uneven last batches, in-step mode's batch statistics);
- `keras_trainer`: Keras's TensorFlow trainer (the multi-worker `fit` and
  `steps_per_execution` fixes);
- `optimizer`: Keras's TensorFlow optimizer (exact clipping, the schedule);
- `accumulation`: the train-step building blocks of gradient accumulation;
- `mixed_precision`: layer and tensor internals for mixed precision;
- `jax_nn`: Keras's JAX cross-entropy, given the float32 head's logits;
- `saving`: the weights snapshot and its in-memory `.weights.h5` file;
- `callbacks`: the initial epoch of the backup;
- `fit_context`: the running `fit`'s callbacks and epoch iterator;
- `interrupts`: Ctrl-C during `fit`, taken at the next batch;
- `telemetry`: the sample count, `tf.summary`'s state and TensorBoard's
  restart marker;
- `train_loop`: the timed train function and the running `fit`'s epoch
  iterator;
- `tf_cluster`: TensorFlow's multi-worker start-up;
- `keras_tuner`: KerasTuner's trial callback, best checkpoint and oracle.

Every name is re-exported here: the rest of keras-mgpu uses
`keras_mgpu.compat.<name>` only. `python -m keras_mgpu.compat` prints the
shapes of the installed Keras's originals of keras-mgpu's copies.

Example:

>>> from keras_mgpu import compat
>>> compat.WORKAROUNDS[0].name == compat.registry.WORKAROUNDS[0].name
True
"""

from keras_mgpu.compat._core import _MISSING  # noqa: F401
from keras_mgpu.compat._core import _KNOWN_SHAPES  # noqa: F401
from keras_mgpu.compat._core import TESTED_KERAS  # noqa: F401
from keras_mgpu.compat._core import KerasInternalsError  # noqa: F401
from keras_mgpu.compat._core import UntestedKerasWarning  # noqa: F401
from keras_mgpu.compat._core import VersionRange  # noqa: F401
from keras_mgpu.compat._core import _copied_variant  # noqa: F401
from keras_mgpu.compat._core import _import_module  # noqa: F401
from keras_mgpu.compat._core import _internals_error  # noqa: F401
from keras_mgpu.compat._core import _lookup  # noqa: F401
from keras_mgpu.compat._core import _module_if_present  # noqa: F401
from keras_mgpu.compat._core import _owner_name  # noqa: F401
from keras_mgpu.compat._core import _require  # noqa: F401
from keras_mgpu.compat._core import _require_module  # noqa: F401
from keras_mgpu.compat._core import _shape_of  # noqa: F401
from keras_mgpu.compat._core import _shape_of_tree  # noqa: F401
from keras_mgpu.compat._core import keras_version  # noqa: F401
from keras_mgpu.compat._core import warn_if_untested  # noqa: F401
from keras_mgpu.compat.accumulation import check_accumulation_support  # noqa: F401
from keras_mgpu.compat.accumulation import compute_loss  # noqa: F401
from keras_mgpu.compat.accumulation import gradients_already_reduced  # noqa: F401
from keras_mgpu.compat.accumulation import loss_scale_apply  # noqa: F401
from keras_mgpu.compat.accumulation import loss_scale_skip  # noqa: F401
from keras_mgpu.compat.accumulation import track_loss  # noqa: F401
from keras_mgpu.compat.jax_trainer import batch_moments_across  # noqa: F401
from keras_mgpu.compat.jax_trainer import check_jax_accumulation_support  # noqa: F401
from keras_mgpu.compat.jax_trainer import check_jax_in_step_support  # noqa: F401
from keras_mgpu.compat.jax_trainer import enable_uneven_last_batches  # noqa: F401
from keras_mgpu.compat.jax_trainer import update_metrics  # noqa: F401
from keras_mgpu.compat.callbacks import check_backup_support  # noqa: F401
from keras_mgpu.compat.callbacks import set_initial_epoch  # noqa: F401
from keras_mgpu.compat.fit_context import RunningFit  # noqa: F401
from keras_mgpu.compat.fit_context import record_fits  # noqa: F401
from keras_mgpu.compat.fit_context import record_fits_from_import  # noqa: F401
from keras_mgpu.compat.fit_context import running_fit  # noqa: F401
from keras_mgpu.compat.fit_context import given_to_running_fit  # noqa: F401
from keras_mgpu.compat.interrupts import defer_ctrl_c  # noqa: F401
from keras_mgpu.compat.interrupts import keep_ctrl_c  # noqa: F401
from keras_mgpu.compat.interrupts import raise_deferred_ctrl_c  # noqa: F401
from keras_mgpu.compat.keras_trainer import _copied_originals  # noqa: F401
from keras_mgpu.compat.keras_trainer import active_trainer_module  # noqa: F401
from keras_mgpu.compat.keras_trainer import enable_multi_step_fit  # noqa: F401
from keras_mgpu.compat.keras_trainer import enable_multi_worker_fit  # noqa: F401
from keras_mgpu.compat.keras_trainer import multi_step_fit_enabled  # noqa: F401
from keras_mgpu.compat.keras_trainer import multi_worker_fit_enabled  # noqa: F401
from keras_mgpu.compat.keras_trainer import trainer_class  # noqa: F401
from keras_mgpu.compat.keras_tuner import TUNER_IDS_ENV  # noqa: F401
from keras_mgpu.compat.keras_tuner import check_save_best_epoch  # noqa: F401
from keras_mgpu.compat.keras_tuner import enable_tuner_state_fix  # noqa: F401
from keras_mgpu.compat.keras_tuner import save_best_epoch_class  # noqa: F401
from keras_mgpu.compat.keras_tuner import save_best_epoch_state  # noqa: F401
from keras_mgpu.compat.keras_tuner import set_save_best_epoch_state  # noqa: F401
from keras_mgpu.compat.keras_tuner import tuner_and_trial  # noqa: F401
from keras_mgpu.compat.mixed_precision import KERAS_LOGITS_ATTR  # noqa: F401
from keras_mgpu.compat.jax_nn import enable_logits_losses  # noqa: F401
from keras_mgpu.compat.jax_nn import logits_losses_work  # noqa: F401
from keras_mgpu.compat.jax_nn import remember_logits  # noqa: F401
from keras_mgpu.compat.jax_nn import remembered_logits  # noqa: F401
from keras_mgpu.compat.mixed_precision import activation_logits_recovered  # noqa: F401
from keras_mgpu.compat.mixed_precision import attach_logits  # noqa: F401
from keras_mgpu.compat.mixed_precision import attached_logits_dropped  # noqa: F401
from keras_mgpu.compat.mixed_precision import attached_logits_problem  # noqa: F401
from keras_mgpu.compat.mixed_precision import logits_recovered  # noqa: F401
from keras_mgpu.compat.mixed_precision import own_variables  # noqa: F401
from keras_mgpu.compat.mixed_precision import producing_layer  # noqa: F401
from keras_mgpu.compat.mixed_precision import sublayers  # noqa: F401
from keras_mgpu.compat.mixed_precision import variable_autocasts  # noqa: F401
from keras_mgpu.compat.optimizer import enable_exact_clipping  # noqa: F401
from keras_mgpu.compat.optimizer import exact_clipping_enabled  # noqa: F401
from keras_mgpu.compat.optimizer import learning_rate_callable  # noqa: F401
from keras_mgpu.compat.optimizer import learning_rate_schedule  # noqa: F401
from keras_mgpu.compat.registry import _WORKAROUNDS  # noqa: F401
from keras_mgpu.compat.registry import WORKAROUNDS  # noqa: F401
from keras_mgpu.compat.registry import Workaround  # noqa: F401
from keras_mgpu.compat.registry import workarounds_table  # noqa: F401
from keras_mgpu.compat.saving import WeightsLayout  # noqa: F401
from keras_mgpu.compat.saving import layout_key  # noqa: F401
from keras_mgpu.compat.saving import load_weights_file  # noqa: F401
from keras_mgpu.compat.saving import weights_file  # noqa: F401
from keras_mgpu.compat.saving import weights_layout  # noqa: F401
from keras_mgpu.compat.telemetry import check_summary_support  # noqa: F401
from keras_mgpu.compat.telemetry import examples_count  # noqa: F401
from keras_mgpu.compat.telemetry import examples_seen  # noqa: F401
from keras_mgpu.compat.telemetry import loss_tracker  # noqa: F401
from keras_mgpu.compat.telemetry import summary_scope  # noqa: F401
from keras_mgpu.compat.telemetry import write_restart_marker  # noqa: F401
from keras_mgpu.compat.telemetry import train_on_batch_resets_metrics  # noqa: F401
from keras_mgpu.compat.tf_cluster import set_cluster_startup_timeout  # noqa: F401
from keras_mgpu.compat.train_loop import add_epoch_iterator_count  # noqa: F401
from keras_mgpu.compat.train_loop import check_runtime_support  # noqa: F401
from keras_mgpu.compat.train_loop import epoch_iterator_count  # noqa: F401
from keras_mgpu.compat.train_loop import epoch_iterator_keeps_iterator  # noqa: F401
from keras_mgpu.compat.train_loop import epoch_iterator_reads_on  # noqa: F401
from keras_mgpu.compat.train_loop import fit_epoch_iterator  # noqa: F401
from keras_mgpu.compat.train_loop import instrumented_train_function  # noqa: F401
from keras_mgpu.compat.train_loop import timed_train_function  # noqa: F401

# The public, documented part: what users read or catch (the tested Keras
# versions, the warning and error, the workaround records). The other names
# above are keras-mgpu's own adapters, for its modules' `compat.<name>` use.
__all__ = [
    "TESTED_KERAS", "VersionRange", "keras_version", "warn_if_untested",
    "UntestedKerasWarning", "KerasInternalsError", "Workaround", "WORKAROUNDS",
    "workarounds_table",
]
