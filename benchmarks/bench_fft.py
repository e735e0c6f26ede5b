"""Distributed FFT round trip against mpi4py-fft, bytes per rank, and an FNO layer's memory.

Run under a launcher, one job per rank count::

    mpiexec -n 2 python benchmarks/bench_fft.py --shapes 128x128x128,256x256x256 \\
        --repeats 7 --json fft_2.json

Sections of the JSON document:

* ``roundtrip``: per shape, the median seconds of an r2c + c2r round trip of a float64 slab
  (axis 0 split over the world) with pympar (:mod:`pympar.fft`, its local transforms from
  ``local_library``; also with ``scipy.fft``'s as ``pympar scipy.fft`` when that is another),
  mpi4py-fft's ``fftw`` backend and its ``numpy`` backend, in one job and interleaved, each
  writing into arrays made once (pympar's ``out=``, mpi4py-fft's ``forward(a, a_hat)``) (skipped with a note when mpi4py-fft
  is not installed: ``pip install -e .[bench]`` after ``apt-get install libfftw3-dev``);
* ``bytes``: the bytes of pympar's exchanges per rank as :mod:`pympar.stats` records them,
  against the formula (16 bytes per complex number: the ``n0 x N1 x K`` block going, the
  ``N0 x n1 x K`` block coming back, ``K = N2 // 2 + 1``), and the part that leaves the rank;
* ``transpose``: the exchange alone, pympar's all-to-all (pack + ``Alltoall``/``Alltoallv``)
  against a raw ``Alltoallw`` of subarray datatypes (what mpi4py-fft sends; no packing in
  Python) and a raw NumPy pack + ``Alltoall``;
* ``local``: the local transforms of the slab (``rfftn`` over axes 1, 2; ``fft`` over axis 0)
  with NumPy, ``scipy.fft`` at ``workers=1`` and FFTW (mpi4py-fft's planner, one thread);
* ``fno``: one step (forward + backward) of an FNO layer (:class:`~pympar.modules.fno.
  SpectralBlock`, the field's ``x1`` split over the world): median seconds, the peak bytes
  NumPy allocated during it (``tracemalloc``), the parameters and cached activations per
  rank, and the weight bytes a replicated layout would hold instead.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import interleaved, machine_info, median, say, timed_parallel, write_json  # noqa: E402
from pympar import fft, stats  # noqa: E402
from pympar.fft import _local as fft_local  # noqa: E402
from pympar.memory import activation_bytes, parameter_bytes  # noqa: E402
from pympar.mesh import Mesh  # noqa: E402
from pympar.modules.fno import SpectralBlock  # noqa: E402
from pympar.partition import balanced_sizes  # noqa: E402

COMM = MPI.COMM_WORLD


def _shapes(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(n) for n in part.split("x")) for part in text.split(",") if part]


def _mpi4py_fft() -> Any:
    try:
        import mpi4py_fft
        return mpi4py_fft
    except ImportError:
        return None


def formula_bytes(shape: tuple[int, ...], p: int, rank: int) -> dict[str, int]:
    """Bytes per rank of one round trip's two exchanges (complex128 spectrum); none on one
    rank, where pympar makes no exchange."""
    if p == 1:
        return {"bytes_in": 0, "bytes_out": 0, "off_rank": 0}
    n0, n1, n2 = shape
    k = n2 // 2 + 1
    mine0, mine1 = balanced_sizes(n0, p)[rank], balanced_sizes(n1, p)[rank]
    going, coming = 16 * mine0 * n1 * k, 16 * n0 * mine1 * k
    kept = 16 * mine0 * mine1 * k  # the block a rank sends to itself, each way
    return {"bytes_in": going + coming, "bytes_out": coming + going,
            "off_rank": going + coming - 2 * kept}


def roundtrip(shape: tuple[int, ...], group: Any, repeats: int, warmup: int) -> dict[str, Any]:
    rng = np.random.default_rng(COMM.Get_rank())
    u = rng.standard_normal(fft.physical_placement(shape, group).local_shape)
    samplers: dict[str, Callable[[], float]] = {}
    errors: dict[str, float] = {}

    # Both libraries write into arrays made once, as mpi4py-fft's forward(a, a_hat) does.
    spectrum = np.empty(fft.spectral_placement(shape, group, real=True).local_shape, complex)
    back = np.empty_like(u)

    def pympar_trip() -> Any:
        return fft.irfftn(fft.rfftn(u, group, s=shape, out=spectrum), group, s=shape,
                          out=back)

    def with_library(library: str) -> Callable[[], Any]:
        def trip() -> Any:
            chosen, fft_local.LIBRARY = fft_local.LIBRARY, library
            try:
                return pympar_trip()
            finally:
                fft_local.LIBRARY = chosen
        return trip

    errors["pympar"] = float(np.max(np.abs(pympar_trip() - u)))
    samplers["pympar"] = lambda: timed_parallel(COMM, pympar_trip)
    if fft_local.LIBRARY != "scipy.fft" and "scipy.fft" in fft_local.LIBRARIES:
        # the same round trip with pocketfft's local transforms (pympar without pyFFTW)
        samplers["pympar scipy.fft"] = lambda: timed_parallel(COMM, with_library("scipy.fft"))
    notes = []
    anchor = _mpi4py_fft()
    if anchor is None:
        notes.append("mpi4py-fft is not installed: anchors skipped")
    else:
        for backend in ("fftw", "numpy"):
            try:
                plan = anchor.PFFT(COMM, shape, axes=(0, 1, 2), dtype=np.float64, grid=(-1,),
                                   backend=backend)
            except Exception as err:  # noqa: BLE001 - a backend that cannot plan is noted
                notes.append(f"mpi4py-fft {backend} cannot plan it: {type(err).__name__} {err}")
                continue
            a = anchor.newDistArray(plan, forward_output=False)
            a_hat = anchor.newDistArray(plan, forward_output=True)
            a[:] = rng.standard_normal(a.shape)
            start = np.array(a, copy=True)

            def trip(plan=plan, a=a, a_hat=a_hat) -> None:
                plan.forward(a, a_hat)
                plan.backward(a_hat, a)

            trip()
            errors[f"mpi4py-fft {backend}"] = float(np.max(np.abs(np.asarray(a) - start)))
            samplers[f"mpi4py-fft {backend}"] = lambda trip=trip: timed_parallel(COMM, trip)
    samples = interleaved(samplers, repeats, warmup, COMM)
    errors = {k: COMM.allreduce(v, op=MPI.MAX) for k, v in errors.items()}
    return {"shape": list(shape), "seconds": {k: median(v) for k, v in samples.items()},
            "samples": samples, "max_round_trip_error": errors, "notes": notes}


def exchange_bytes(shape: tuple[int, ...], group: Any) -> dict[str, Any]:
    u = np.zeros(fft.physical_placement(shape, group).local_shape)
    with stats.record() as recorder:
        fft.irfftn(fft.rfftn(u, group, s=shape), group, s=shape)
    totals = recorder.totals()
    measured = {"bytes_in": int(totals["bytes_in"]), "bytes_out": int(totals["bytes_out"]),
                "calls": int(totals["calls"])}
    formula = formula_bytes(shape, group.size, group.rank)
    per_rank = COMM.allgather({"measured": measured, "formula": formula})
    return {"shape": list(shape), "per_rank": per_rank,
            "equal": all(r["measured"]["bytes_in"] == r["formula"]["bytes_in"] and
                         r["measured"]["bytes_out"] == r["formula"]["bytes_out"]
                         for r in per_rank)}


def transpose(shape: tuple[int, ...], group: Any, repeats: int, warmup: int) -> dict[str, Any]:
    """The forward exchange alone: ``(n0, N1, K)`` complex, split axis 1, concat axis 0."""
    p, rank = group.size, group.rank
    n0, n1, n2 = shape
    k = n2 // 2 + 1
    rows, cols = balanced_sizes(n0, p), balanced_sizes(n1, p)
    x = np.random.default_rng(2).standard_normal((rows[rank], n1, k)) + 0j
    out = np.empty((n0, cols[rank], k), complex)
    comm = group.comm
    samplers = {"pympar all_to_all": lambda: timed_parallel(
        COMM, lambda: group.all_to_all(x, 1, 0, sizes=rows))}
    if p > 1:
        base = MPI.DOUBLE_COMPLEX
        col0 = np.cumsum((0,) + cols)[:-1]
        row0 = np.cumsum((0,) + rows)[:-1]
        send_types = [base.Create_subarray(x.shape, (rows[rank], cols[q], k),
                                           (0, int(col0[q]), 0)).Commit() for q in range(p)]
        recv_types = [base.Create_subarray(out.shape, (rows[q], cols[rank], k),
                                           (int(row0[q]), 0, 0)).Commit() for q in range(p)]
        ones, zeros = [1] * p, [0] * p

        def alltoallw() -> None:
            comm.Alltoallw([x, (ones, zeros), send_types], [out, (ones, zeros), recv_types])

        alltoallw()
        agree = np.array_equal(out, group.all_to_all(x, 1, 0, sizes=rows))
        samplers["raw Alltoallw subarrays"] = lambda: timed_parallel(COMM, alltoallw)
        even = len(set(rows)) == 1 and len(set(cols)) == 1
        if even:
            packed = np.empty((p, rows[rank], cols[rank], k), complex)

            def pack_alltoall() -> None:
                packed[...] = x.reshape(rows[rank], p, cols[rank], k).transpose(1, 0, 2, 3)
                comm.Alltoall(packed, out)

            samplers["raw pack + Alltoall"] = lambda: timed_parallel(COMM, pack_alltoall)
    else:
        agree = True
    samples = interleaved(samplers, repeats, warmup, COMM)
    if p > 1:
        for t in send_types + recv_types:
            t.Free()
    return {"shape": list(shape), "seconds": {k: median(v) for k, v in samples.items()},
            "alltoallw_equals_pympar": bool(COMM.allreduce(bool(agree), op=MPI.LAND))}


def local_transforms(shape: tuple[int, ...], p: int, repeats: int, warmup: int) -> dict[str, Any]:
    """One rank's local transforms of a slab on ``p`` ranks (rank 0's block sizes)."""
    n0, n1, n2 = shape
    k = n2 // 2 + 1
    rng = np.random.default_rng(3)
    real = rng.standard_normal((balanced_sizes(n0, p)[0], n1, n2))
    spec = rng.standard_normal((n0, balanced_sizes(n1, p)[0], k)) + 0j
    variants: dict[str, Callable[[], Any]] = {
        "numpy rfftn(1,2)": lambda: np.fft.rfftn(real, axes=(1, 2)),
        "numpy fft(0)": lambda: np.fft.fft(spec, axis=0),
    }
    try:
        import scipy.fft as sfft
        variants["scipy rfftn(1,2)"] = lambda: sfft.rfftn(real, axes=(1, 2), workers=1)
        variants["scipy fft(0)"] = lambda: sfft.fft(spec, axis=0, workers=1)
    except ImportError:
        pass
    anchor = _mpi4py_fft()
    if anchor is not None:
        from mpi4py_fft import fftw
        r_in = fftw.aligned(real.shape, dtype=np.float64)
        r_in[...] = real
        plan_r = fftw.rfftn(r_in, axes=(1, 2), threads=1, flags=(fftw.FFTW_MEASURE,))
        c_in = fftw.aligned(spec.shape, dtype=complex)
        plan_c = fftw.fftn(c_in, axes=(0,), threads=1, flags=(fftw.FFTW_MEASURE,))
        r_in[...] = real
        c_in[...] = spec
        variants["fftw rfftn(1,2)"] = lambda: plan_r()
        variants["fftw fft(0)"] = lambda: plan_c()
    samplers = {name: (lambda fn=fn: timed_parallel(COMM, fn)) for name, fn in variants.items()}
    samples = interleaved(samplers, repeats, warmup, COMM)
    return {"shape": list(shape), "ranks": p, "seconds": {k: median(v) for k, v in samples.items()}}


def fno_step(grid: tuple[int, int], batch: int, width: int, modes: int, group: Any,
             repeats: int, warmup: int) -> dict[str, Any]:
    """One SpectralBlock forward + backward on ``(batch, grid..., width)``, x1 split."""
    block = SpectralBlock(width, modes, group, dims=len(grid), dtype=np.float64, seed=0)
    shape = (batch, *grid, width)
    x = fft.physical_placement(shape, group, axes=(1, 2)).take(
        np.random.default_rng(4).standard_normal(shape))
    dy = np.ones_like(x)

    def step() -> None:
        block.zero_grad()
        block.forward(x)
        block.backward(dy)

    step()
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    block.forward(x)
    cached = activation_bytes(block)
    block.backward(dy)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    samples = interleaved({"step": lambda: timed_parallel(COMM, step)}, repeats, warmup, COMM)
    params = parameter_bytes(block)
    spectral = block.spectral
    full_weight = 2 * int(np.prod(spectral.weight_real.placement.shape)) * 8
    return {"grid": list(grid), "batch": batch, "width": width, "modes": modes,
            "ranks": group.size, "seconds": median(samples["step"]),
            "peak_step_bytes": COMM.allreduce(peak, op=MPI.MAX),
            "input_bytes": COMM.allreduce(int(x.nbytes), op=MPI.MAX),
            "parameter_bytes": COMM.allreduce(params, op=MPI.MAX),
            "cached_activation_bytes": COMM.allreduce(cached, op=MPI.MAX),
            "replicated_weight_bytes": full_weight,
            "split_weight_bytes": COMM.allreduce(2 * spectral.weight_real.data.nbytes,
                                                 op=MPI.MAX)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="128x128x128,256x256x256")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--fno", default="4x128x128x32x16",
                   help="batch x grid1 x grid2 x width x modes of the FNO layer ('' skips)")
    p.add_argument("--json", default=None, help="where to write the results")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    group = Mesh(COMM, {"x": COMM.Get_size()}).group("x")
    doc: dict[str, Any] = {"machine": machine_info(COMM), "ranks": COMM.Get_size(),
                           "local_library": fft_local.LIBRARY,
                           "roundtrip": [], "bytes": [], "transpose": [], "local": []}
    for shape in _shapes(args.shapes):
        say(COMM, f"fft round trip {shape} on {COMM.Get_size()} ranks")
        doc["roundtrip"].append(roundtrip(shape, group, args.repeats, args.warmup))
        doc["bytes"].append(exchange_bytes(shape, group))
        doc["transpose"].append(transpose(shape, group, args.repeats, args.warmup))
        doc["local"].append(local_transforms(shape, COMM.Get_size(), args.repeats, args.warmup))
    if args.fno:
        batch, g1, g2, width, modes = (int(v) for v in args.fno.split("x"))
        say(COMM, f"fno layer {batch}x{g1}x{g2}x{width}, {modes} modes")
        doc["fno"] = fno_step((g1, g2), batch, width, modes, group, args.repeats, args.warmup)
    group.free()
    if COMM.Get_rank() == 0:
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
