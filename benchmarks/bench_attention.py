"""Context-parallel attention: ring against Ulysses (``ContextAttention``, float32).

Run on 4 ranks (2 or more work; the zig-zag part needs 4)::

    PYTHONPATH=. mpiexec -n 4 python benchmarks/bench_attention.py \\
        [--seq 4096] [--batch 1] [--hidden 256] [--heads 8] [--repeats 7] [--json PATH]

Four measurements, each of one attention forward + backward:

* ``bytes``: per-rank bytes that :mod:`pympar.stats` counts for ring and Ulysses at
  CP = all ranks, against their formulas (``e`` bytes per element, ``n_r`` rows of rank ``r``,
  ``B`` batch, ``H`` hidden, ``h_r`` heads of rank ``r`` in Ulysses, ``dh`` head size).
  Ring sends key/value blocks: forward ``sum_{t<P-1} 2 n_{r-t} B H e``, backward that plus
  ``sum_{t<P} 2 n_{r-t} B H e`` (the gradient blocks). Ulysses hands its all-to-alls
  ``4 n_r B H e + 4 S B h_r dh e`` (``8 n B H e`` when even; a share ``1/P`` of it stays on
  the rank).
* ``time``: median time at CP=2 (the first two ranks; the others sleep), ring and Ulysses
  sampled in interleaved rounds.
* ``memory``: peak bytes NumPy allocates per rank (tracemalloc) at CP = all ranks, for the
  sequence ``--seq`` and ``4 x --seq``.
* ``zigzag``: causal ring attention at CP=4, per-rank compute time (CPU time in the block
  kernels, so neither waiting for the ring nor sharing a core counts) for the contiguous and
  the zig-zag order; the spread is ``(max - min) / mean`` over ranks of the per-rank medians.
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from pympar import stats  # noqa: E402
from pympar.group import Group  # noqa: E402
from pympar.modules import ContextAttention, ring_attention, sequence_segments  # noqa: E402
from pympar.partition import balanced_sizes  # noqa: E402

WORLD = MPI.COMM_WORLD
DTYPE = np.float32


def first_ranks(size: int) -> Group | None:
    """A group of world ranks ``0 .. size-1`` (collective); None on the other ranks."""
    comm = WORLD.Split(0 if WORLD.rank < size else MPI.UNDEFINED, WORLD.rank)
    if comm == MPI.COMM_NULL:
        return None
    return Group(comm, "cp-" + "-".join(map(str, range(size))), list(range(size)))


def inputs(group: Group, seq: int, batch: int, hidden: int, layout: str) -> tuple[Any, Any]:
    """This rank's rows of a seeded input and output gradient."""
    rows = np.concatenate([np.arange(a, b) for a, b in
                           sequence_segments(seq, group.size, group.rank, layout)])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((seq, batch, hidden)).astype(DTYPE)
    dy = (rng.standard_normal((seq, batch, hidden)) / seq).astype(DTYPE)
    return np.ascontiguousarray(x[rows]), np.ascontiguousarray(dy[rows])


def step(layer: ContextAttention, x: Any, dy: Any) -> None:
    """One forward + backward with fresh gradients."""
    layer.zero_grad(set_to_none=True)
    layer.forward(x)
    layer.backward(dy)


