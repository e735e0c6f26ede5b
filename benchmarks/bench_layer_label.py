"""Micro-benchmark: what the agreement of a tensor-parallel layer costs per forward.

Run on 2 ranks::

    PYTHONPATH=. OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/bench_layer_label.py \\
        [--repeats 31] [--calls 2000] [--json PATH]

``ColumnParallelLinear.forward`` starts with one agreement (``Module.agreement``) on its
label (sizes and flags) and its input, and runs its body inside the label. The anchor is
the same layer whose agreement only returns the label block (no check), on the same
input, timed in the same job, interleaved ABBA so drift cancels. Each sample is ``--calls`` calls between
barriers (the slowest rank's time); the table shows medians over the repeats and the median
of the adjacent pairs' differences. Two layers: one with no collective in its forward
(``gather_output=False``: the agreement alone), one with an all-gather
(``gather_output=True``: the agreement, and the gather's check under a longer label).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import timed_parallel  # noqa: E402
from pympar import manager  # noqa: E402
from pympar.modules import ColumnParallelLinear  # noqa: E402

WORLD = MPI.COMM_WORLD


def measure(gather: bool, repeats: int, calls: int) -> dict:
    """Median microseconds per forward with and without the label, and of their difference."""
    layer = ColumnParallelLinear(64, 64, gather_output=gather, seed=1)
    bare_layer = ColumnParallelLinear(64, 64, gather_output=gather, seed=1)
    bare_layer.agreement = lambda direction, *args, **kwargs: bare_layer._labels[direction]
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    labelled, bare = (lambda: layer.forward(x)), (lambda: bare_layer.forward(x))
    timed_parallel(WORLD, labelled, calls)  # warm the plans and buffers
    with_label, without, extra = [], [], []
    for r in range(repeats):
        pair = [(bare, without), (labelled, with_label)]
        for fn, into in (pair if r % 2 == 0 else pair[::-1]):
            into.append(timed_parallel(WORLD, fn, calls) * 1e6)
        extra.append(with_label[-1] - without[-1])
    return {"gather_output": gather, "with_label_us": statistics.median(with_label),
            "without_us": statistics.median(without), "extra_us": statistics.median(extra)}


def main() -> None:
    """Parse the options, measure both layers, print a table on rank 0 (and write JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    manager.initialize_parallel(WORLD.size)
    rows = [measure(gather, args.repeats, args.calls) for gather in (False, True)]
    manager.destroy_parallel()
    if WORLD.rank == 0:
        print(f"ColumnParallelLinear(64->64) forward, x (8, 64) float32, {WORLD.size} ranks, "
              f"median of {args.repeats} x {args.calls} calls")
        print(f"{'gather_output':>14} {'label us':>9} {'bare us':>9} {'extra us':>9}")
        for row in rows:
            print(f"{row['gather_output']!s:>14} {row['with_label_us']:9.2f} "
                  f"{row['without_us']:9.2f} {row['extra_us']:9.2f}")
        if args.json:
            args.json.write_text(json.dumps({"ranks": WORLD.size, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
