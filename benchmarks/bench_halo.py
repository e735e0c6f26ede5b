"""Halo exchange: pympar's ``HaloExchange`` against raw mpi4py moving the same faces, and PETSc.

Run on 2 ranks or more (4 adds a 2 x 2 grid)::

    PYTHONPATH=. mpiexec -n 2 python benchmarks/bench_halo.py \\
        [--shapes 1024x1024,128x128x128] [--periodic all,none] [--width 1] \\
        [--repeats 11] [--json PATH] [--petsc-python PATH | --no-petsc]

For every shape (float64), layout -- ``axis0``: the first axis split over all ranks
(contiguous faces), ``last``: the last axis split over all ranks (strided faces), ``grid``:
the first two axes split over a ``2 x P/2`` grid (4 ranks or more) -- and boundary --
``all``: every axis periodic, so an axis that is not split wraps onto the rank itself (a
slab's everyday case), ``none``: walls everywhere, ``split``: periodic along the split axes
only -- one exchange of the ghosts of width ``--width`` (corners included) is timed, in
interleaved rounds (each sample: the slowest rank's time), as:

* ``pympar``: ``HaloExchange.exchange`` with its default faces (the agreement check
  included); ``pympar_subarray`` and ``pympar_packed`` (where some face is strided): with
  ``faces="subarray"`` and ``faces="packed"``;
* ``raw_sendrecv``: the anchor, plain mpi4py as a user writes it: along each split axis two
  ``Sendrecv`` on the same communicators, a face as a slice of the array where it is one
  contiguous run of it, else as a committed subarray datatype; along an axis that is
  periodic but not split, two slice copies (``u[..., 0] = u[..., -2]``);
* ``raw_packed`` (where some face is strided): the same with each strided face copied into
  a reused contiguous buffer and out of one (none toward or from ``MPI_PROC_NULL``);
* ``raw_neighbor``: one ``Neighbor_alltoallw`` per split axis on a 1-D Cartesian
  communicator (the neighbourhood collective), the same local copies;
* ``pympar_adjoint``: ``HaloExchange.adjoint`` (sends the ghosts back and adds them);
* ``petsc_global_to_local`` and ``petsc_local_to_local``, where ``petsc4py`` is importable:
  a PETSc DMDA of the same shape, split, boundaries and stencil width (box stencil:
  corners), updating the ghosts of a local vector from a global one (``globalToLocal``,
  which also copies the interior) and in place from local vectors (``localToLocal``).

``face_bytes`` is what one rank sends per exchange (largest rank). The target is
``pympar <= 1.05 x`` the faster raw Sendrecv code of the case (``anchor``: ``raw_sendrecv``,
or ``raw_packed`` where its median is lower). Each ratio is the median over rounds of the
two variants' times in the same round (as ``bench_checkpoint.py`` pairs its ratios): on this
VM a case's times drift by 20-25 % between runs of a minute, and a round's samples run
within a tenth of a second of each other.

Debian's ``python3-petsc4py`` is built on Debian's Open MPI and its own Python, so the
PETSc variants run in a job of their own: when ``--petsc-python`` (default:
``$PYMPAR_PETSC_PYTHON``, else ``.venv-petsc/bin/python`` in this repository, where it
exists) names such an interpreter, rank 0 starts this script again under the ``mpiexec``
beside it, with the same cases, and the JSON holds that job's results under ``petsc_job``
(pympar and raw Sendrecv run there too, so PETSc's ratios pair with raw code of the same
job). ``docs/howto/benchmarks.rst`` says how to make that environment.
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

from benchmarks import common, halo_petsc  # noqa: E402
from pympar import Mesh  # noqa: E402
from pympar.decomposition import Decomposition  # noqa: E402
from pympar.halo import HaloExchange  # noqa: E402

WORLD = MPI.COMM_WORLD
TARGET = 1.05
VARIANTS = ("pympar", "pympar_subarray", "pympar_packed", "raw_sendrecv", "raw_packed",
            "raw_neighbor", "pympar_adjoint", *halo_petsc.VARIANTS)
#: The variants that differ from others only where some face is strided.
STRIDED_ONLY = ("pympar_subarray", "pympar_packed", "raw_packed")
BOUNDARIES = ("all", "none", "split")


def raw_faces(local: tuple[int, ...], padded: tuple[int, ...], axis: int,
              width: int) -> dict[str, tuple[slice, ...]]:
    """The four faces of one axis's exchange, written out plainly as indices: over the
    padded extent of the axes before ``axis`` and the block of those after it."""
    n = local[axis]
    out = {}
    for name, start in (("recv_lo", 0), ("send_up", n), ("recv_hi", width + n),
                        ("send_down", width)):
        index = [slice(0, m) if b < axis else slice(width, width + k)
                 for b, (k, m) in enumerate(zip(local, padded))]
        index[axis] = slice(start, start + width)
        out[name] = tuple(index)
    return out


def subarray(padded: tuple[int, ...], index: tuple[slice, ...]) -> MPI.Datatype:
    """The committed float64 subarray datatype of ``index`` in an array of ``padded``."""
    return MPI.DOUBLE.Create_subarray(list(padded), [s.stop - s.start for s in index],
                                      [s.start for s in index]).Commit()


def raw_exchanges(d: Decomposition, width: int, buf: np.ndarray) -> tuple[dict, Callable]:
    """The raw exchanges of ``buf`` (``raw_sendrecv``, ``raw_packed``, ``raw_neighbor``)
    and a cleanup. Along a split axis each face travels as a slice where it is contiguous;
    else as a subarray datatype, or packed through a reused buffer."""
    padded, types, carts = buf.shape, [], []
    steps: list[tuple] = []  # per exchanged axis, in order

    def message(index: tuple[slice, ...], packed: bool) -> tuple[Any, np.ndarray | None]:
        view = buf[index]
        if view.flags.c_contiguous:
            return view, None
        if packed:
            return np.empty(view.shape), view
        types.append(subarray(padded, index))
        return [buf, 1, types[-1]], None

    for axis in range(d.ndim):
        group, split = d.groups[axis], d.parts[axis] > 1
        if not (split or d.periodic[axis]):
            continue
        f = raw_faces(d.local_shape, padded, axis, width)
        if not split:  # alone on a periodic axis: two slice copies
            steps.append(("wrap", f))
            continue
        lower, upper = d.neighbours(axis)
        cart = group.comm.Create_cart([group.size], periods=[d.periodic[axis]],
                                      reorder=False)
        carts.append(cart)
        kinds = [subarray(padded, f[name]) for name in ("send_down", "send_up", "recv_lo",
                                                        "recv_hi")]
        types.extend(kinds)
        steps.append(("split", group.comm, lower, upper, cart, kinds,
                      {packed: {name: message(index, packed) for name, index in f.items()}
                       for packed in (False, True)}, f))

    def wrap(f: dict[str, tuple[slice, ...]]) -> None:  # two slice copies
        buf[f["recv_lo"]] = buf[f["send_up"]]
        buf[f["recv_hi"]] = buf[f["send_down"]]

    def exchange(packed: bool) -> None:
        for step in steps:
            if step[0] == "wrap":
                wrap(step[1])
                continue
            _, comm, lower, upper, _, _, messages, f = step
            m = messages[packed]
            for send, dest, recv, source, tag in (("send_up", upper, "recv_lo", lower, 1),
                                                  ("send_down", lower, "recv_hi", upper, 2)):
                (out, face), (into, unpacked) = m[send], m[recv]
                if face is not None and dest != MPI.PROC_NULL:
                    out[...] = face
                comm.Sendrecv(out, dest, tag, into, source, tag)
                if unpacked is not None and source != MPI.PROC_NULL:
                    buf[f[recv]] = into

    ones, zeros = [1, 1], [0, 0]

    def neighbor() -> None:
        for step in steps:
            if step[0] == "wrap":
                wrap(step[1])
                continue
            cart, (down, up, lo, hi) = step[4], step[5]  # neighbours: lower, then upper
            cart.Neighbor_alltoallw([buf, (ones, zeros), [down, up]],
                                    [buf, (ones, zeros), [lo, hi]])

    def free() -> None:
        for t in types:
            t.Free()
        for cart in carts:
            cart.Free()
    return {"raw_sendrecv": lambda: exchange(False), "raw_packed": lambda: exchange(True),
            "raw_neighbor": neighbor}, free


def strided(d: Decomposition, width: int, padded: tuple[int, ...]) -> bool:
    """Whether some face of a split axis is not one contiguous run of the padded array."""
    probe = np.empty(padded, np.uint8)
    return any(not probe[index].flags.c_contiguous
               for a in range(d.ndim) if d.parts[a] > 1
               for index in raw_faces(d.local_shape, padded, a, width).values())


def face_bytes(d: Decomposition, width: int, padded: tuple[int, ...]) -> int:
    """Bytes this rank sends per exchange (float64): each split axis's faces to neighbours."""
    total = 0
    for a in range(d.ndim):
        if d.parts[a] > 1:
            faces = raw_faces(d.local_shape, padded, a, width)
            lower, upper = d.neighbours(a)
            cells = math.prod(s.stop - s.start for s in faces["send_up"])
            total += 8 * cells * ((lower != MPI.PROC_NULL) + (upper != MPI.PROC_NULL))
    return total


