"""pympar mappings against ``torch.distributed`` on gloo (CPU), on the same buffers.

Run on 2 ranks (any number works)::

    PYTHONPATH=. mpiexec -n 2 python benchmarks/bench_torch_comm.py \\
        [--sizes 1KiB,1MiB,16MiB] [--repeats 11] [--json PATH]

Without torch (or without its gloo backend) the script prints why, writes a
JSON document saying it was skipped, and exits 0.

Each row times one operation on a per-rank float32 input of the given size,
three ways, interleaved sample by sample (a new order each round):

==========================  ===============================================  =================================
operation                   pympar                                            torch.distributed (gloo)
==========================  ===============================================  =================================
all_reduce (in place)       ``reduce_from_all(x, out=x)``                     ``all_reduce(x)``
all_gather axis 0           ``gather_from_sequence(x, out=, global_size=)``   ``all_gather_into_tensor(out, x)``
reduce_scatter axis 0       ``reduce_scatter_to_sequence(x, out=)``           ``reduce_scatter_tensor(out, x)``
all_to_all (rank-major)     ``all_to_all_from_sequence_to_hidden`` on         ``all_to_all_single(out, x)``
                            ``x.reshape(p, n/p)`` with ``head_axis=0,
                            seq_axis=1`` (no packing, as torch)
==========================  ===============================================  =================================

plus the bare mpi4py call on the same buffers (``Allreduce``, ``Allgather``,
``Reduce_scatter_block``, ``Alltoall``) for reference. torch tensors are
``torch.from_numpy`` views of the very arrays pympar uses. The in-place
all-reduce works on zeros so that repeated sums stay finite.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.bench_mappings import parse_size, show_size  # noqa: E402
from pympar import mappings as M  # noqa: E402
from pympar.mesh import Mesh  # noqa: E402

WORLD = MPI.COMM_WORLD
DEFAULT_SIZES = "1KiB,4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB"
#: Operation name -> the torch.distributed call it is compared with.
TORCH_NAMES = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
               "reduce_scatter": "reduce_scatter_tensor", "all_to_all": "all_to_all_single"}


@dataclass
class Case:
    """One operation: the three callables and the output array they all write."""

    name: str
    mpi4py: Callable[[], Any]
    pympar: Callable[[], Any]
    torch: Callable[[], Any]
    out: np.ndarray


def cases(group: Any, dist: Any, torch: Any, nbytes: int) -> list[Case]:
    """The four operations on a per-rank input of ``nbytes`` (float32, same buffers)."""
    comm, p = group.comm, group.size
    dtype = np.dtype(np.float32)
    n = max(p, nbytes // dtype.itemsize // p * p)  # elements; a multiple of p
    rows = p * max(1, n // (1024 * p))
    while n % rows:
        rows -= p
    hidden = n // rows
    rng = np.random.default_rng(group.rank)
    x = rng.standard_normal((rows, hidden)).astype(dtype)
    zeros = np.zeros((rows, hidden), dtype)
    gathered = np.empty((p * rows, hidden), dtype)
    block = np.empty((rows // p, hidden), dtype)
    flat = x.reshape(p, n // p)
    exchanged = np.empty((1, n), dtype)
    t = torch.from_numpy
    tx, tz, tg, tb, te = t(x), t(zeros), t(gathered), t(block), t(exchanged)
    return [
        Case("all_reduce",
             lambda: comm.Allreduce(MPI.IN_PLACE, zeros, MPI.SUM),
             lambda: M.reduce_from_all(zeros, group, out=zeros),
             lambda: dist.all_reduce(tz), zeros),
        Case("all_gather",
             lambda: comm.Allgather(x, gathered),
             lambda: M.gather_from_sequence(x, group, out=gathered, global_size=p * rows),
             lambda: dist.all_gather_into_tensor(tg, tx), gathered),
        Case("reduce_scatter",
             lambda: comm.Reduce_scatter_block(x, block, MPI.SUM),
             lambda: M.reduce_scatter_to_sequence(x, group, out=block),
             lambda: dist.reduce_scatter_tensor(tb, tx), block),
        Case("all_to_all",
             lambda: comm.Alltoall(flat, exchanged),
             lambda: M.all_to_all_from_sequence_to_hidden(flat, group, out=exchanged, seq_axis=1,
                                                           head_axis=0, size=n),
             lambda: dist.all_to_all_single(te.view(-1), tx.view(-1)), exchanged),
    ]


def same_result(case: Case) -> bool:
    """Whether pympar and torch write the same values (their shared output, run in turn).

    The output starts as NaN, or as ones for the in-place all-reduce (whose
    output is its input).
    """
    start = 1.0 if case.name == "all_reduce" else np.nan
    case.out.fill(start)
    case.pympar()
    mine = case.out.copy()
    case.out.fill(start)
    case.torch()
    return bool(np.allclose(mine, case.out, rtol=1e-5, atol=1e-5))


def measure(comm: MPI.Comm, fns: dict[str, Callable[[], Any]], repeats: int,
            warmup: int) -> dict[str, float]:
    """Median seconds per call of each callable, batched and interleaved.

    Each callable gets its own batch length (calls per sample), enough for a
    sample of about 2 ms, so that barrier and timer noise stay small for the
    fast ones without making the slow ones take forever.
    """
    samplers = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        single = common.timed_parallel(comm, fn, 2)
        calls = comm.bcast(max(1, min(1000, int(2e-3 / max(single, 1e-7)))))
        samplers[name] = (lambda fn=fn, calls=calls: common.timed_parallel(comm, fn, calls))
    samples = common.interleaved(samplers, repeats, 0, comm)
    return {name: common.median(values) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="bytes per rank, e.g. 1KiB,1MiB")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    comm = WORLD
    torch, reason = common.import_torch_distributed()
    info = common.machine_info(comm)
    if torch is None:
        common.say(comm, f"bench_torch_comm: skipped: {reason}")
        if comm.Get_rank() == 0:
            common.write_json(args.json, {"benchmark": "torch_comm", "machine": info,
                                          "skipped": reason, "rows": []})
        return 0
    dist = common.init_torch_gloo(comm)
    group = Mesh(comm, {"w": comm.Get_size()}).group("w")
    rows = []
    try:
        torch.set_num_threads(1)
        for nbytes in sizes:
            for case in cases(group, dist, torch, nbytes):
                name = case.name
                same = comm.allreduce(same_result(case), op=MPI.LAND)
                if name == "all_reduce":
                    case.out.fill(0)  # summed in place over and over: keep it finite
                t = measure(comm, {"mpi4py": case.mpi4py, "pympar": case.pympar,
                                   "torch": case.torch}, args.repeats, args.warmup)
                rows.append({"op": name, "torch_op": TORCH_NAMES[name], "bytes": nbytes,
                             "mpi4py_us": t["mpi4py"] * 1e6, "pympar_us": t["pympar"] * 1e6,
                             "torch_us": t["torch"] * 1e6,
                             "ratio_pympar_over_torch": t["pympar"] / t["torch"],
                             "ratio_pympar_over_mpi4py": t["pympar"] / t["mpi4py"],
                             "same_result": same})
                common.say(comm, f"  {name:15} {show_size(nbytes):>7}  mpi4py {t['mpi4py'] * 1e6:10.1f} us"
                                 f"  pympar {t['pympar'] * 1e6:10.1f} us  torch {t['torch'] * 1e6:10.1f} us"
                                 f"  pympar/torch {t['pympar'] / t['torch']:6.3f}"
                                 + ("" if same else "  RESULTS DIFFER"))
    finally:
        dist.destroy_process_group()
        group.free()
    if comm.Get_rank() == 0:
        common.write_json(args.json, {"benchmark": "torch_comm", "machine": info,
                                      "torch_backend": "gloo", "dtype": "float32",
                                      "repeats": args.repeats, "skipped": None, "rows": rows})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # torch 2.13 suggests all_gather_single / reduce_scatter_single; the benchmark keeps the
    # long-standing names on purpose (same calls on older torch).
    warnings.filterwarnings("ignore", message=r".*is deprecated", category=FutureWarning)
    sys.exit(main())
