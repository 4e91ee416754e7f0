"""Version matrix: the distribution-critical tests on the oldest and the
newest TensorFlow/Keras pair keras-mgpu supports.

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

# Multi-worker fit, accumulation, backup/resume, logger, the runtime under
# them, the gates, and the multi-worker start-up deadline (it configures
# TensorFlow's coordination service through internals).
CRITICAL = [
    "tests/test_compat.py",
    "tests/test_multi_worker_fit.py",
    "tests/test_accumulation.py",
    # In-step accumulation: every optimizer, steps_per_execution and XLA,
    # under MultiWorkerMirroredStrategy against one process.
    "tests/test_accumulation_in_step.py::"
    "test_in_step_multi_worker_matches_one_process",
    "tests/test_backup_and_restore.py",
    # The callback-state adapters read Keras callbacks' attributes.
    "tests/test_callback_state.py",
    "tests/test_backup_keras_scenarios.py::"
    "test_early_stopping_restores_the_best_weights_after_a_resume",
    "tests/test_distributed_logger.py",
    "tests/test_runtime.py",
    "tests/test_strategy.py::"
    "test_a_worker_that_never_starts_is_named_after_the_startup_timeout",
]

# Within those files, tests whose outcome does not depend on the Keras or
# TensorFlow version (the backup's own file checks and disk faults), and the
# kill-and-resume tests but two workers' accumulated run (through the
# runtime, the backup and the logger, test_runtime.py): the newest pair's
# full suite runs them.
NOT_VERSION_SENSITIVE = [
    "tests/test_runtime.py::"
    "test_killed_run_resumes_exactly_with_continuous_logs[default-plain]",
    "tests/test_backup_and_restore.py::"
    "test_multi_worker_kill_and_restart_matches_uninterrupted",
    "tests/test_backup_and_restore.py::"
    "test_sigkill_at_several_steps_resumes_exactly",
    "tests/test_backup_and_restore.py::"
    "test_sigkill_resumes_in_step_accumulation_exactly",
    "tests/test_backup_and_restore.py::test_every_kind_of_damage_is_detected",
    "tests/test_backup_and_restore.py::"
    "test_keep_bounds_generations_and_success_deletes",
    "tests/test_backup_and_restore.py::"
    "test_a_save_to_a_full_backup_dir_stops_clearly_and_keeps_the_last",
    "tests/test_backup_and_restore.py::"
    "test_pruning_and_cleanup_never_follow_links",
    "tests/test_backup_and_restore.py::test_unwritable_backup_dir",
    "tests/test_backup_and_restore.py::"
    "test_saves_and_restores_without_a_usable_tmpdir",
    "tests/test_backup_and_restore.py::"
    "test_a_kill_before_the_first_commit_leaves_no_backup_yet",
    "tests/test_backup_and_restore.py::"
    "test_a_generation_without_its_manifest_is_a_leftover_not_damage",
    "tests/test_backup_and_restore.py::"
    "test_a_backup_dir_that_names_no_directory_is_refused",
    "tests/test_backup_and_restore.py::"
    "test_presets_exit_with_a_code_the_job_runners_rerun",
    "tests/test_backup_and_restore.py::"
    "test_docs_show_the_exit_code_table_as_the_data_says",
    # The backup's lock, its writer thread and a RAM folder.
    "tests/test_backup_and_restore.py::"
    "test_a_second_live_run_on_one_backup_dir_is_refused",
    "tests/test_backup_and_restore.py::"
    "test_kill_during_an_asynchronous_write_falls_back_to_the_last_commit",
    "tests/test_backup_and_restore.py::"
    "test_an_exception_in_fit_lets_the_write_in_flight_commit",
    "tests/test_backup_and_restore.py::test_ram_filesystem",
    # The logger's own files and sinks: what reaches metrics.jsonl before a
    # kill, a failed write, wandb, arguments.
    "tests/test_distributed_logger.py::"
    "test_a_sigkilled_run_keeps_every_closed_record_and_the_rerun_continues",
    "tests/test_distributed_logger.py::"
    "test_a_sigkilled_run_loses_at_most_the_record_in_flight",
    "tests/test_distributed_logger.py::test_a_failed_write_names_its_cause",
    "tests/test_distributed_logger.py::test_import_does_not_load_wandb",
    "tests/test_distributed_logger.py::test_wandb_offline_run_lives_under_log_dir",
    "tests/test_distributed_logger.py::"
    "test_a_raising_wandb_log_stops_training_naming_it",
    "tests/test_distributed_logger.py::"
    "test_local_or_url_log_dir_appends_after_a_torn_line",
    # The backup's policy on the training thread and its local tier (the
    # store, the lock, signals, the schedule): no Keras internals.
    "tests/test_backup_and_restore.py::"
    "test_sigterm_after_a_failed_fit_terminates_the_process",
    "tests/test_backup_and_restore.py::"
    "test_sigterm_saves_and_exits_with_the_restart_code",
    "tests/test_backup_and_restore.py::"
    "test_each_save_is_the_state_of_its_step_while_training_goes_on",
    "tests/test_backup_and_restore.py::"
    "test_corrupt_newest_generation_falls_back_with_a_warning",
    "tests/test_backup_and_restore.py::"
    "test_multi_worker_local_tier_resumes_from_local_then_from_durable",
    # One of each pair on the same internals: the runtime's skipping (a
    # partial execution of unknown length, another batch size) and its
    # replica counts (2 to 1 stays).
    "tests/test_backup_and_restore.py::"
    "test_a_save_at_a_partial_execution_resumes_exactly[unknown_length]",
    "tests/test_backup_and_restore.py::"
    "test_a_resume_with_another_batch_size_skips_the_same_samples",
    "tests/test_runtime.py::test_resume_on_another_replica_count_is_exact[1-2]",
    # Keras's version as faked by the test, not the installed one.
    "tests/test_multi_worker_fit.py::"
    "test_multi_worker_fit_on_a_newer_keras_works_and_warns_once",
    # The window's own bookkeeping (which batches it holds, when it is
    # applied) on the internals the tests kept here already use: the
    # all-reduce count once (compiled), the outputs keyed once (a dict).
    "tests/test_accumulation.py::test_partial_window_is_applied_before_validation",
    "tests/test_accumulation.py::test_one_all_reduce_per_optimizer_step[False]",
    "tests/test_accumulation.py::"
    "test_losses_metrics_and_targets_keyed_by_output_name[list]",
    "tests/test_accumulation.py::test_float8_under_mirrored_matches_one_replica",
] + [
    "tests/test_accumulation.py::"
    f"test_partial_window_at_epoch_end[{case}]"
    for case in ("apply-reference_groups0-6", "drop-reference_groups1-4")
] + [
    # One of each kind of variant on the same internals: the optimizers
    # that clip (compat's exact clipping) and Adam stay; one sample-weight
    # split, one way to build the wrapped model, one dtype run of each
    # mode's, one update_freq of the model's summaries, one optimizer of
    # the multi-worker fit, one replica count of the input wait.
    f"tests/test_accumulation.py::{test}" for test in (
        *(f"test_accumulated_step_equals_big_batch_step[{optimizer}-2]"
          for optimizer in ("adamw", "sgd_momentum", "sgd_schedule")),
        "test_sample_weights_and_unequal_micro_batches[1]",
        "test_sample_weights_and_unequal_micro_batches[4]",
        "test_wraps_any_model[sequential_unbuilt]",
        "test_wraps_any_model[subclassed]",
        "test_float64_model_across_replicas[window]",
        "test_half_finished_window_survives_save_and_restore[1]")
] + [
    "tests/test_distributed_logger.py::"
    "test_the_models_own_summaries_are_recorded[epoch]",
    "tests/test_distributed_logger.py::"
    "test_input_wait_tells_a_starved_pipeline_from_a_fed_one[2]",
    "tests/test_multi_worker_fit.py::"
    "test_multi_worker_fit_matches_mirrored_and_single_device[sgd]",
]


def _critical(session: nox.Session, pair: str) -> None:
    pins = [f"{name}=={version}" for name, version in PAIRS[pair].items()]
    session.install(*pins, "-e", ".[test]")
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
    """The critical tests on the oldest supported pair."""
    _critical(session, "oldest")


@nox.session
def newest(session: nox.Session) -> None:
    """The critical tests on the newest supported pair."""
    _critical(session, "newest")


@nox.session
def nightly(session: nox.Session) -> None:
    """The critical tests on the newest keras-nightly over the newest
    TensorFlow.

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
    session.install("-e", ".[jax,tuner,models]", "pytest>=7", "pytest-xdist>=3")
    session.run("python", "-m", "pip", "check")
    session.run("python", "-m", "pytest", "-n", "2", "--dist", "loadfile",
                *(session.posargs or JAX_TESTS),
                env={"KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "2",
                     "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