def measure_bytes(group: Group, args: argparse.Namespace) -> dict[str, Any]:
    p, r, e = group.size, group.rank, np.dtype(DTYPE).itemsize
    n = balanced_sizes(args.seq, p)
    heads = balanced_sizes(args.heads, p)[r]
    kv = [2 * n[(r - t) % p] * args.batch * args.hidden * e for t in range(p)]
    formula = {"ring": 2 * sum(kv[:p - 1]) + sum(kv),
               "ulysses": 4 * n[r] * args.batch * args.hidden * e
               + 4 * args.seq * args.batch * heads * (args.hidden // args.heads) * e}
    measured = {}
    for scheme in ("ring", "ulysses"):
        layer = ContextAttention(args.hidden, args.heads, scheme, group=group, dtype=DTYPE)
        x, dy = inputs(group, args.seq, args.batch, args.hidden, "contiguous")
        with stats.record() as rec:
            step(layer, x, dy)
        measured[scheme] = sum(row[1] for (name, _), row in rec.rows.items() if name == group.name)
    rows = group.comm.gather({"rank": r, "measured": measured, "formula": formula}, root=0)
    return {"cp": p, "per_rank": rows,
            "equal": all(row["measured"] == row["formula"] for row in rows) if rows else None}


def measure_time(group: Group | None, args: argparse.Namespace) -> dict[str, Any]:
    samplers: dict[str, Callable[[], float]] = {}
    for scheme in ("ring", "ulysses"):
        run: Callable[[], float] = lambda: 0.0  # noqa: E731 - ranks outside the pair
        if group is not None:
            layer = ContextAttention(args.hidden, args.heads, scheme, group=group, dtype=DTYPE)
            x, dy = inputs(group, args.seq, args.batch, args.hidden, "contiguous")
            run = (lambda layer=layer, x=x, dy=dy:  # noqa: E731
                   common.timed_parallel(group.comm, lambda: step(layer, x, dy)))

        def sample(run: Callable[[], float] = run) -> float:
            t = run()
            common.sleep_barrier(WORLD)
            return WORLD.bcast(t, root=0)
        samplers[scheme] = sample
    samples = common.interleaved(samplers, args.repeats, args.warmup, WORLD)
    return {"cp": 2, "median_ms": {k: common.median(v) * 1e3 for k, v in samples.items()},
            "samples_ms": {k: [round(s * 1e3, 3) for s in v] for k, v in samples.items()}}


def measure_memory(group: Group, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for seq in (args.seq, 4 * args.seq):
        for scheme in ("ring", "ulysses"):
            layer = ContextAttention(args.hidden, args.heads, scheme, group=group, dtype=DTYPE)
            x, dy = inputs(group, seq, args.batch, args.hidden, "contiguous")
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            step(layer, x, dy)
            peak = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.stop()
            out[f"{scheme} S={seq}"] = group.comm.allreduce(peak, op=MPI.MAX)
    return {"cp": group.size, "peak_bytes_max_over_ranks": out}


def measure_zigzag(group: Group, args: argparse.Namespace) -> dict[str, Any]:
    # CPU time (not wall time: ranks may share cores, and they wait for each other in the
    # ring) spent in the block math of ring attention, accumulated by wrapping the two
    # kernels that ring_attention calls.
    spent = [0.0]

    def timed(kernel: Callable[..., None]) -> Callable[..., None]:
        def run(*a: Any) -> None:
            start = time.process_time()
            kernel(*a)
            spent[0] += time.process_time() - start
        return run

    kernels = (ring_attention.attend_block, ring_attention.attend_block_backward)
    ring_attention.attend_block, ring_attention.attend_block_backward = map(timed, kernels)
    result: dict[str, Any] = {"cp": group.size}
    try:
        for layout in ("contiguous", "zigzag"):
            layer = ContextAttention(args.hidden, args.heads, "ring", group=group, causal=True,
                                     layout=layout, dtype=DTYPE)
            x, dy = inputs(group, args.seq, args.batch, args.hidden, layout)
            times = []
            for i in range(args.warmup + args.repeats):
                group.barrier()
                spent[0] = 0.0
                step(layer, x, dy)
                if i >= args.warmup:
                    times.append(spent[0])
            per_rank = group.comm.allgather(common.median(times))
            result[layout] = {"compute_ms": [t * 1e3 for t in per_rank],
                              "spread": (max(per_rank) - min(per_rank)) / float(np.mean(per_rank))}
    finally:
        ring_attention.attend_block, ring_attention.attend_block_backward = kernels
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096, help="sequence length S")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per variant")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    if WORLD.size < 2:
        common.say(WORLD, "bench_attention: needs at least 2 ranks")
        return 2
    info = common.machine_info(WORLD)
    everyone = Group(WORLD, "cp-all", list(range(WORLD.size)), owns_comm=False)
    pair, four = first_ranks(2), first_ranks(4) if WORLD.size >= 4 else None
    with common.blas_threads(1):
        common.say(WORLD, f"bench_attention: S={args.seq} B={args.batch} H={args.hidden} "
                          f"heads={args.heads} on {WORLD.size} ranks")
        result = {"bytes": measure_bytes(everyone, args)}
        common.say(WORLD, f"  bytes: {result['bytes']}")
        result["time"] = measure_time(pair, args)
        common.say(WORLD, f"  time at CP=2 (ms): {result['time']['median_ms']}")
        result["memory"] = measure_memory(everyone, args)
        common.say(WORLD, f"  peak memory (bytes): {result['memory']['peak_bytes_max_over_ranks']}")
        if four is not None:
            result["zigzag"] = measure_zigzag(four, args)
        result["zigzag"] = WORLD.bcast(result.get("zigzag"), root=0)
        common.say(WORLD, f"  causal ring at CP=4: {result['zigzag']}")
    if WORLD.rank == 0:
        common.write_json(args.json, {"benchmark": "attention", "machine": info,
                                      "args": vars(args), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
