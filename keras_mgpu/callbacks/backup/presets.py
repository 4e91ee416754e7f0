"""The presets of `BackupAndRestore.from_preset`: named constructor arguments.

A preset is only a named set of constructor arguments: add one to `PRESETS`
(and to the table in docs/backup.md); `from_preset` and `list_presets` find
it there.
"""

from __future__ import annotations

from typing import Any

from keras_mgpu.cluster.exit_codes import RESTART_EXIT_CODE

PRESETS: dict[str, dict[str, Any]] = {
    "epoch": {
        "save_freq": "epoch",
        "keep": 2,
    },
    "preemptible": {
        "save_freq": 50,
        "keep": 2,
        "local_dir": "auto",
        "save_on_sigterm": True,
        "exit_code": RESTART_EXIT_CODE,
    },
    "multi_worker": {
        "save_freq": 200,
        "keep": 3,
        "local_dir": "auto",
        "save_on_sigterm": True,
        "exit_code": RESTART_EXIT_CODE,
    },
}


def list_presets() -> dict:
    """The presets of `BackupAndRestore.from_preset`, name to arguments.

    Example:

    >>> sorted(list_presets())
    ['epoch', 'multi_worker', 'preemptible']
    """
    return {name: dict(args) for name, args in PRESETS.items()}


def preset_arguments(name: str, overrides: dict) -> dict:
    """The constructor arguments of preset `name`, with `overrides` on top."""
    if name not in PRESETS:
        raise ValueError(
            f"Unknown BackupAndRestore preset {name!r}. Valid presets: "
            f"{sorted(PRESETS)}."
        )
    return {**PRESETS[name], **overrides}
