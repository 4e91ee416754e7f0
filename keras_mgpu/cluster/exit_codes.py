"""Which exit codes the common job runners rerun a job for, and the one
`BackupAndRestore` exits with after its SIGTERM save.

This table is the one place these facts live: `docs/backup.md` shows it as
`exit_code_table()` renders it, and a test keeps the two equal and checks
that the presets' code is one every runner here retries by default.
"""

from __future__ import annotations

from typing import NamedTuple

# 128 + SIGTERM: what a shell reports for a process SIGTERM ended, what
# TensorFlow's own preemption handler exits with on Google Cloud
# (`failure_handling_util.gce_exit_fn`), and, of the codes every runner below
# that reruns by exit code reruns without being told (130, 137, 138, 143),
# the one that says what happened (75, EX_TEMPFAIL, fails a TFJob for good).
RESTART_EXIT_CODE = 143
"""The exit code `BackupAndRestore` ends a process with after its SIGTERM
save (128 + SIGTERM): one that job runners rerun a job for."""

_NONZERO = frozenset(range(1, 256))


class SchedulerRetry(NamedTuple):
    """How one job runner decides to rerun a job from its exit code.

    Attributes:
        runner: The job runner, as its documentation names it.
        setting: The setting the row describes.
        codes: The exit codes it reruns with that setting, as it ships.
        note: What limits or changes the reruns.
        source: Where this is stated (code or documentation).
    """

    runner: str
    setting: str
    codes: frozenset
    note: str
    source: str


# Sources, read for this table:
# - tfjob: kubeflow/training-operator, pkg/util/train/train_util.go,
#   IsRetryableExitCode: 130, 137, 143 (SIGINT, SIGKILL, SIGTERM: "usually
#   caused by transient issues") and 138 (SIGUSR1, for users' own retryable
#   errors); 1, 2, 126, 127, 128, 139 and every other code are permanent.
# - kubernetes: the Job controller replaces every failed pod until
#   spec.backoffLimit (default 6) failures; a podFailurePolicy rule with
#   onExitCodes can instead Ignore a code (rerun, not counted) or FailJob.
# - vertex: "Understand the custom training service": a worker that exits
#   non-zero is restarted in place, up to 5 times, then the whole job up to
#   3 times, unless the failure is one of its listed common errors
#   (permanent); no exit code is singled out.
#   scheduling.restartJobOnWorkerRestart restarts the whole job instead.
# - slurm: slurm.conf RequeueExit (and RequeueExitHold) list the codes that
#   requeue a batch job; both are empty unless the site sets them.
#   `--requeue` is about node failure and preemption, not exit codes.
RETRIED_EXIT_CODES = {
    "tfjob": SchedulerRetry(
        runner="Kubeflow TFJob",
        setting="`restartPolicy: ExitCode`",
        codes=frozenset({130, 137, 138, 143}),
        note="every other code fails the job",
        source="https://github.com/kubeflow/training-operator/blob/master/"
               "pkg/util/train/train_util.go",
    ),
    "kubernetes": SchedulerRetry(
        runner="Kubernetes Job",
        setting="no `podFailurePolicy`",
        codes=_NONZERO,
        note="until `backoffLimit` (default 6) failures; a "
             "`podFailurePolicy` rule `action: Ignore` with "
             "`onExitCodes: {operator: In, values: [143]}` reruns it "
             "without counting",
        source="https://kubernetes.io/docs/concepts/workloads/controllers/"
               "job/#pod-failure-policy",
    ),
    "vertex": SchedulerRetry(
        runner="Vertex AI custom training",
        setting="default `scheduling`",
        codes=_NONZERO,
        note="the worker in place up to 5 times, then the job up to 3 "
             "times; failures Vertex lists as common errors are permanent",
        source="https://cloud.google.com/vertex-ai/docs/training/"
               "understanding-training-service",
    ),
    "slurm": SchedulerRetry(
        runner="SLURM",
        setting="`RequeueExit=` in slurm.conf",
        codes=frozenset(),
        note="the site lists them: add `RequeueExit=143`, or end the "
             "batch script (submitted with `--requeue`) with "
             "`[ $? -eq 143 ] && scontrol requeue $SLURM_JOB_ID`",
        source="https://slurm.schedmd.com/slurm.conf.html#OPT_RequeueExit",
    ),
}
"""Which exit codes each common job runner reruns a job for: a
`SchedulerRetry` (runner, setting, codes, note, source) by runner key
(`"tfjob"`, `"kubernetes"`, `"vertex"`, `"slurm"`)."""


def _codes_text(codes: frozenset) -> str:
    if codes == _NONZERO:
        return "every non-zero code"
    if not codes:
        return "none by default"
    return ", ".join(str(c) for c in sorted(codes))


# What `keras-mgpu launch` restarts a job for, besides a worker a signal
# ended: TFJob's transient codes (SIGKILL and SIGTERM as a shell reports
# them, the presets' 143, and 138 for users' own retryable errors), less
# 130: Ctrl-C is someone stopping the job.
LAUNCH_RESTART_EXIT_CODES = RETRIED_EXIT_CODES["tfjob"].codes - {130}
"""The exit codes `keras-mgpu launch` restarts a cluster for (137, 138,
143), besides a worker a signal ended."""


def exit_code_table() -> str:
    """`RETRIED_EXIT_CODES` as the Markdown table `docs/backup.md` shows."""
    lines = ["| job runner | setting | exit codes it reruns | limits "
             "| source |",
             "|---|---|---|---|---|"]
    for row in RETRIED_EXIT_CODES.values():
        lines.append(f"| {row.runner} | {row.setting} | "
                     f"{_codes_text(row.codes)} | {row.note} | "
                     f"[source]({row.source}) |")
    return "\n".join(lines)
