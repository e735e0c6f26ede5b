"""Communication volume per rank: a ``Linear3D`` pair against a Column+Row pair.

Run on a cube of ranks, ``d**3`` (8 or 27)::

    PYTHONPATH=. mpiexec -n 8 python benchmarks/bench_comm_volume.py \\
        [--shapes 8192x1024x4096,13x9x35] [--json PATH]

A shape ``NxHxF`` is an MLP ``H -> F -> H`` on ``N`` tokens (rows), float32,
run forward and backward once with biases:

* 3D: ``Linear3D(H, F) -> GELU -> Linear3D(F, H, swap=True)`` on the cube of
  depth ``d``, every rank holding its block of the input;
* 1D: ``ColumnParallelLinear(H, F, gather_output=False) -> GELU ->
  RowParallelLinear(F, H, input_is_parallel=True)`` over all ``d**3`` ranks, the
  input replicated.

:mod:`pympar.stats` records, per rank, every collective's group, operation,
input bytes (``bytes_in``) and result bytes (``bytes_out``). The script
compares those totals, per (group kind, operation) and per rank, with the
closed-form counts of :func:`mlp_3d_counts` and :func:`mlp_1d_counts`, which
know nothing of pympar's code beyond the layouts documented in
:mod:`pympar.modules.layers_3d`. It also reports the *exchanged* bytes per
rank (see :func:`exchanged_bytes`), the figure to compare layouts by.
benchmarks/README.md derives the formulas.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.report import show_size  # noqa: E402
from pympar import manager, stats  # noqa: E402
from pympar.modules import (GELU, ColumnParallelLinear, Layout3D, Linear3D,  # noqa: E402
                            RowParallelLinear, Sequential, layout_3d)

WORLD = MPI.COMM_WORLD
DEFAULT_SHAPES = "8192x1024x4096,2048x256x1024,13x9x35"

#: (group kind, operation) -> [calls, bytes_in, bytes_out]
Counts = dict[tuple[str, str], list[int]]


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"8192x1024x4096,13x9x35"`` -> ``[(8192, 1024, 4096), (13, 9, 35)]`` (N, H, F)."""
    shapes = []
    for item in text.split(","):
        if item.strip():
            try:
                n, h, f = (int(v) for v in item.lower().split("x"))
            except ValueError:
                raise argparse.ArgumentTypeError(f"bad shape {item!r}; use NxHxF, e.g. 64x16x64")
            shapes.append((n, h, f))
    return shapes


# --------------------------------------------------------------------------- formulas


def part(n: int, parts: int, index: int) -> int:
    """Size of block ``index`` when ``n`` items are split over ``parts`` (first ``n % parts`` get one more)."""
    q, r = divmod(n, parts)
    return q + (1 if index < r else 0)


def sub(n: int, parts: int, outer: int, inner: int) -> int:
    """Size of sub-block ``inner`` of block ``outer`` (both levels split ``parts`` ways)."""
    return part(part(n, parts, outer), parts, inner)


def _add(counts: Counts, kind: str, op: str, bytes_in: int, bytes_out: int) -> None:
    row = counts.setdefault((kind, op), [0, 0, 0])
    row[0] += 1
    row[1] += bytes_in
    row[2] += bytes_out


def linear_3d_counts(tokens: int, fin: int, fout: int, d: int, a: int, w: int, c: int,
                     kinds: tuple[str, str, str], itemsize: int, bias: bool,
                     counts: Counts | None = None) -> Counts:
    """Closed-form stats counts of one ``Linear3D`` forward + backward on one rank.

    Parameters
    ----------
    tokens, fin, fout : int
        Rows of the full input, input and output features.
    d : int
        Cube depth.
    a, w, c : int
        This rank's position in the layer's input, weight and output groups.
    kinds : (str, str, str)
        The group kinds (e.g. ``"3d_input"``) acting as the layer's input,
        weight and output groups (input and output exchanged when ``swap``).
    itemsize : int
        Bytes per element.
    bias : bool
        Whether the layer has a bias.
    counts : dict, optional
        Totals to add to (a new dict by default).

    Returns
    -------
    dict
        ``(kind, operation) -> [calls, bytes_in, bytes_out]``.
    """
    counts = {} if counts is None else counts
    gi, gw, go = kinds
    s = itemsize
    rows_w = part(tokens, d, w)               # rows of block w
    x_loc = sub(tokens, d, w, a)              # my input rows: sub-block a of block w
    y_loc = sub(tokens, d, w, c)              # my output rows: sub-block c of block w
    cin = part(fin, d, c)                     # my input columns / weight columns
    wrows = part(fout, d, a)                  # weight rows of block a (after gathering)
    wloc = sub(fout, d, a, w)                 # my weight rows: sub-block w of block a
    # forward
    _add(counts, gi, "all_gather", s * x_loc * cin, s * rows_w * cin)         # x over input
    _add(counts, gw, "all_gather", s * wloc * cin, s * wrows * cin)           # W over weight
    _add(counts, go, "reduce_scatter", s * rows_w * wrows, s * y_loc * wrows)  # y over output
    if bias:
        _add(counts, gw, "all_gather", s * wloc, s * wrows)                   # b over weight
    # backward
    _add(counts, go, "all_gather", s * y_loc * wrows, s * rows_w * wrows)     # dy over output
    _add(counts, gw, "reduce_scatter", s * wrows * cin, s * wloc * cin)       # dW over weight
    if bias:
        _add(counts, gw, "reduce_scatter", s * wrows, s * wloc)               # db over weight
    _add(counts, gi, "reduce_scatter", s * rows_w * cin, s * x_loc * cin)     # dx over input
    return counts


