"""Micro-benchmark: pympar collectives and mappings against hand-written mpi4py code.

Run on 2 ranks (any number works; shapes are rounded to even splits)::

    PYTHONPATH=. OPENBLAS_NUM_THREADS=1 mpiexec -n 2 python benchmarks/bench_mappings.py \\
        [--sizes 1KiB,1MiB,16MiB] [--repeats 15] [--dtype float32] [--json PATH]

Each row times one operation on a per-rank input of the given size, writing into
``out=`` or, in the rows named "fresh", returning a new array. "raw" is the same
operation written by hand with mpi4py's uppercase buffer calls and, where the layout
requires it (last-axis gathers and reduce-scatters, all-to-all), the NumPy copy that
packs or unpacks rank-major blocks; "mpi" is the MPI call alone on the same bytes. Both
sides reuse the same preallocated buffers (pympar through ``out=``; in "fresh" rows
both allocate the result with ``numpy.empty``) and run interleaved, ABBA (raw first,
then pympar first), so drift and cache order effects cancel. Each sample is a batch of
calls between barriers, long enough to time; its time is the slowest rank's. The table
shows medians over the repeats; ratio and extra are medians of adjacent (raw, pympar)
pairs; "check" is the cost of the agreement check (pympar against itself with the
group's board replaced by one that agrees at once); "floor" is what the bare
minimum of any check made before the data call costs: raw code preceded by a handshake
of one word per rank in shared memory, written then polled, without any pympar code.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import nodes, timed_parallel  # noqa: E402
from pympar import _board, mappings  # noqa: E402
from pympar.collectives import balanced_sizes  # noqa: E402
from pympar.mesh import Mesh  # noqa: E402

WORLD = MPI.COMM_WORLD
UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6}

Case = tuple[str, Callable[[], Any], Callable[[], Any], Callable[[], Any]]
#: Operations that keep a block or return their input: no message, no agreement check.
LOCAL = ("copy_to_all", "scatter_to_hidden", "scatter_to_sequence")


def parse_size(text: str) -> int:
    """``"16MiB"`` -> 16777216."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 1KiB, 1MiB, 64MiB")
    return int(match.group(1)) * UNITS[match.group(2).upper()]


def show_size(nbytes: int) -> str:
    for unit, factor in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor} {unit}"
    return f"{nbytes} B"


