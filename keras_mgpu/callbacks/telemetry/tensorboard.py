"""The TensorBoard layout of a record: Keras `TensorBoard`'s runs and tags,
the one place that layout lives."""

from __future__ import annotations


def tensorboard_scalars(record: dict) -> list:
    """A record's TensorBoard series, in Keras `TensorBoard`'s layout.

    Returns `[(run, step, {tag: value})]`. Keras's own names come first:
    `epoch_<metric>` (step: the epoch) in the `train` run, and without the
    `val_` prefix in the `validation` run, which also has
    `evaluation_<metric>_vs_iterations` (step: the global step);
    `epoch_learning_rate` and `epoch_steps_per_second`; window records give
    `batch_<metric>` and `batch_steps_per_second` at the global step. The
    telemetry follows in named groups, `<group>/epoch_<name>` or
    `<group>/batch_<name>`: `throughput`, `input`, `distribution` (with more
    than one worker), `mixed_precision` (with a loss scale), `accumulation`
    (with a `GradientAccumulationModel`) and `memory` (with GPUs); window
    and `goodput` records add the time ledger, `goodput/<category>` (seconds
    since the attempt began) and `goodput/goodput`. A value
    the run does not have is not written, nor are the run's constants
    (`workers`, `replicas`: in the JSONL records).
    """
    kind = record["kind"]
    if kind == "resume":
        return [("train", record["step"], {"resume": record["resume"]["text"]})]
    if kind == "goodput":
        return [("train", record["step"], _goodput(record["goodput"]))]
    prefix = "batch_" if kind == "window" else "epoch_"
    step = record["step"] if kind == "window" else record["epoch"]
    train, validation = {}, {}
    for name, value in record["metrics"].items():
        if name.startswith("val_"):
            validation[f"epoch_{name[4:]}"] = value
        else:
            train[f"{prefix}{name}"] = value
    if kind == "epoch":
        train["epoch_learning_rate"] = record["learning_rate"]
    train[f"{prefix}steps_per_second"] = record["steps"] / record["seconds"]
    groups = {
        "throughput": {
            "examples_per_sec": record["examples_per_sec"],
            "examples_per_sec_per_replica": (
                record["examples_per_sec_per_replica"]
                if record["replicas"] > 1 else None),
            "step_time_mean": record["step_time_mean"],
            "step_time_max": record["step_time_max"],
        },
        "input": {"wait": record["input_wait"]},
        "mixed_precision": {"loss_scale": record["loss_scale"],
                            "skipped_steps": record["skipped_steps"]},
        "accumulation": {"grad_norm": record["grad_norm"]},
        "memory": {f"{device}_{key}": value
                   for device, figures in record["memory"].items()
                   for key, value in figures.items()},
    }
    if record["workers"] > 1:
        groups["distribution"] = {
            f"{name}_{stat}": (spread or {}).get(stat)
            for name, spread in (
                ("step_time", record["worker_step_time"]),
                ("examples_per_sec", record["worker_examples_per_sec"]),
                ("input_wait", record["worker_input_wait"]))
            for stat in ("min", "mean", "max")
        }
        groups["distribution"]["slowest_worker"] = record["slowest_worker"]
    for group, values in groups.items():
        for name, value in values.items():
            train[f"{group}/{prefix}{name}"] = value
    if kind == "window" and record["goodput"] is not None:
        train.update(_goodput(record["goodput"]))
    out = [("train", step, _present(train))]
    if validation:
        out.append(("validation", step, _present(validation)))
        out.append(("validation", record["step"], {
            f"evaluation_{tag[len('epoch_'):]}_vs_iterations": value
            for tag, value in _present(validation).items()}))
    return out


def _goodput(ledger: dict) -> dict:
    """The time ledger's tags (at the global step): `goodput/<category>`,
    seconds since the attempt began, and `goodput/goodput`, the
    productive share of them."""
    seconds = ledger["seconds"]
    wall = ledger["time"] - ledger["attempt"]["started"]
    values = {f"goodput/{name}": value for name, value in seconds.items()}
    values["goodput/goodput"] = seconds["productive"] / wall if wall > 0 else None
    return _present(values)


def _present(values: dict) -> dict:
    return {tag: float(value) for tag, value in values.items()
            if value is not None}
