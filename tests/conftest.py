"""Shared fixtures: logical-CPU strategies, the local cluster runner, small data.

The pytest process splits its CPU into `MAX_LOGICAL_CPUS` logical devices
before anything else touches TensorFlow, so mirrored strategies over 2 and 4
replicas are real `MirroredStrategy` objects.

`tests/backends/` runs on either Keras backend (`make test` runs it on
both; `two_replicas` is a 2-device scope on the active one); `tests/jax/`
is collected only with `KERAS_BACKEND=jax` (with 2 forced host devices:
`XLA_FLAGS=--xla_force_host_platform_device_count=2`).
"""

import atexit
import os
import shutil
import signal
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _remove_jax_cache(path, owner):
    if os.getpid() == owner:  # not in a fork of this process
        shutil.rmtree(path, ignore_errors=True)


# JAX's persistent compilation cache for the run, before JAX is imported:
# pytest-xdist's workers and every child process inherit it, so a program
# one test or process compiled, the next loads. The JAX backend's tests
# compile the same steps in a test and in its children again and again (a
# fifth of their CPU time). A cache set outside is used as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _jax_cache = tempfile.mkdtemp(prefix="keras-mgpu-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _jax_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    atexit.register(_remove_jax_cache, _jax_cache, os.getpid())

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_mgpu import launcher  # noqa: E402
from keras_mgpu import strategy as strategy_lib  # noqa: E402

MAX_LOGICAL_CPUS = 4
LOGICAL_CPUS = strategy_lib.configure_virtual_cpus(MAX_LOGICAL_CPUS)


# The optional packages TensorFlow and Keras import whenever installed,
# which child processes start without (tests/_child_site/sitecustomize.py
# says why).
HIDDEN_FROM_CHILDREN = ("jax", "matplotlib", "sklearn")


def pytest_configure(config):
    """Child processes start without `HIDDEN_FROM_CHILDREN`, but with jax
    where they run on the JAX backend. Not in pytest-xdist's controller:
    its workers, which run the tests in process, would inherit it."""
    if (getattr(config.option, "numprocesses", None)
            and not hasattr(config, "workerinput")):
        return
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [
        os.path.join(os.path.dirname(__file__), "_child_site"),
        os.environ.get("PYTHONPATH")]))
    jax_backend = keras.backend.backend() == "jax"
    os.environ.update(hide_in_children({}, [
        name for name in HIDDEN_FROM_CHILDREN
        if not (jax_backend and name == "jax")]))


# The JAX backend's own tests need JAX's devices, not TensorFlow's.
collect_ignore = [] if keras.backend.backend() == "jax" else ["jax"]

_STRATEGIES = {}


def mirrored(n: int) -> tf.distribute.Strategy:
    """A MirroredStrategy over the first `n` logical CPUs (1: default strategy).

    One strategy per size for the whole session: each MirroredStrategy numbers
    its collective groups from the same base, so two live strategies over
    different device sets would collide in TensorFlow's collective executor.
    Each size gets its own base (the knob TensorFlow's own tests use).
    """
    if n == 1:
        return tf.distribute.get_strategy()
    if n not in _STRATEGIES:
        cls = type(f"MirroredStrategy{n}", (tf.distribute.MirroredStrategy,),
                   {"_collective_key_base": 1000 * n})
        _STRATEGIES[n] = cls(LOGICAL_CPUS[:n])
    return _STRATEGIES[n]


@pytest.fixture(params=[2, 4], ids=lambda n: f"{n}cpus")
def mirrored_strategy(request):
    return mirrored(request.param)


@pytest.fixture
def two_replicas():
    """A function returning a fresh 2-replica scope on the active backend:
    a MirroredStrategy over 2 logical CPUs on TensorFlow, a `DataParallel`
    distribution over 2 host devices on JAX."""
    if keras.backend.backend() == "jax":
        import jax

        return lambda: keras.distribution.DataParallel(
            devices=jax.devices()[:2]).scope()
    return lambda: mirrored(2).scope()