def mlp_3d_counts(tokens: int, hidden: int, ffn: int, d: int, a: int, w: int, c: int,
                  itemsize: int, bias: bool = True) -> Counts:
    """Counts of ``Linear3D(H, F) -> GELU -> Linear3D(F, H, swap=True)``, forward + backward.

    ``a, w, c`` are the rank's positions in the ``3d_input``, ``3d_weight`` and
    ``3d_output`` groups; the second layer exchanges the input and output groups.
    """
    kinds = ("3d_input", "3d_weight", "3d_output")
    counts = linear_3d_counts(tokens, hidden, ffn, d, a, w, c, kinds, itemsize, bias)
    swapped = (kinds[2], kinds[1], kinds[0])
    return linear_3d_counts(tokens, ffn, hidden, d, c, w, a, swapped, itemsize, bias, counts)


def mlp_1d_counts(tokens: int, hidden: int, itemsize: int) -> Counts:
    """Counts of ``ColumnParallelLinear -> GELU -> RowParallelLinear``, forward + backward.

    One all-reduce of the ``(N, H)`` output forward (``reduce_from_all``) and one
    of the ``(N, H)`` input gradient backward (``copy_to_all``); the biases need
    no communication.
    """
    nbytes = itemsize * tokens * hidden
    return {("tp", "reduce_from_all.forward"): [1, nbytes, nbytes],
            ("tp", "copy_to_all.backward"): [1, nbytes, nbytes]}


#: The collective behind each communicating direction of a mapping (stats label).
MAPPING_COLLECTIVES = {
    "copy_to_all.backward": "all_reduce", "reduce_from_all.forward": "all_reduce",
    "scatter_to_hidden.backward": "all_gather", "gather_from_hidden.forward": "all_gather",
    "reduce_scatter_to_hidden.forward": "reduce_scatter",
    "reduce_scatter_to_hidden.backward": "all_gather",
    "scatter_to_sequence.backward": "all_gather", "gather_from_sequence.forward": "all_gather",
    "gather_from_sequence.backward": "reduce_scatter",
    "reduce_scatter_to_sequence.forward": "reduce_scatter",
    "reduce_scatter_to_sequence.backward": "all_gather",
}


def exchanged_bytes(operation: str, group_size: int, bytes_in: int, bytes_out: int) -> Fraction:
    """Bytes a rank exchanges in one collective, from its stats counts.

    * all-gather: ``bytes_out - bytes_in``, what it receives from the others;
    * reduce-scatter: ``bytes_in - bytes_out``, the part of its input that it
      contributes to the other ranks' blocks (what a ring or pairwise
      algorithm sends);
    * all-reduce: ``2 (p - 1) / p * bytes_in``, a reduce-scatter plus an
      all-gather (what the bandwidth-optimal ring sends).

    Linear in the counts, so it applies to totals of calls on one group.
    """
    kind = MAPPING_COLLECTIVES.get(operation, operation)
    if kind == "all_gather":
        return Fraction(bytes_out - bytes_in)
    if kind == "reduce_scatter":
        return Fraction(bytes_in - bytes_out)
    if kind == "all_reduce":
        return Fraction(2 * (group_size - 1) * bytes_in, group_size)
    raise ValueError(f"no exchange rule for {operation!r}")


def total_exchanged(counts: Counts, sizes: dict[str, int]) -> Fraction:
    """Sum of :func:`exchanged_bytes` over a rank's counts (``sizes``: group kind -> size)."""
    return sum((exchanged_bytes(op, sizes[kind], b_in, b_out)
                for (kind, op), (_, b_in, b_out) in counts.items()), Fraction(0))


