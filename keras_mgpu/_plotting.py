"""What the command line's charts share (`bench --plot`, `goodput --plot`):
matplotlib, imported only when a chart is asked for, and the check of a
`--plot` path before any work. Standard library only at import."""

from __future__ import annotations

import os


def matplotlib_for(command: str):
    """matplotlib, or an `ImportError` naming `command` and the extra."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            f"keras-mgpu {command} --plot needs matplotlib: "
            'pip install "keras-mgpu[plot]"') from None
    return matplotlib


def check_plot_format(path: str, command: str = "bench") -> None:
    """Refuses a `--plot` path whose chart could not be drawn, before any
    work: matplotlib missing, or an extension that names no format it
    writes.

    Args:
        path: The `--plot` path.
        command: Defaults to `"bench"`. The subcommand, for the message.

    Raises:
        ImportError: matplotlib is not installed (naming the extra).
        ValueError: naming the path and the formats there are.

    Example:

    >>> check_plot_format("scaling.png")
    >>> check_plot_format("scaling.json")
    Traceback (most recent call last):
    ...
    ValueError: --plot: 'scaling.json' does not end in an image format \
matplotlib writes; use e.g. 'scaling.png' (formats: avif, eps, ...).
    """
    matplotlib_for(command)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    formats = sorted(FigureCanvasAgg.get_supported_filetypes())
    stem, extension = os.path.splitext(path)
    if extension[1:].lower() not in formats:
        raise ValueError(
            f"--plot: {path!r} does not end in an image format matplotlib "
            f"writes; use e.g. {stem + '.png'!r} (formats: "
            f"{', '.join(formats)}).")