def cases(group: Any, nbytes: int, dtype: np.dtype) -> list[Case]:
    """(name, raw, mpi-only, pympar) per operation, on a per-rank input of ``nbytes``.

    Each communicating operation appears twice: writing into a preallocated ``out=``
    (raw code reuses its buffer too), and "fresh", pympar's default of returning a new
    array (raw code allocates its result with ``numpy.empty`` the same way).
    """
    comm, p, r = group.comm, group.size, group.rank
    n = max(nbytes // dtype.itemsize, 2 * p * p)
    # x is [rows, hidden], both multiples of p so that every split is even;
    # rows * hidden is n rounded down to such a shape.
    rows = p * max(2, n // (1024 * p))
    hidden = max(p, n // rows // p * p)
    hp, rp = hidden // p, rows // p
    lo = r * hp
    rng = np.random.default_rng(r)
    x = rng.standard_normal((rows, hidden)).astype(dtype)
    stage = np.empty(p * rows * hidden, dtype)          # raw code's rank-major scratch
    # The MPI-only calls write elsewhere: a buffer they just warmed would favour raw.
    mpi_stage = np.empty(p * rows * hidden, dtype)
    s_rows, s_hidden = p * rows, p * hidden
    send = stage[:rows * hidden]
    shapes = {"reduced": x.shape, "rows": (p * rows, hidden), "hidden": (rows, p * hidden),
              "block_rows": (rp, hidden), "block_hidden": (rows, hp),
              "seq_to_hidden": (p * rows, hp), "hidden_to_seq": (rp, p * hidden)}
    kept = {name: np.empty(shape, dtype) for name, shape in shapes.items()}

    def pack_hidden() -> None:
        np.copyto(send.reshape(p, rows, hp), x.reshape(rows, p, hp).transpose(1, 0, 2))

    def gather_hidden(y: np.ndarray) -> np.ndarray:
        comm.Allgather(x, stage)
        np.copyto(y.reshape(rows, p, hidden), stage.reshape(p, rows, hidden).transpose(1, 0, 2))
        return y

    def reduce_scatter_hidden(y: np.ndarray) -> np.ndarray:
        pack_hidden()
        comm.Reduce_scatter_block(send, y)
        return y

    def seq_to_hidden(y: np.ndarray) -> np.ndarray:
        pack_hidden()
        comm.Alltoall(send, y)
        return y

    def hidden_to_seq(y: np.ndarray) -> np.ndarray:
        comm.Alltoall(x, send)
        np.copyto(y.reshape(rp, p, hidden), send.reshape(p, rp, hidden).transpose(1, 0, 2))
        return y

    def broadcast(y: np.ndarray) -> np.ndarray:
        if r == 0 and y is not x:
            y[...] = x
        comm.Bcast(y)
        return y

    raw = {
        "reduced": lambda y: comm.Allreduce(x, y, MPI.SUM),
        "rows": lambda y: comm.Allgather(x, y),
        "hidden": gather_hidden,
        "block_rows": lambda y: comm.Reduce_scatter_block(x, y),
        "block_hidden": reduce_scatter_hidden,
        "seq_to_hidden": seq_to_hidden,
        "hidden_to_seq": hidden_to_seq,
    }
    mpi = {
        "reduced": lambda: comm.Allreduce(x, kept["reduced"], MPI.SUM),
        "rows": lambda: comm.Allgather(x, kept["rows"]),
        "hidden": lambda: comm.Allgather(x, mpi_stage),
        "block_rows": lambda: comm.Reduce_scatter_block(x, kept["block_rows"]),
        "block_hidden": lambda: comm.Reduce_scatter_block(x, kept["block_rows"]),
        "seq_to_hidden": lambda: comm.Alltoall(x, mpi_stage[:rows * hidden]),
        "hidden_to_seq": lambda: comm.Alltoall(x, mpi_stage[:rows * hidden]),
    }
    M = mappings
    # (name, result kind, pympar call taking out=)
    ops: list[tuple[str, str, Callable[..., Any]]] = [
        ("all_reduce", "reduced", lambda out: group.all_reduce(x, out=out)),
        ("all_gather axis 0", "rows",
         lambda out: group.all_gather(x, 0, out=out, sizes=balanced_sizes(s_rows, p))),
        ("all_gather axis -1", "hidden",
         lambda out: group.all_gather(x, -1, out=out, sizes=balanced_sizes(s_hidden, p))),
        ("reduce_scatter axis 0", "block_rows", lambda out: group.reduce_scatter(x, 0, out=out)),
        ("reduce_scatter axis -1", "block_hidden",
         lambda out: group.reduce_scatter(x, -1, out=out)),
        ("all_to_all seq->hidden", "seq_to_hidden", lambda out: group.all_to_all(
            x, -1, 0, out=out, sizes=balanced_sizes(s_rows, p))),
        ("copy_to_all.backward", "reduced", lambda out: M.copy_to_all.backward(x, group, out=out)),
        ("reduce_from_all", "reduced", lambda out: M.reduce_from_all(x, group, out=out)),
        ("scatter_to_hidden.backward", "hidden", lambda out: M.scatter_to_hidden.backward(
            x, group, out=out, global_size=s_hidden)),
        ("gather_from_hidden", "hidden",
         lambda out: M.gather_from_hidden(x, group, out=out, global_size=s_hidden)),
        ("reduce_scatter_to_hidden", "block_hidden",
         lambda out: M.reduce_scatter_to_hidden(x, group, out=out)),
        ("scatter_to_sequence.backward", "rows", lambda out: M.scatter_to_sequence.backward(
            x, group, out=out, global_size=s_rows)),
        ("gather_from_sequence", "rows",
         lambda out: M.gather_from_sequence(x, group, out=out, global_size=s_rows)),
        ("gather_from_sequence.backward", "block_rows",
         lambda out: M.gather_from_sequence.backward(x, group, out=out)),
        ("reduce_scatter_to_sequence", "block_rows",
         lambda out: M.reduce_scatter_to_sequence(x, group, out=out)),
        ("all_to_all_from_sequence_to_hidden", "seq_to_hidden",
         lambda out: M.all_to_all_from_sequence_to_hidden(x, group, out=out, global_size=s_rows)),
        ("all_to_all_from_hidden_to_sequence", "hidden_to_seq",
         lambda out: M.all_to_all_from_hidden_to_sequence(x, group, out=out,
                                                          global_size=s_hidden)),
    ]
    keep_hidden = lambda: np.ascontiguousarray(x[:, lo:lo + hp])  # noqa: E731
    keep_rows = lambda: np.ascontiguousarray(x[r * rp:(r + 1) * rp])  # noqa: E731
    out: list[Case] = [
        ("broadcast", lambda: broadcast(x), lambda: comm.Bcast(x),
         lambda: group.broadcast(x, 0, out=x)),
        ("broadcast fresh", lambda: broadcast(np.empty_like(x)), lambda: comm.Bcast(x),
         lambda: group.broadcast(x, 0)),
        ("copy_to_all", lambda: x, lambda: x, lambda: M.copy_to_all(x, group)),
        ("scatter_to_hidden", keep_hidden, keep_hidden, lambda: M.scatter_to_hidden(x, group)),
        ("scatter_to_sequence", keep_rows, keep_rows, lambda: M.scatter_to_sequence(x, group)),
    ]
    for name, kind, ours in ops:
        shape, move, buffer = shapes[kind], raw[kind], kept[kind]
        out.append((name, functools.partial(move, buffer), mpi[kind],
                    functools.partial(ours, buffer)))
        out.append((name + " fresh", lambda move=move, shape=shape: move(np.empty(shape, dtype)),
                    mpi[kind], functools.partial(ours, None)))
    return out


def handshake(comm: MPI.Intracomm) -> Callable[[], None] | None:
    """A bare agreement handshake on ``comm``'s ranks, or None when they span nodes.

    Each call writes one word per rank into shared memory (the mapping of
    :mod:`pympar._board`, used here for its memory only) and polls until every rank wrote
    the same count: the least any check made before a data call can cost, with nothing
    of pympar's path around it.
    """
    board = _board.create(comm)
    if board is None or not board.shared:
        return None
    slots, size, rank = board.slots, comm.Get_size(), comm.Get_rank()
    count = 0

    def meet() -> None:
        nonlocal count
        count = (count + 1) & 0xFFFFFFFF
        lo = (count & 1) * size
        slots[lo + rank] = count
        for q in range(lo, lo + size):
            polls = 0
            while slots[q] != count:
                polls += 1
                if polls > 1000:  # more ranks than cores: let the others run
                    os.sched_yield()
    return meet


class _Agreeing:
    """A board whose check agrees at once: pympar's path without its agreement check."""

    shared = True

    def agree(self, sig: int, group: Any, what: str, timeout: float | None) -> bool:
        return True


def measure(group: Any, raw: Callable, mpi_only: Callable, ours: Callable,
            repeats: int, warmup: int, meet: Callable[[], None] | None) -> dict[str, Any]:
    """Medians over interleaved samples (raw, pympar, pympar unchecked, floor, mpi; ABBA).

    ``ratio`` and ``extra`` are medians of the per-pair ratios and differences of adjacent
    raw and pympar samples, which cancels slow drift of the machine; ``check_us`` the
    median difference between pympar with its default agreement check and pympar with
    the check switched off (:class:`_Agreeing` in place of the board); ``floor_us`` the
    median difference between raw code preceded by ``meet`` (see :func:`handshake`) and
    raw code alone (None without ``meet``).
    """
    comm = group.comm

    def floor() -> None:
        meet()
        raw()

    for fn in (raw, mpi_only, ours) + ((floor,) if meet else ()):
        for _ in range(warmup):
            fn()
    single = timed_parallel(comm, ours, 3)
    # Batches of >= ~2 ms so timer and barrier noise stay small at 1 KiB.
    calls = comm.bcast(max(1, min(2000, int(2e-3 / max(single, 1e-7)))))
    def unchecked() -> float:
        state = group._state
        board, state.board = state.board, _Agreeing()
        try:
            return timed_parallel(comm, ours, calls)
        finally:
            state.board = board

    raws, ourss, offs, floors, mpis = [], [], [], [], []
    for i in range(repeats):
        # ABBA: alternate which side runs first, so neither always inherits the
        # caches (or the drift) the other left behind.
        if i % 2:
            ourss.append(timed_parallel(comm, ours, calls))
            offs.append(unchecked())
            raws.append(timed_parallel(comm, raw, calls))
            if meet:
                floors.append(timed_parallel(comm, floor, calls))
        else:
            if meet:
                floors.append(timed_parallel(comm, floor, calls))
            raws.append(timed_parallel(comm, raw, calls))
            offs.append(unchecked())
            ourss.append(timed_parallel(comm, ours, calls))
        mpis.append(timed_parallel(comm, mpi_only, calls))
    med = statistics.median
    return {"raw_us": med(raws) * 1e6, "pympar_us": med(ourss) * 1e6, "mpi_us": med(mpis) * 1e6,
            "ratio": med(o / r for o, r in zip(ourss, raws) if r > 0),
            "extra_us": med(o - r for o, r in zip(ourss, raws)) * 1e6,
            "check_us": med(o - f for o, f in zip(ourss, offs)) * 1e6,
            "floor_us": med(f - r for f, r in zip(floors, raws)) * 1e6 if meet else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1KiB,1MiB,16MiB",
                        help="comma-separated bytes per rank, 1KiB .. 64MiB")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--only", default="", help="run the operations whose name contains this")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    dtype = np.dtype(args.dtype)
    group = Mesh(WORLD, {"w": WORLD.size}).group("w")
    meet = handshake(group.comm)
    rows = []
    for nbytes in sizes:
        for name, raw, mpi_only, ours in cases(group, nbytes, dtype):
            if args.only not in name:
                continue
            # The rows that move nothing between ranks are never checked: no floor.
            communicates = name.split(" ")[0] not in LOCAL
            timing = measure(group, raw, mpi_only, ours, args.repeats, args.warmup,
                             meet if communicates else None)
            rows.append({"op": name, "bytes": nbytes, "communicates": communicates, **timing})
    on_nodes = nodes(WORLD)  # collective: before the ranks but 0 return
    if WORLD.rank != 0:
        return
    header = f"{'op':40} {'size':>7} {'raw us':>10} {'pympar us':>10} {'ratio':>6} " \
             f"{'extra us':>9} {'check us':>9} {'floor us':>9} {'mpi us':>10}"
    print(f"# {WORLD.size} ranks, {dtype}, median of {args.repeats}; "
          f"{MPI.Get_library_version().splitlines()[0].strip()}")
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['op']:40} {show_size(row['bytes']):>7} {row['raw_us']:10.1f} "
              f"{row['pympar_us']:10.1f} {row['ratio']:6.3f} {row['extra_us']:9.2f} "
              f"{row['check_us']:9.2f} {row['floor_us'] or 0:9.2f} {row['mpi_us']:10.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"ranks": WORLD.size, "nodes": on_nodes, "dtype": str(dtype),
             "repeats": args.repeats,
             "mpi": MPI.Get_library_version().splitlines()[0].strip(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
