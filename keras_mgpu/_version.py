"""The package version, in one place: pyproject.toml reads it, modules import it."""

__version__ = "0.1.0"
"""The installed keras-mgpu's version."""