def layouts(size: int) -> dict[str, dict[str, int]]:
    """Mesh sizes of each layout on ``size`` ranks."""
    out = {"axis0": {"x": size}, "last": {"x": size}}
    if size >= 4 and size % 2 == 0:
        out["grid"] = {"x": 2, "y": size // 2}
    return out


def periodic_flags(boundary: str, ndim: int, axes: list[int]) -> list[bool]:
    """The periodic flags of a boundary kind (see :data:`BOUNDARIES`)."""
    return [boundary == "all" or (boundary == "split" and a in axes) for a in range(ndim)]


def measure(shape: tuple[int, ...], layout: str, sizes: dict[str, int], width: int,
            args: argparse.Namespace, boundary: str = "all") -> dict[str, Any]:
    mesh = Mesh(WORLD, sizes, order="-".join(sizes))
    groups = [mesh.group(axis) for axis in sizes]
    axes = {"axis0": [0], "last": [len(shape) - 1], "grid": [0, 1]}[layout]
    d = Decomposition(shape, dict(zip(axes, groups)), periodic_flags(boundary, len(shape), axes))
    halos = {"pympar": HaloExchange(d, width),
             "pympar_subarray": HaloExchange(d, width, faces="subarray"),
             "pympar_packed": HaloExchange(d, width, faces="packed")}
    rng = np.random.default_rng(WORLD.rank)
    buf = halos["pympar"].empty()
    buf[...] = rng.standard_normal(buf.shape)
    raw, free = raw_exchanges(d, width, buf)
    calls_of: dict[str, Callable[[], Any]] = {
        **{name: (lambda h=h: h.exchange(buf)) for name, h in halos.items()}, **raw}
    if not strided(d, width, buf.shape):  # the same code as pympar's and raw_sendrecv's
        for name in STRIDED_ONLY:
            calls_of.pop(name)
    # The variants must agree before any is timed (every ghost; outer ones untouched).
    reference = buf.copy()
    raw["raw_sendrecv"]()
    want = buf.copy()
    for name, check in calls_of.items():
        buf[...] = reference
        check()
        if not np.array_equal(buf, want):
            raise AssertionError(f"bench_halo: {name}'s ghosts differ from raw Sendrecv's "
                                 f"({shape}, {layout}, {boundary})")
    buf[...] = reference
    petsc, free_petsc = (halo_petsc.exchanges(d, width) if getattr(args, "petsc_variants", False)
                         else ({}, lambda: None))
    calls_of.update(petsc)
    gradient = reference.copy()  # the adjoint's own array: it adds into it every call
    calls_of["pympar_adjoint"] = lambda: halos["pympar"].adjoint(gradient)
    once = common.timed_parallel(WORLD, raw["raw_sendrecv"], 3)
    calls = int(WORLD.bcast(min(1000, max(1, math.ceil(args.sample_seconds / max(once, 1e-7))))))
    samplers = {name: (lambda fn=fn: common.timed_parallel(WORLD, fn, calls))
                for name, fn in calls_of.items()}
    samples = common.interleaved(samplers, args.repeats, args.warmup, WORLD)
    median = {name: common.median(s) for name, s in samples.items()}
    free()
    free_petsc()
    for h in halos.values():
        h.free()
    for g in groups:
        g.free()

    def paired(a: str, b: str) -> float | None:  # time of a over time of b, round by round
        return common.paired_ratio(samples[a], samples[b]) if a in samples else None

    anchor = min(("raw_sendrecv", "raw_packed"), key=lambda v: median.get(v, math.inf))
    return {"shape": list(shape), "layout": layout, "boundary": boundary,
            "periodic": list(d.periodic), "parts": list(d.parts), "width": width,
            "calls_per_sample": calls,
            "face_bytes_max": int(WORLD.allreduce(face_bytes(d, width, buf.shape),
                                                  op=MPI.MAX)),
            "median_us": {k: v * 1e6 for k, v in median.items()},
            "samples_us": {k: [round(t * 1e6, 2) for t in v] for k, v in samples.items()},
            "anchor": anchor, "ratio": paired("pympar", anchor),
            "ratio_of_medians": median["pympar"] / median[anchor],
            "ratio_sendrecv": paired("pympar", "raw_sendrecv"),
            "ratio_packed": paired("pympar_packed", anchor),
            "ratio_subarray": paired("pympar_subarray", anchor),
            "neighbor_over_sendrecv": paired("raw_neighbor", "raw_sendrecv"),
            **{f"{v}_over_raw": paired(v, anchor) for v in petsc}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1024x1024,128x128x128",
                        help="global field shapes, comma-separated (e.g. 4096,512x512,64x64x64)")
    parser.add_argument("--periodic", default="all,none",
                        help=f"boundaries, comma-separated, of {', '.join(BOUNDARIES)}")
    parser.add_argument("--width", type=int, default=1, help="ghost cells per side")
    parser.add_argument("--repeats", type=int, default=11, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed samples per variant")
    parser.add_argument("--sample-seconds", type=float, default=0.005,
                        help="about how long one sample runs (calls per sample follow)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    halo_petsc.add_arguments(parser)
    args = parser.parse_args(argv)
    boundaries = args.periodic.split(",")
    if WORLD.size < 2 or not set(boundaries) <= set(BOUNDARIES):
        common.say(WORLD, "bench_halo: needs at least 2 ranks, and --periodic of "
                          f"{', '.join(BOUNDARIES)}")
        return 2
    args.petsc_variants = halo_petsc.available()
    info = common.machine_info(WORLD)
    cases = []
    with common.blas_threads(1):
        for text in args.shapes.split(","):
            shape = tuple(int(n) for n in text.lower().split("x"))
            for layout, sizes in layouts(WORLD.size).items():
                if len(shape) < (2 if layout != "axis0" else 1):
                    continue
                for boundary in boundaries:
                    case = measure(shape, layout, sizes, args.width, args, boundary)
                    cases.append(case)
                    common.say(WORLD, f"  {text} {layout} {boundary} w={args.width}: "
                                      + ", ".join(f"{k} {v:.1f} us" for k, v in
                                                  case["median_us"].items())
                                      + f"; pympar / {case['anchor']} {case['ratio']:.3f}")
    nodes = common.nodes(WORLD)
    # PETSc's job runs beside the one-node job (it would not cross the emulated nodes).
    petsc_job = (halo_petsc.spawn(WORLD, args, argv if argv is not None else sys.argv[1:])
                 if nodes == 1 else None)
    if WORLD.rank == 0:
        common.write_json(args.json, {
            "benchmark": "halo", "machine": info,
            "args": {k: v for k, v in vars(args).items() if k != "petsc_variants"},
            "ranks": WORLD.size, "nodes": nodes, "target": TARGET,
            "petsc": args.petsc_variants, "cases": cases, "petsc_job": petsc_job})
    return 0


if __name__ == "__main__":
    sys.exit(main())