@pytest.fixture
def policy(request):
    """The global dtype policy `request.param` (indirect parametrization),
    float32 again afterwards."""
    keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture
def float64():
    """float64 as Keras's float type and dtype policy, the previous ones
    again afterwards (a policy set by an earlier test would otherwise keep
    new layers in float32): where float32 rounding is amplified past what
    a check can tell from a bug (tests/models/test_model_training.py). On
    JAX also JAX's 64-bit mode, and Keras's type promotion kept at
    float64: on backends other than TensorFlow it turns a promoted float64
    into float32 (keras/src/backend/common/dtypes.py,
    `BIT64_TO_BIT32_DTYPE`), so BatchNormalization, which promotes its
    inputs with float32, would compute in float32 in a float64 model."""
    previous = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    if keras.backend.backend() == "jax":
        import jax
        from keras.src.backend.common import dtypes

        x64 = jax.enable_x64(True)
        demoted = dtypes.BIT64_TO_BIT32_DTYPE["float64"]
        dtypes.BIT64_TO_BIT32_DTYPE["float64"] = "float64"
    else:
        import contextlib

        x64, dtypes = contextlib.nullcontext(), None
    try:
        with x64:
            yield
    finally:
        keras.config.set_floatx(previous[0])
        keras.config.set_dtype_policy(previous[1])
        if dtypes is not None:
            dtypes.BIT64_TO_BIT32_DTYPE["float64"] = demoted


def hide_in_children(env: dict, names) -> dict:
    """`env` in whose child processes exactly the packages `names` are
    missing (tests/_child_site/sitecustomize.py)."""
    return dict(env, KERAS_MGPU_TESTS_HIDE=",".join(names))


def allow_in_children(env: dict, *names: str) -> dict:
    """`env` with the optional packages `names` no longer hidden from the
    child processes started with it (`pytest_configure` hides them)."""
    hidden = env.get("KERAS_MGPU_TESTS_HIDE", "").split(",")
    return hide_in_children(env, [name for name in hidden
                                  if name and name not in names])


@pytest.fixture
def python_sigint_handler():
    """Python's own SIGINT handler as the test begins (keras-mgpu's takes
    its place when a callback is made), the previous one after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def reset_policy():
    """float32 as the global dtype policy after the test."""
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture(autouse=True, scope="session")
def _workers_forked_from_a_zygote():
    """The suite's own worker functions start by fork from an interpreter
    with TensorFlow imported (tests/zygote.py says why and how);
    `KERAS_MGPU_TESTS_FRESH_WORKERS=1` starts each as a fresh one."""
    if os.environ.get("KERAS_MGPU_TESTS_FRESH_WORKERS") == "1":
        yield
        return
    from keras_mgpu.cluster import workers
    from tests import zygote

    undo = zygote.install(workers)
    yield
    undo()
    zygote.close_all()


@pytest.fixture
def run_workers():
    """`launcher.run_local_workers` with a test-sized default timeout."""

    def run(target, num_workers=2, **kwargs):
        kwargs.setdefault("timeout", 240)
        kwargs.setdefault(
            "env", {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "-1"}
        )
        return launcher.run_local_workers(target, num_workers, **kwargs)

    return run



# `--dist loadfile` hands files to the workers in collection order; the
# longest go first, so that no worker is left running one of them alone at
# the end (about 290 s each on 2 cores; the order of the rest is kept).
_LONGEST_FIRST = ("test_model_lifecycle.py", "test_model_training.py", "test_tuner.py", "test_backup_and_restore.py",
                  "test_backup_kills.py", "test_runtime.py", "test_accumulation_in_step.py",
                  "test_accumulation.py", "test_examples.py",
                  "test_gpu_suite.py", "test_distributed_logger.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return (_LONGEST_FIRST.index(name) if name in _LONGEST_FIRST
                else len(_LONGEST_FIRST))

    items.sort(key=rank)  # stable: each file's own order is kept
