"""Console lines the callbacks print, the way Keras's own callbacks do."""

import sys

import keras
from absl import logging as absl_logging


def print_msg(text: str) -> None:
    """Keras's own `print_msg` (`keras/src/utils/io_utils.py`), which its
    progress bar prints with, from public API: a line on stdout, flushed, or
    an absl log line when Keras's interactive logging is off."""
    if keras.config.is_interactive_logging_enabled():
        sys.stdout.write(f"{text}\n")
        sys.stdout.flush()
    else:
        absl_logging.info(text)
