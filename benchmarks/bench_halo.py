"""Halo exchange: pympar's ``HaloExchange`` against raw mpi4py moving the same faces.

Run on 2 ranks or more (4 adds a 2 x 2 grid)::

    PYTHONPATH=. mpiexec -n 2 python benchmarks/bench_halo.py \\
        [--shapes 1024x1024,128x128x128] [--width 1] [--repeats 11] [--json PATH]

For every shape (float64, periodic along the split axes) and layout -- ``axis0``: the first axis
split over all ranks (contiguous faces), ``last``: the last axis split over all ranks
(strided faces), ``grid``: the first two axes split over a ``2 x P/2`` grid (4 ranks or
more) -- one exchange of the ghosts of width ``--width`` is timed, in interleaved rounds
(each sample: the slowest rank's time), as:

* ``pympar``: ``HaloExchange.exchange`` (a contiguous face as a plain buffer, others as
  subarray datatypes; the agreement check included);
* ``pympar_packed``: the same with ``faces="packed"`` (faces copied into reused buffers);
* ``raw_sendrecv``: the anchor, plain mpi4py: two ``Sendrecv`` per split axis on the same
  communicators, axis after axis, of each face as a slice of the array where it is one
  contiguous run of it, else as a committed subarray datatype (as ``pympar`` sends them);
* ``raw_neighbor``: plain mpi4py with one ``Neighbor_alltoallw`` per split axis on a
  periodic 1-D Cartesian communicator (the neighbourhood collective);
* ``pympar_adjoint``: ``HaloExchange.adjoint`` (sends the ghosts back and adds them).

``face_bytes`` is what one rank sends per exchange: along each split axis two faces of
``width`` cells over the padded extent of the axes before it and the block's extent of those
after it. The target is ``pympar <= 1.05 x raw_sendrecv``. Each ratio is the median over
rounds of the two variants' times in the same round (as ``bench_checkpoint.py`` pairs its
ratios): on this VM a case's times drift by 20-25 % between runs of a minute, and a round's
samples run within a tenth of a second of each other. ``ratio_of_medians`` is kept beside
it.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from pympar import Mesh  # noqa: E402
from pympar.decomposition import Decomposition  # noqa: E402
from pympar.halo import HaloExchange  # noqa: E402

WORLD = MPI.COMM_WORLD
TARGET = 1.05
VARIANTS = ("pympar", "pympar_packed", "raw_sendrecv", "raw_neighbor", "pympar_adjoint")


def raw_faces(comm: MPI.Comm, local: tuple[int, ...], padded: tuple[int, ...], axis: int,
              width: int) -> dict[str, tuple[MPI.Datatype, tuple[slice, ...]]]:
    """The four faces of one axis's exchange, written out plainly: each as a committed
    subarray type and as the index of the same cells."""
    sizes, starts = [], []
    for b, (n, m) in enumerate(zip(local, padded)):
        sizes.append(m if b < axis else n)
        starts.append(0 if b < axis else width)
    n = local[axis]
    out = {}
    for name, start in (("recv_lo", 0), ("send_up", n), ("recv_hi", width + n),
                        ("send_down", width)):
        sub, at = list(sizes), list(starts)
        sub[axis], at[axis] = width, start
        out[name] = (MPI.DOUBLE.Create_subarray(list(padded), sub, at).Commit(),
                     tuple(slice(a, a + k) for a, k in zip(at, sub)))
    return out


def raw_messages(buf: np.ndarray, faces: dict[str, tuple[MPI.Datatype, tuple]]) -> dict:
    """Each face of ``buf`` as plain mpi4py code sends it: the slice of ``buf`` where the
    face is one contiguous run of it (a plain buffer, which MPICH moves 4-5 us sooner than
    the same bytes as a datatype), else ``[buf, 1, subarray type]``."""
    return {name: buf[index] if buf[index].flags.c_contiguous else [buf, 1, t]
            for name, (t, index) in faces.items()}


def raw_exchanges(split: list[tuple[int, MPI.Comm]], local: tuple[int, ...], width: int,
                  buf: np.ndarray) -> tuple[Callable[[], None], Callable[[], None], Callable]:
    """The raw Sendrecv and neighbourhood-collective exchanges of ``buf``, and a cleanup."""
    padded = buf.shape
    plans, carts = [], []
    for axis, comm in split:
        faces = raw_faces(comm, local, padded, axis, width)
        types = {name: t for name, (t, _) in faces.items()}
        rank, size = comm.Get_rank(), comm.Get_size()
        cart = comm.Create_cart([size], periods=[True], reorder=False)
        carts.append(cart)
        plans.append((comm, cart, (rank - 1) % size, (rank + 1) % size, types,
                      raw_messages(buf, faces)))

    def sendrecv() -> None:
        for comm, _, lower, upper, _, m in plans:
            comm.Sendrecv(m["send_up"], upper, 1, m["recv_lo"], lower, 1)
            comm.Sendrecv(m["send_down"], lower, 2, m["recv_hi"], upper, 2)

    ones, zeros = [1, 1], [0, 0]

    def neighbor() -> None:
        for _, cart, _, _, t, _ in plans:  # neighbours of a 1-D cart: lower, then upper
            cart.Neighbor_alltoallw([buf, (ones, zeros), [t["send_down"], t["send_up"]]],
                                    [buf, (ones, zeros), [t["recv_lo"], t["recv_hi"]]])

    def free() -> None:
        for _, cart, _, _, t, _ in plans:
            for d in t.values():
                d.Free()
            cart.Free()
    return sendrecv, neighbor, free


def face_bytes(local: tuple[int, ...], split_axes: list[int], width: int) -> int:
    total = 0
    for a in split_axes:
        cells = math.prod((n + 2 * width) if b < a else (width if b == a else n)
                          for b, n in enumerate(local))
        total += 2 * cells * 8
    return total


def layouts(size: int) -> dict[str, dict[str, int]]:
    """Mesh sizes of each layout on ``size`` ranks."""
    out = {"axis0": {"x": size}, "last": {"x": size}}
    if size >= 4 and size % 2 == 0:
        out["grid"] = {"x": 2, "y": size // 2}
    return out


def measure(shape: tuple[int, ...], layout: str, sizes: dict[str, int], width: int,
            args: argparse.Namespace) -> dict[str, Any]:
    mesh = Mesh(WORLD, sizes, order="-".join(sizes))
    groups = [mesh.group(axis) for axis in sizes]
    axes = {"axis0": [0], "last": [len(shape) - 1], "grid": [0, 1]}[layout]
    # Periodic along the split axes only: no local wrap of the others, which raw skips.
    d = Decomposition(shape, dict(zip(axes, groups)), [a in axes for a in range(len(shape))])
    halos = {"pympar": HaloExchange(d, width), "pympar_packed": HaloExchange(d, width,
                                                                              faces="packed")}
    rng = np.random.default_rng(WORLD.rank)
    buf = halos["pympar"].empty()
    buf[...] = rng.standard_normal(buf.shape)
    sendrecv, neighbor, free = raw_exchanges([(a, g.comm) for a, g in zip(axes, groups)],
                                             d.local_shape, width, buf)
    # The variants must agree before any is timed.
    reference = buf.copy()
    sendrecv()
    want = buf.copy()
    for check in (neighbor, lambda: halos["pympar"].exchange(buf),
                  lambda: halos["pympar_packed"].exchange(buf)):
        buf[...] = reference
        check()
        if not np.array_equal(buf, want):
            raise AssertionError(f"bench_halo: a variant's ghosts differ from raw Sendrecv's "
                                 f"({shape}, {layout})")
    gradient = reference.copy()  # the adjoint's own array: it adds into it every call
    calls_of: dict[str, Callable[[], Any]] = {
        "pympar": lambda: halos["pympar"].exchange(buf),
        "pympar_packed": lambda: halos["pympar_packed"].exchange(buf),
        "raw_sendrecv": sendrecv, "raw_neighbor": neighbor,
        "pympar_adjoint": lambda: halos["pympar"].adjoint(gradient)}
    once = common.timed_parallel(WORLD, sendrecv, 3)
    calls = int(WORLD.bcast(min(1000, max(1, math.ceil(args.sample_seconds / max(once, 1e-7))))))
    samplers = {name: (lambda fn=fn: common.timed_parallel(WORLD, fn, calls))
                for name, fn in calls_of.items()}
    samples = common.interleaved(samplers, args.repeats, args.warmup, WORLD)
    median = {name: common.median(s) for name, s in samples.items()}
    free()
    for h in halos.values():
        h.free()
    for g in groups:
        g.free()
    mine = face_bytes(d.local_shape, axes, width)

    def paired(a: str, b: str) -> float:  # time of a over time of b, round by round
        return common.paired_ratio(samples[a], samples[b])

    return {"shape": list(shape), "layout": layout, "parts": list(d.parts), "width": width,
            "calls_per_sample": calls,
            "face_bytes_max": int(WORLD.allreduce(mine, op=MPI.MAX)),
            "median_us": {k: v * 1e6 for k, v in median.items()},
            "samples_us": {k: [t * 1e6 for t in v] for k, v in samples.items()},
            "ratio": paired("pympar", "raw_sendrecv"),
            "ratio_of_medians": median["pympar"] / median["raw_sendrecv"],
            "ratio_packed": paired("pympar_packed", "raw_sendrecv"),
            "neighbor_over_sendrecv": paired("raw_neighbor", "raw_sendrecv")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1024x1024,128x128x128",
                        help="global field shapes, comma-separated (e.g. 512x512,64x64x64)")
    parser.add_argument("--width", type=int, default=1, help="ghost cells per side")
    parser.add_argument("--repeats", type=int, default=11, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed samples per variant")
    parser.add_argument("--sample-seconds", type=float, default=0.005,
                        help="about how long one sample runs (calls per sample follow)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    if WORLD.size < 2:
        common.say(WORLD, "bench_halo: needs at least 2 ranks")
        return 2
    info = common.machine_info(WORLD)
    cases = []
    with common.blas_threads(1):
        for text in args.shapes.split(","):
            shape = tuple(int(n) for n in text.lower().split("x"))
            for layout, sizes in layouts(WORLD.size).items():
                if layout == "grid" and len(shape) < 2:
                    continue
                case = measure(shape, layout, sizes, args.width, args)
                cases.append(case)
                common.say(WORLD, f"  {text} {layout} w={args.width}: "
                                  + ", ".join(f"{k} {v:.1f} us" for k, v in
                                              case["median_us"].items())
                                  + f"; pympar / raw Sendrecv {case['ratio']:.3f}")
    nodes = common.nodes(WORLD)
    if WORLD.rank == 0:
        common.write_json(args.json, {"benchmark": "halo", "machine": info, "args": vars(args),
                                      "ranks": WORLD.size, "nodes": nodes, "target": TARGET,
                                      "cases": cases})
    return 0


if __name__ == "__main__":
    sys.exit(main())
