"""What the runtime does where its backend halves say nothing: TensorFlow's
way, which a backend's `TrainFunctionWrapper` overrides where it differs
(`keras_mgpu/backend/jax/runtime.py` overrides each).

- `_check_support()`: what the runtime reads of Keras, checked as a `fit`
  begins (`compat.check_runtime_support`: the TensorFlow trainer's train
  function the input timing retraces, the running `fit`'s epoch iterator);
- `_check_callback(callback)`: a callback refused on this backend (none);
- `_new_input_wait()`: where the seconds waited for input are added up (a
  float64 variable of this process, which the compiled step adds to);
- `_sync_state()`: puts the train state in the model's variables before an
  eager read (nothing: TensorFlow trains them in place);
- `read_device(read, cached, key, compiled)`: the values of `read` (a
  function of a converter from a variable or tensor to the value returned)
  from one cached `tf.function`, one dispatch and one wait;
- `local_gpus()`, `gpu_memory(num_gpus, reset)`: this process's GPUs and
  their current and peak bytes, as TensorFlow's allocator counts them.
"""

from __future__ import annotations

from typing import Callable, Optional

import keras
import tensorflow as tf

from keras_mgpu import compat
from keras_mgpu import strategy as strategy_lib


class _TensorFlowDefaults:
    """The runtime's backend hooks, as they are on TensorFlow."""

    def _check_support(self) -> None:
        compat.check_runtime_support(self.model)

    def _check_callback(self, callback) -> None:
        pass

    @staticmethod
    def _new_input_wait():
        return strategy_lib.local_variable(0.0, tf.float64)

    def _sync_state(self) -> None:
        pass

    def read_device(self, read: Callable[[Callable], dict],
                    cached: Optional[tuple] = None, key=None,
                    compiled: bool = True) -> tuple[Optional[tuple], dict]:
        """The values `read(value)` returns, read at once.

        Args:
            read: Builds the dict of values to read; `value(x)` converts a
                variable or tensor to what it holds.
            cached: Defaults to None. The `(key, reader)` kept from an
                earlier read.
            key: Defaults to None: reuse `cached`. Else what `read` reads,
                by identity: `cached` is traced anew where it differs.
            compiled: Defaults to True. False reads eagerly (variables
                that may not exist yet).

        Returns:
            The `(key, reader)` to keep, and the values (tensors, or
            arrays: `np.asarray` takes either).
        """
        if not compiled:
            return cached, read(_tensor)
        if key is not None and (cached is None or cached[0] != key):
            # The concrete function holds what it reads, so the ids in the
            # key stay theirs while it lives.
            cached = (key, tf.function(lambda: read(_tensor),
                                       autograph=False).get_concrete_function())
        return cached, cached[1]()

    @staticmethod
    def local_gpus() -> int:
        """This process's GPUs."""
        return len(tf.config.list_logical_devices("GPU"))

    @staticmethod
    def gpu_memory(num_gpus: int, reset: bool) -> dict:
        """Current and peak bytes per local GPU (the peak reset after the
        read with `reset`); `{}` without GPUs."""
        out = {}
        for index in range(num_gpus):
            device = f"GPU:{index}"
            try:
                info = tf.config.experimental.get_memory_info(device)
                if reset:
                    tf.config.experimental.reset_memory_stats(device)
            except (ValueError, tf.errors.OpError):
                continue
            out[f"GPU{index}"] = {
                "current_bytes": int(info["current"]),
                "peak_bytes": int(info["peak"]),
            }
        return out


def _tensor(value):
    return tf.identity(keras.ops.convert_to_tensor(value))
