"""Version matrix: the version-sensitive tests on the oldest and the newest
TensorFlow/Keras pair keras-mgpu supports.

    .venv/bin/nox -s oldest      # TensorFlow 2.19.1 + Keras 3.10.0
    .venv/bin/nox -s newest      # TensorFlow 2.21.0 + Keras 3.15.1
    .venv/bin/nox -s nightly     # the newest TensorFlow + keras-nightly
    .venv/bin/nox -s jax         # the JAX backend, with the `jax` extra
    .venv/bin/nox -s models      # every model of tests/models/, both backends
    make matrix                  # oldest and newest

Each session builds its own virtual environment under `.nox/`. A new pair
goes here, in `keras_mgpu.compat.TESTED_KERAS` and in docs/compatibility.md's
compatibility table together.
"""

import os

import nox

nox.options.default_venv_backend = "venv"
# `nightly` is not a default: upstream moves daily, so it is run by hand.
nox.options.sessions = ["oldest", "newest"]

PAIRS = {
    "oldest": {"tensorflow": "2.19.1", "keras": "3.10.0"},
    "newest": {"tensorflow": "2.21.0", "keras": "3.15.1"},
}

# What the installed Keras and TensorFlow decide: keras-mgpu touches their
# internals in `keras_mgpu.compat` only, and tests/test_compat.py checks
# each of compat's checks and adapters on the installed pair (the
# multi-worker fit's workaround: tests/test_multi_worker_fit.py). On top,
# the claims that rest on those internals end to end: accumulation equals
# the big-batch step (each kind of clipping, 1 to 4 replicas, two
# workers, steps_per_execution and XLA, float8, a window saved half way),
# in-step accumulation on two workers, the state read from Keras's
# callbacks, a resume inside a multiple-step execution, the logger's
# records, and the multi-worker start-up deadline (it configures
# TensorFlow's coordination service through internals). The rest of the
# backup, the logger and the runtime runs on the newest pair's full suite:
# on this pair it would take the same code paths through compat.
CRITICAL = [
    "tests/test_compat.py",
    "tests/test_multi_worker_fit.py",
    "tests/test_callback_state.py",
    *(f"tests/test_accumulation.py::{test}" for test in (
        *(f"test_accumulated_step_equals_big_batch_step[{case}]"
          for case in ("adam-1", "adam-2", "adam-4", "adam_clipnorm-2",
                       "adam_clipvalue-2", "adam_global_clipnorm-2")),
        "test_multi_worker_matches_mirrored",
        "test_steps_per_execution_and_jit_compile",
        "test_one_all_reduce_per_optimizer_step[True]",
        "test_synchronized_batch_norm_under_mirrored",
        "test_half_finished_window_survives_save_and_restore[2]",
        "test_save_and_load_model_round_trip",
        "test_float8_scales_follow_keras_accumulation")),
    "tests/test_accumulation_in_step.py::"
    "test_in_step_multi_worker_matches_one_process",
    "tests/test_backup_and_restore.py::"
    "test_a_resume_with_steps_per_execution_is_exact",
    "tests/test_backup_keras_scenarios.py::"
    "test_early_stopping_restores_the_best_weights_after_a_resume",
    "tests/test_distributed_logger.py::test_records_events_and_history_agree",
    "tests/test_strategy.py::"
    "test_a_worker_that_never_starts_is_named_after_the_startup_timeout",
]
# Within those: Keras's version as faked by the test, not the installed
# one; the backend seam's refusal of another backend (keras-mgpu's own,
# and it loads the JAX backend's module, whose packages this environment
# leaves out).
NOT_VERSION_SENSITIVE = [
    "tests/test_multi_worker_fit.py::"
    "test_multi_worker_fit_on_a_newer_keras_works_and_warns_once",
    "tests/test_multi_worker_fit.py::"
    "test_other_keras_backend_is_refused_with_a_clear_error",
]

# What the tests install besides keras-mgpu's extras (pyproject.toml's
# `test` extra has the same).
TEST_TOOLS = ["pytest>=7", "pytest-xdist>=3"]


def _critical(session: nox.Session, pair: str) -> None:
    pins = [f"{name}=={version}" for name, version in PAIRS[pair].items()]
    # Every optional package a user may have (the import test checks that
    # keras-mgpu loads none of them), not the JAX backend's.
    session.install(*pins, "-e", ".[all]", *TEST_TOOLS)
    session.run("python", "-m", "pip", "check")
    _run_critical(session)


def _run_critical(session: nox.Session, *extra: str) -> None:
    session.run("python", "-c",
                "import tensorflow as tf, keras; "
                "print('testing TensorFlow', tf.__version__, "
                "'with Keras', keras.__version__)")
    deselected = [f"--deselect={test}" for test in NOT_VERSION_SENSITIVE]
    # .ci/run runs this beside `make test`, on one pytest worker.
    workers = os.environ.get("KERAS_MGPU_NOX_WORKERS", "2")
    session.run("python", "-m", "pytest", "-n", workers, "--dist", "loadfile",
                *(session.posargs or [*CRITICAL, *extra, *deselected]),
                env={"TF_CPP_MIN_LOG_LEVEL": "2"})


@nox.session
def oldest(session: nox.Session) -> None:
    """The version-sensitive tests on the oldest supported pair."""
    _critical(session, "oldest")


@nox.session
def newest(session: nox.Session) -> None:
    """The version-sensitive tests on the newest supported pair."""
    _critical(session, "newest")


@nox.session
def nightly(session: nox.Session) -> None:
    """The version-sensitive tests on the newest keras-nightly over the
    newest TensorFlow.

    keras-nightly installs the same `keras` package as the `keras`
    distribution TensorFlow and KerasTuner require, so the release is
    removed and the nightly put in its place; `pip check` would report that
    swap, so it is not run here.
    """
    session.install("--upgrade", "tensorflow", "-e", ".[test]")
    session.run("python", "-m", "pip", "uninstall", "--yes", "keras")
    session.install("--upgrade", "--pre", "--no-deps", "--force-reinstall",
                    "keras-nightly")
    # Every private name taken away in turn, on the names the nightly has
    # (the full suite does so on the newest release).
    _run_critical(session, "tests/test_compat_mutations.py")


# The tests that run on either Keras backend, and the JAX backend's own.
JAX_TESTS = ["tests/backends", "tests/models", "tests/jax"]


@nox.session
def models(session: nox.Session) -> None:
    """The whole tested-models matrix (tests/models/: every model, not
    only `.ci/run`'s two) on the TensorFlow backend, then on JAX."""
    session.install("-e", ".[dev]")
    every = ["-m", "", *(session.posargs or ["tests/models"])]
    session.run("python", "-m", "pytest", "-n", "2", "--dist", "load",
                *every, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    session.run("python", "-m", "pytest", "-n", "2", "--dist", "load",
                *every,
                env={"KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "2",
                     "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})


@nox.session
def jax(session: nox.Session) -> None:
    """The JAX backend's tests (KERAS_BACKEND=jax, 2 forced host devices)
    in a fresh environment with the `jax` extra: what a JAX user installs."""
    session.install("-e", ".[jax,tuner,models]", *TEST_TOOLS)
    session.run("python", "-m", "pip", "check")
    session.run("python", "-m", "pytest", "-n", "2", "--dist", "loadfile",
                *(session.posargs or JAX_TESTS),
                env={"KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "2",
                     "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
