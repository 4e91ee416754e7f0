"""`keras-mgpu bench` output: the results as a text table and as a chart.

Both read the payload `keras_mgpu._bench.combine` returns (the `--json`
file, schema in `keras_mgpu._bench`). The chart needs matplotlib (the `plot`
extra), imported only when a chart is drawn.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from keras_mgpu._plotting import check_plot_format  # noqa: F401
from keras_mgpu._plotting import matplotlib_for


def _fmt(value: Optional[float], spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def format_table(payload: Mapping[str, Any]) -> str:
    """The results as an aligned text table, with notes."""
    header = ("replicas", "precision", "accum", "global batch", "step ms",
              "examples/s", "efficiency", "peak mem", "input alone/s",
              "input wait")
    rows = [header]
    for r in payload["results"]:
        peak = r["peak_memory_bytes"]
        rows.append((
            str(r["replicas"]), r["policy"],
            "-" if r["accum_steps"] == 1 else str(r["accum_steps"]),
            str(r["global_batch_size"]), f"{r['step_time_ms']:.1f}",
            f"{r['examples_per_s']:,.0f}",
            _fmt(r["scaling_efficiency"] and 100 * r["scaling_efficiency"],
                 ".0f") + ("%" if r["scaling_efficiency"] is not None else ""),
            "n/a" if peak is None else f"{peak / 2**20:,.0f} MiB",
            f"{r['input_examples_per_s']:,.0f}",
            _fmt(r["input_wait_fraction"], ".1%"),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if j not in (1,) else c.ljust(w)
                       for j, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    settings = payload["settings"]
    out = [f"keras-mgpu bench: {settings['model']}, batch "
           f"{settings['batch_size']} per replica, {settings['steps']} steps "
           f"x {settings['repeats']} repeats (median)", ""] + lines
    if payload["mixed_precision"]:
        out += ["", "Mixed precision vs float32:"]
        for m in payload["mixed_precision"]:
            change = m["peak_memory_change"]
            out.append(
                f"  {m['replicas']} replica(s), accum {m['accum_steps']}: "
                f"{m['policy']} speed-up {m['speedup']:.2f}x, peak memory "
                + ("n/a (CPU)" if change is None else f"{change:+.0%}"))
    out += ["", "efficiency = examples/s(N) / (N x examples/s(1 replica))",
            f"{payload['input_wait']['note']}"]
    for note in payload["notes"]:
        out.append(f"NOTE: {note}")
    return "\n".join(out)


def plot(payload: Mapping[str, Any], path: str) -> None:
    """Writes a PNG: throughput and efficiency against replicas, with the ideal.

    Args:
        payload: The results, as `combine` returns them (the `--json` file).
        path: Where the PNG goes.

    Example:

    >>> plot(json.load(open("bench.json")), "scaling.png")  # doctest: +SKIP
    """
    fig = figure(payload)  # first: it explains a missing matplotlib
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def figure(payload: Mapping[str, Any]):
    """The chart `plot` writes, as an open matplotlib `Figure`.

    Throughput (examples/s, from zero, with the linear ideal dotted) on the
    left, scaling efficiency in percent (100% dotted) on the right. Close it
    with `matplotlib.pyplot.close(fig)`.

    Args:
        payload: The results, as `combine` returns them (the `--json` file).

    Returns:
        A `matplotlib.figure.Figure` with the two axes, in that order.

    Example:

    >>> fig = figure(json.load(open("bench.json")))  # doctest: +SKIP
    >>> fig.axes[1].get_ylabel()  # doctest: +SKIP
    'scaling efficiency (%)'
    """
    matplotlib = matplotlib_for("bench")
    # No display needed: the chart goes to a file.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_eff) = plt.subplots(1, 2, figsize=(11, 4.5))
    configs: dict[tuple, list] = {}
    for r in payload["results"]:
        configs.setdefault((r["policy"], r["accum_steps"]), []).append(r)
    replicas = sorted({r["replicas"] for r in payload["results"]})
    for (policy, accum), rows in configs.items():
        rows = sorted(rows, key=lambda r: r["replicas"])
        label = policy + (f", accum {accum}" if accum > 1 else "")
        xs = [r["replicas"] for r in rows]
        line, = ax_tp.plot(xs, [r["examples_per_s"] for r in rows], "o-",
                           label=label)
        base = rows[0]
        ax_tp.plot(xs, [base["examples_per_s"] * x / base["replicas"]
                        for x in xs], ":", color=line.get_color())
        # In percent, as the table shows it.
        eff = [(x, 100 * r["scaling_efficiency"]) for x, r in zip(xs, rows)
               if r["scaling_efficiency"] is not None]
        if eff:
            ax_eff.plot([e[0] for e in eff], [e[1] for e in eff], "o-",
                        color=line.get_color(), label=label)
    # One legend entry for the dotted ideals, whatever their colours.
    ax_tp.plot([], [], ":", color="gray", label="linear ideal")
    ax_eff.axhline(100, linestyle=":", color="gray", label="ideal")
    for ax, ylabel in ((ax_tp, "examples/s"),
                       (ax_eff, "scaling efficiency (%)")):
        ax.set_xlabel("replicas")
        ax.set_ylabel(ylabel)
        ax.set_xticks(replicas)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    # From zero: an axis cut just below the lowest point makes a small
    # scaling loss look like a collapse.
    ax_tp.set_ylim(bottom=0)
    ax_eff.set_ylim(0, max(110, *(100 * (r["scaling_efficiency"] or 0)
                                  for r in payload["results"])))
    title = f"keras-mgpu bench: {payload['settings']['model']}"
    if payload["device"]["kind"] == "cpu":
        title += ("\nCPU logical devices: mechanics, not GPU performance")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