def even_3d_elements(tokens: int, hidden: int, ffn: int, d: int, bias: bool = True) -> Fraction:
    """Exchanged elements per rank of the 3D MLP when every split is even.

    ``4 (d-1)/d^3 (N H + N F + H F) + 2 (d-1)/d^2 (H + F)`` (the last term: biases).
    """
    e = Fraction(4 * (d - 1), d ** 3) * (tokens * hidden + tokens * ffn + hidden * ffn)
    return e + (Fraction(2 * (d - 1), d * d) * (hidden + ffn) if bias else 0)


def even_1d_elements(tokens: int, hidden: int, p: int) -> Fraction:
    """Exchanged elements per rank of Column+Row over ``p`` ranks: ``4 (p-1)/p N H``."""
    return Fraction(4 * (p - 1), p) * tokens * hidden


# --------------------------------------------------------------------------- measurement


def group_kind(name: str) -> str:
    """The axis key of a group name: ``"3d_input-1-3"`` -> ``"3d_input"``, ``"dp-cp-3"`` -> ``"dp-cp"``."""
    return "-".join(t for t in name.split("-") if not t.isdigit())


def by_kind(recorder: stats.Recorder) -> Counts:
    """A recorder's rows summed per (group kind, operation), seconds dropped.

    A layer's label is dropped: ``"Linear3D.forward:all_gather"`` counts as ``"all_gather"``.
    """
    out: Counts = defaultdict(lambda: [0, 0, 0])
    for (group, op), (calls, b_in, b_out, _) in recorder.rows.items():
        row = out[(group_kind(group), op.rpartition(":")[2])]
        row[0] += calls
        row[1] += b_in
        row[2] += b_out
    return dict(out)


def measure_3d(tokens: int, hidden: int, ffn: int, dtype: Any = np.float32, bias: bool = True,
               layout: Layout3D | None = None, seed: int = 0) -> Counts:
    """Run the 3D MLP forward + backward once and return this rank's counts by kind."""
    layout = layout_3d() if layout is None else layout
    model = Sequential(Linear3D(hidden, ffn, bias=bias, dtype=dtype, seed=seed, layout=layout),
                       GELU(),
                       Linear3D(ffn, hidden, bias=bias, dtype=dtype, seed=seed + 1,
                                layout=layout.swapped()))
    rng = np.random.default_rng(seed)
    x = layout.split_input(rng.standard_normal((tokens, hidden)).astype(dtype))
    # The second layer's output layout is the first layer's input layout.
    dy = layout.split_input(rng.standard_normal((tokens, hidden)).astype(dtype))
    with stats.record() as rec:
        model.forward(x)
        model.backward(dy)
    return by_kind(rec)


def measure_1d(tokens: int, hidden: int, ffn: int, dtype: Any = np.float32, bias: bool = True,
               group: Any = None, seed: int = 0) -> Counts:
    """Run the Column+Row MLP forward + backward once and return this rank's counts by kind."""
    model = Sequential(
        ColumnParallelLinear(hidden, ffn, bias=bias, gather_output=False, dtype=dtype,
                             group=group, seed=seed),
        GELU(),
        RowParallelLinear(ffn, hidden, bias=bias, input_is_parallel=True, dtype=dtype,
                          group=group, seed=seed + 1))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden)).astype(dtype)
    dy = rng.standard_normal((tokens, hidden)).astype(dtype)
    with stats.record() as rec:
        model.forward(x)
        model.backward(dy)
    return by_kind(rec)


def compare(tokens: int, hidden: int, ffn: int, dtype: Any = np.float32,
            bias: bool = True) -> dict[str, Any]:
    """Measure both layouts on this rank and set the formulas beside them.

    Needs a current 3D parallel state (``initialize_parallel(d**3,
    tensor_parallel_mode="3d")``). Collective.

    Returns
    -------
    dict
        This rank's ``{"coords": (a, w, c), "3d": {...}, "1d": {...}}``; each
        layout has ``measured`` and ``formula`` counts (lists of
        ``[kind, op, calls, bytes_in, bytes_out]``), their totals, the
        exchanged bytes of both, and ``equal`` (counts identical).
    """
    layout = layout_3d()
    d = layout.depth
    a, w, c = layout.input.rank, layout.weight.rank, layout.output.rank
    itemsize = np.dtype(dtype).itemsize
    tp = manager.get_tensor_parallel_group()
    sizes = {"3d_input": d, "3d_weight": d, "3d_output": d, "tp": tp.size}
    result: dict[str, Any] = {"coords": (a, w, c)}
    for name, measured, formula in (
            ("3d", measure_3d(tokens, hidden, ffn, dtype, bias, layout),
             mlp_3d_counts(tokens, hidden, ffn, d, a, w, c, itemsize, bias)),
            ("1d", measure_1d(tokens, hidden, ffn, dtype, bias, tp),
             mlp_1d_counts(tokens, hidden, itemsize))):
        result[name] = {
            "measured": _as_rows(measured), "formula": _as_rows(formula),
            "equal": measured == formula,
            "bytes_in": sum(r[1] for r in measured.values()),
            "bytes_out": sum(r[2] for r in measured.values()),
            "formula_bytes_in": sum(r[1] for r in formula.values()),
            "formula_bytes_out": sum(r[2] for r in formula.values()),
            "exchanged": float(total_exchanged(measured, sizes)),
            "formula_exchanged": float(total_exchanged(formula, sizes)),
        }
    return result


