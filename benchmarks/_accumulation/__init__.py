"""The accumulation benchmark; `benchmarks/accumulation.py` is the command.

- `configs`: the configurations compared (plain fit, Keras's built-in,
  window and in-step mode) and how each wraps and compiles a model;
- `timing`: the timed runs, configurations side by side, epoch by epoch;
- `ratios`: the target ratios from those timings;
- `memory`: `--memory`, peak memory, one subprocess per configuration.
"""
