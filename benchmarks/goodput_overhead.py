"""What the goodput ledger costs a training step, in one run.

Trains the MLP of `logging_overhead.py` with `DistributedLogger` and
`BackupAndRestore` (every `--save-freq` steps), twice per round, taking
turns: with the ledger as it is, and with the ledger's methods replaced by
ones that do nothing (the control). Two figures:

- the share of each epoch spent inside the ledger's own methods (every call
  the runtime, the backup and the logger make), timed around each call:
  steady on a shared machine;
- the paired epoch-time ratio, ledger over control, median over rounds
  (with the quartiles: it shows the machine's noise).

    python benchmarks/goodput_overhead.py
    python benchmarks/goodput_overhead.py --rounds 10 --update-freq 1
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _timing import EpochTimer  # noqa: E402
from logging_overhead import build, mlp_arguments, mlp_data  # noqa: E402

from keras_mgpu.callbacks import BackupAndRestore, DistributedLogger  # noqa: E402
from keras_mgpu.goodput.ledger import TimeLedger  # noqa: E402

_METHODS = ("enter", "leave", "set_training", "move", "snapshot")


@contextlib.contextmanager
def timed_ledger(seconds: list):
    """The ledger's methods, each call's time added to `seconds[0]`."""
    originals = {name: getattr(TimeLedger, name) for name in _METHODS}

    def timed(method):
        @functools.wraps(method)
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[0] += time.perf_counter() - start
        return call

    for name, method in originals.items():
        setattr(TimeLedger, name, timed(method))
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(TimeLedger, name, method)


@contextlib.contextmanager
def no_ledger():
    """The control: the ledger's methods do nothing (a snapshot is the
    same empty one every time)."""
    originals = {name: getattr(TimeLedger, name) for name in _METHODS}
    empty = {"time": 0.0, "attempt": {"started": 0.0}, "seconds": {
        "productive": 0.0}}
    for name in _METHODS:
        setattr(TimeLedger, name,
                (lambda self, *a, **k: empty) if name == "snapshot"
                else (lambda self, *a, **k: None))
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(TimeLedger, name, method)


def main(argv=None) -> dict:
    parser = mlp_arguments(__doc__.splitlines()[0])
    parser.add_argument("--update-freq", type=int, default=100)
    parser.add_argument("--save-freq", type=int, default=100)
    args = parser.parse_args(argv)
    data, _, _ = mlp_data(args)
    root = tempfile.mkdtemp(prefix="goodput_overhead_")
    times: dict = {"ledger": [], "control": []}
    shares = []
    try:
        models = {name: build(args.features, args.width) for name in times}
        for round_ in range(args.rounds):
            for name, model in models.items():
                where = os.path.join(root, f"{name}{round_}")
                timer = EpochTimer()
                spent = [0.0]
                scope = (timed_ledger(spent) if name == "ledger"
                         else no_ledger())
                with scope:
                    model.fit(data, epochs=args.epochs, verbose=0, callbacks=[
                        timer.start,
                        DistributedLogger(os.path.join(where, "logs"),
                                          update_freq=args.update_freq,
                                          console=False),
                        BackupAndRestore(os.path.join(where, "backup"),
                                         save_freq=args.save_freq),
                        timer.stop])
                # The first epoch holds tracing and set-up: not timed.
                times[name].append(sum(timer.times[1:]))
                if name == "ledger":
                    # Epoch 0's share is counted with the rest: the ledger
                    # costs the same there, and tracing only dilutes it.
                    shares.append(spent[0] / sum(timer.times))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    ratios = sorted(a / b for a, b in zip(times["ledger"], times["control"]))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (
        ratios * 3)
    epoch = statistics.median(times["control"]) / (args.epochs - 1)
    result = {
        "steps_per_epoch": args.steps,
        "control_epoch_s": epoch,
        "step_ms": 1e3 * epoch / args.steps,
        "ledger_share_median": statistics.median(shares),
        "ledger_share_max": max(shares),
        "ratio_median": statistics.median(ratios),
        "ratio_quartiles": (quartiles[0], quartiles[2]),
    }
    print(f"MLP {args.features}-{args.width}-{args.width}-1, batch "
          f"{args.batch}, {args.steps} steps per epoch, "
          f"update_freq={args.update_freq}, save_freq={args.save_freq}, "
          f"{args.rounds} rounds")
    print(f"control epoch: {epoch:.3f} s ({result['step_ms']:.2f} ms/step)")
    print(f"inside the ledger: {100 * result['ledger_share_median']:.3f}% "
          f"of the epoch (median; max {100 * result['ledger_share_max']:.3f}%)")
    print(f"epoch time, ledger / control: {result['ratio_median']:.3f} "
          f"(quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f})")
    return result


if __name__ == "__main__":
    main()