def _as_rows(counts: Counts) -> list[list[Any]]:
    return [[kind, op, *values] for (kind, op), values in sorted(counts.items())]


def summarize(per_rank: list[dict[str, Any]], tokens: int, hidden: int, ffn: int,
              d: int, itemsize: int) -> dict[str, Any]:
    """Rank-0 summary of one shape: per layout min/mean/max over ranks and the even formulas."""
    p = d ** 3
    out: dict[str, Any] = {"tokens": tokens, "hidden": hidden, "ffn": ffn, "depth": d, "ranks": p,
                           "itemsize": itemsize}
    even = {"3d": even_3d_elements(tokens, hidden, ffn, d) * itemsize,
            "1d": even_1d_elements(tokens, hidden, p) * itemsize}
    for layout in ("3d", "1d"):
        rows = [r[layout] for r in per_rank]
        ex = [r["exchanged"] for r in rows]
        out[layout] = {
            "all_equal": all(r["equal"] for r in rows),
            "bytes_in": [r["bytes_in"] for r in rows],
            "bytes_out": [r["bytes_out"] for r in rows],
            "formula_bytes_in": [r["formula_bytes_in"] for r in rows],
            "formula_bytes_out": [r["formula_bytes_out"] for r in rows],
            "exchanged": ex,
            "formula_exchanged": [r["formula_exchanged"] for r in rows],
            "exchanged_min": min(ex), "exchanged_mean": sum(ex) / len(ex), "exchanged_max": max(ex),
            "even_formula_exchanged": float(even[layout]),
            "calls": sum(c[2] for c in rows[0]["measured"]),
            "rank0_measured": rows[0]["measured"],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES),
                        help="comma-separated TOKENSxHIDDENxFFN")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    comm = WORLD
    size = comm.Get_size()
    d = round(size ** (1 / 3))
    if d ** 3 != size or d < 2:
        common.say(comm, f"bench_comm_volume: needs a cube of ranks (8, 27, ...), got {size}")
        return 2
    info = common.machine_info(comm)
    dtype = np.dtype(args.dtype)
    manager.initialize_parallel(size, tensor_parallel_mode="3d", comm=comm)
    shapes = []
    try:
        for tokens, hidden, ffn in args.shapes:
            mine = compare(tokens, hidden, ffn, dtype)
            per_rank = comm.gather(mine, root=0)
            if comm.Get_rank() == 0:
                summary = summarize(per_rank, tokens, hidden, ffn, d, dtype.itemsize)
                shapes.append(summary)
                print(format_summary(summary), flush=True)
    finally:
        manager.destroy_parallel()
    if comm.Get_rank() == 0:
        common.write_json(args.json, {"benchmark": "comm_volume", "machine": info,
                                      "dtype": dtype.name, "shapes": shapes})
        if not all(s[k]["all_equal"] for s in shapes for k in ("3d", "1d")):
            print("bench_comm_volume: MEASURED BYTES DIFFER FROM THE FORMULA", flush=True)
            return 1
    return 0


def format_summary(s: dict[str, Any]) -> str:
    """One shape's summary as text lines."""
    lines = [f"  N={s['tokens']} H={s['hidden']} F={s['ffn']} on {s['ranks']} ranks (d={s['depth']})"]
    for layout, label in (("3d", "Linear3D pair"), ("1d", "Column+Row")):
        r = s[layout]
        lo, hi = show_size(r["exchanged_min"]), show_size(r["exchanged_max"])
        lines.append(f"    {label:14} exchanged/rank {lo if lo == hi else lo + ' .. ' + hi} (even-split "
                     f"formula {show_size(r['even_formula_exchanged'])}), calls {r['calls']}, "
                     f"measured == formula on every rank: {r['all_equal']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
