"""GPU benchmark: pympar mappings on CuPy arrays against the same raw mpi4py calls on the same
CuPy buffers, staged and CUDA-aware, and the tensor-parallel MLP step on CuPy.

Run with ranks sharing or owning GPUs (``scripts/gpu_check.sh`` runs it on one GPU)::

    PYTHONPATH=. mpiexec -n 2 python benchmarks/bench_gpu.py [--sizes 64KiB,4MiB]
        [--repeats 9] [--modes staged,aware] [--mlp 1024x4096] [--json PATH]

Mapping rows: per-rank float32 input of each size; pympar writes into ``out=``; "raw" is
what a hand-written program does with the same buffers: in the aware mode the mpi4py call
on the CuPy arrays themselves (after a stream synchronize), in the staged mode a copy to
pinned host memory, the mpi4py call on it, and the copy back. Times are medians over the
repeats of the slowest rank, raw and pympar interleaved. The MLP rows time one forward and
backward of ``Column -> GELU -> Row`` on CuPy, float32, on 1 rank and on every rank of the
job (the tensor-parallel group), each ending in a device synchronize. Where the MPI library
reports no CUDA support, the aware mode runs on CuPy managed memory, which a host MPI reads
(mode ``aware (managed)``): device pointers would crash it. Rows print as they are measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_mappings import parse_size  # noqa: E402
from pympar import backend, manager, mappings  # noqa: E402
from pympar.group import Group  # noqa: E402

WORLD = MPI.COMM_WORLD


def _timed(comm: MPI.Comm, fn: Callable[[], Any], calls: int, cupy: Any) -> float:
    cupy.cuda.Device().synchronize()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    cupy.cuda.Device().synchronize()
    return comm.allreduce((time.perf_counter() - start) / calls, op=MPI.MAX)


def _raw(comm: MPI.Comm, method: str, send: Any, recv: Any, aware: bool, pinned: tuple,
         cupy: Any) -> Callable[[], None]:
    """The hand-written mpi4py call on the same CuPy buffers (staged through ``pinned``)."""
    t = backend.mpi_datatype(send.dtype)
    if aware:
        def call() -> None:
            cupy.cuda.get_current_stream().synchronize()
            getattr(comm, method)([send, t], [recv, t])
        return call
    host_send, host_recv = pinned

    def staged() -> None:
        send.get(out=host_send)
        getattr(comm, method)([host_send, t], [host_recv, t])
        recv.set(host_recv)
        cupy.cuda.get_current_stream().synchronize()
    return staged


def show(row: dict) -> None:
    """Print one row on rank 0 as soon as it is measured (a run cut short still says something)."""
    if WORLD.rank != 0:
        return
    if row["kind"] == "mapping":
        print(f"GPU {row['mode']:15} {row['op']:27} {row['bytes'] / 2**10:9.0f} KiB x{row['ranks']}"
              f"  raw {row['raw_s'] * 1e6:9.1f} us  pympar {row['pympar_s'] * 1e6:9.1f} us"
              f"  ratio {row['ratio']:.2f}  same {row['same_result']}", flush=True)
    else:
        print(f"GPU MLP {row['hidden']}x{row['ffn']} tokens {row['tokens']} on {row['ranks']} "
              f"rank(s) ({row['mode']}): {row['step_s'] * 1e3:.2f} ms/step", flush=True)


def aware_mode(cupy: Any) -> str:
    """Set up the CUDA-aware mode: device pointers to a CUDA-aware MPI, or, where the library
    reports no CUDA support (a host MPI would crash on them), the mode emulated on managed
    memory, which a host MPI reads (as ``scripts/gpu_check.sh`` runs the tests)."""
    os.environ["PYMPAR_CUDA_AWARE"] = "1"
    if backend.mpi_library_cuda_support():
        return "aware"
    os.environ["PYMPAR_TEST_CUPY_MANAGED"] = "1"  # tells the CuPy stand-in: a host MPI
    cupy.cuda.set_allocator(cupy.cuda.MemoryPool(cupy.cuda.malloc_managed).malloc)
    return "aware (managed)"


def mapping_rows(cupy: Any, sizes: list[int], repeats: int, mode: str) -> list[dict]:
    """Times of gather_from_hidden, reduce_from_all and reduce_scatter_to_sequence on CuPy."""
    import cupyx

    group = Group(WORLD, "bench-gpu", list(range(WORLD.size)), owns_comm=False)
    p, rows = WORLD.size, []
    for nbytes in sizes:
        n = max(p, nbytes // 4 // p * p)
        x = cupy.asarray(np.random.default_rng(WORLD.rank).standard_normal(n, np.float32))
        cases = {
            "reduce_from_all": (lambda out: mappings.reduce_from_all(x, group, out=out),
                                "Allreduce", (n,), (n,)),
            "gather_from_hidden": (lambda out: mappings.gather_from_hidden(x, group, out=out),
                                   "Allgather", (n,), (n * p,)),
            "reduce_scatter_to_sequence": (
                lambda out: mappings.reduce_scatter_to_sequence(x, group, out=out),
                "Reduce_scatter_block", (n,), (n // p,)),
        }
        for name, (ours, method, shape_in, shape_out) in cases.items():
            out = cupy.empty(shape_out, np.float32)
            raw_out = cupy.empty(shape_out, np.float32)
            pinned = (cupyx.empty_pinned(shape_in, np.float32),
                      cupyx.empty_pinned(shape_out, np.float32))
            raw = _raw(WORLD, method, x, raw_out, mode != "staged", pinned, cupy)
            calls = max(1, min(50, (8 << 20) // max(nbytes, 1)))
            for _ in range(2):  # warm-up: plans, buffers, kernels
                ours(out), raw()
            pairs = []
            for k in range(repeats):
                first, second = (raw, lambda: ours(out)) if k % 2 == 0 else \
                    (lambda: ours(out), raw)
                a = _timed(WORLD, first, calls, cupy)
                b = _timed(WORLD, second, calls, cupy)
                pairs.append((a, b) if k % 2 == 0 else (b, a))
            cupy.cuda.Device().synchronize()
            same = bool(cupy.array_equal(out, raw_out))
            raw_t = statistics.median(r for r, _ in pairs)
            ours_t = statistics.median(o for _, o in pairs)
            rows.append({"kind": "mapping", "mode": mode, "op": name, "bytes": nbytes,
                         "ranks": p, "raw_s": raw_t, "pympar_s": ours_t,
                         "ratio": statistics.median(o / r for r, o in pairs),
                         "same_result": same})
            show(rows[-1])
    return rows


def mlp_rows(cupy: Any, hidden: int, ffn: int, tokens: int, repeats: int,
             mode: str) -> list[dict]:
    """The TP MLP step on CuPy on 1 rank (alone) and on every rank of the job."""
    from pympar.modules import GELU, ColumnParallelLinear, RowParallelLinear, Sequential

    rows = []
    for ranks in sorted({1, WORLD.size}):
        color = 0 if WORLD.rank < ranks else MPI.UNDEFINED
        comm = WORLD.Split(color, WORLD.rank)
        if comm != MPI.COMM_NULL:
            manager.initialize_parallel(ranks, comm=comm)
            model = Sequential(ColumnParallelLinear(hidden, ffn, gather_output=False, seed=1,
                                                    xp=cupy), GELU(),
                               RowParallelLinear(ffn, hidden, input_is_parallel=True, seed=2,
                                                 xp=cupy))
            rng = np.random.default_rng(0)
            x = cupy.asarray(rng.standard_normal((tokens, hidden), np.float32))
            dy = cupy.asarray(rng.standard_normal((tokens, hidden), np.float32))

            def step() -> None:
                model.zero_grad(set_to_none=True)
                model.forward(x)
                model.backward(dy)
            for _ in range(2):
                step()
            times = [_timed(comm, step, 3, cupy) for _ in range(repeats)]
            manager.destroy_parallel()
            if comm.rank == 0:
                rows.append({"kind": "mlp", "ranks": ranks, "hidden": hidden, "ffn": ffn,
                             "tokens": tokens, "mode": mode, "step_s": statistics.median(times)})
                show(rows[-1])
            comm.Free()
        WORLD.Barrier()
    return WORLD.bcast(rows if WORLD.rank == 0 else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64KiB,4MiB")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--modes", default="staged,aware")
    parser.add_argument("--mlp", default="1024x4096", help="HIDDENxTOKENS (ffn = 4 hidden)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import cupy

    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    modes = [m for m in args.modes.split(",") if m]
    hidden, tokens = (int(v) for v in args.mlp.lower().split("x"))
    rows: list[dict] = []
    # Staged first: the aware mode may switch CuPy to managed memory for good.
    for mode in sorted(modes, key=lambda m: m != "staged"):
        if mode == "aware":
            mode = aware_mode(cupy)
        else:
            os.environ["PYMPAR_CUDA_AWARE"] = "0"
        rows += mapping_rows(cupy, sizes, args.repeats, mode)
        rows += mlp_rows(cupy, hidden, 4 * hidden, tokens, max(3, args.repeats // 3), mode)
    if WORLD.rank == 0 and args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
    ok = all(r.get("same_result", True) for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
