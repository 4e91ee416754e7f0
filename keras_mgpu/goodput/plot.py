"""`keras-mgpu goodput --plot`: a job's time as a chart, one row per attempt.

The x axis is the job's wall time from its start; each attempt's row is a
bar from its start to its end, cut into its categories (their totals, not
their order in time: the ledger keeps sums), and the gap before it (the
time between attempts, the launcher's start) and after it (training after
its last record, redone) on the same row. A first row shows the job's
totals. Needs matplotlib (the `plot` extra), imported only here.
"""

from __future__ import annotations

from keras_mgpu import _plotting
from keras_mgpu.goodput.report import REPORT_CATEGORIES
from keras_mgpu.goodput.report import JobGoodput

# One colour per category, the same in every chart: greens for training,
# greys for set-up, reds for what was lost.
COLORS = {
    "productive": "#2ca02c",
    "input_wait": "#98df8a",
    "compile": "#9467bd",
    "startup": "#7f7f7f",
    "restore": "#17becf",
    "checkpoint": "#1f77b4",
    "evaluation": "#bcbd22",
    "redone": "#d62728",
    "between_attempts": "#ff9896",
    "other": "#c7c7c7",
}


def check_plot_format(path: str) -> None:
    """Refuses a `--plot` path whose chart could not be drawn, before the
    log is read (`keras_mgpu._plotting.check_plot_format`)."""
    _plotting.check_plot_format(path, "goodput")


def _unit(seconds: float) -> tuple:
    """The x axis's unit for a job this long: (name, seconds in it)."""
    if seconds >= 3 * 3600:
        return "hours", 3600.0
    if seconds >= 180:
        return "minutes", 60.0
    return "seconds", 1.0


def figure(job: JobGoodput):
    """The chart `plot` writes, as an open matplotlib `Figure` (close it
    with `matplotlib.pyplot.close(fig)`).

    Rows from the top: the job's totals, then each attempt on the job's
    time axis.
    """
    matplotlib = _plotting.matplotlib_for("goodput")
    # No display needed: the chart goes to a file.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, scale = _unit(job.wall_seconds)
    rows = ["job"] + [f"attempt {a.index}" + (
        f" (launch {a.launch_attempt})" if a.launch_attempt is not None
        else "") for a in job.attempts]
    fig, ax = plt.subplots(figsize=(9, 2.2 + 0.4 * len(rows)))
    drawn = set()

    def bar(row: int, left: float, seconds: dict,
            order: tuple = REPORT_CATEGORIES) -> None:
        for key in order:
            width = seconds.get(key, 0.0)
            if width <= 0:
                continue
            ax.barh(row, width / scale, left=left / scale, height=0.6,
                    color=COLORS[key], edgecolor="white", linewidth=0.5,
                    label=None if key in drawn else key.replace("_", " "))
            drawn.add(key)
            left += width

    bar(0, 0.0, job.seconds)
    for row, attempt in enumerate(job.attempts, 1):
        bar(row, attempt.started - job.started, attempt.seconds)
    for gap in job.gaps:
        redone = gap.seconds["redone"]
        if redone > 0 and gap.after is not None:
            # Trained after its last record: the end of the failed
            # attempt's row, where it happened.
            bar(gap.after, gap.started - job.started, {"redone": redone})
        # In the order they happened: a new launcher starts last.
        bar(gap.before, gap.started + redone - job.started, gap.seconds,
            ("between_attempts", "startup"))
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlim(0, max(job.wall_seconds, job.ended - job.started) / scale
                or 1)
    ax.set_xlabel(f"{unit} since the job started")
    ax.grid(axis="x", alpha=0.3)
    # The legend in the table's order, right of the axes (`plot` saves
    # with a tight bounding box, which takes it in).
    handles, labels = ax.get_legend_handles_labels()
    order = [k.replace("_", " ") for k in REPORT_CATEGORIES]
    pairs = sorted(zip(handles, labels), key=lambda p: order.index(p[1]))
    ax.legend([h for h, _ in pairs], [label for _, label in pairs],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8,
              frameon=False)
    ax.set_title(f"keras-mgpu goodput: {job.goodput:.1%} productive over "
                 f"{len(job.attempts)} attempt"
                 f"{'s' if len(job.attempts) > 1 else ''}")
    fig.tight_layout()
    return fig


def plot(job: JobGoodput, path: str) -> None:
    """Writes the chart of `job` to `path` (the extension names the format).

    Args:
        job: What `keras_mgpu.goodput.read_job` returned.
        path: The image file to write.

    Raises:
        ImportError: matplotlib is not installed (with the install command).
        OSError: the file could not be written.
    """
    fig = figure(job)  # first: it explains a missing matplotlib
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=100, bbox_inches="tight")
    finally:
        plt.close(fig)
