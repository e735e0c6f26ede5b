#!/usr/bin/env python3
"""First job on GPU nodes: one GPU per rank, and collectives on CuPy arrays that add up.

    srun python examples/slurm/select_gpu.py examples/slurm/gpu_check.py [--mib 64]
    mpiexec -n 2 python examples/slurm/gpu_check.py --cpu      # the same check on NumPy

Every rank all-reduces an array of ``rank + 1`` over all ranks with
``pympar.mappings.reduce_from_all``, checks the sum, and times a few repeats.
Rank 0 prints one line per rank (host, GPU, PCI bus id) and the bus bandwidth,
and every rank exits 1 (MPI finalized first, so the status and the message get
out whole) when a sum is wrong, two ranks of a node share a GPU, or CuPy is
missing; the reason is one line from rank 0.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

from pympar import backend, manager, mappings
from pympar.launch import finalize_and_exit, report_error


def pci_bus_id(xp, device: int) -> str:
    """``domain:bus:device`` of a CUDA device, as ``nvidia-smi`` prints it: the same GPU
    has the same id whatever ``CUDA_VISIBLE_DEVICES`` numbers it (under ``--gpu-bind``
    every rank may call its GPU 0)."""
    props = xp.cuda.runtime.getDeviceProperties(device)
    return f"{props['pciDomainID']:04x}:{props['pciBusID']:02x}:{props['pciDeviceID']:02x}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=64.0, help="message size in MiB")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help="use NumPy arrays (no GPU needed)")
    args = parser.parse_args(argv)

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if args.cpu:
        xp, device = np, ("cpu", "-")
    else:
        try:
            import cupy as xp
        except ImportError as err:
            return report_error("gpu_check.py", f"CuPy is not installed here ({err}); install "
                                "pympar with pip install -e '.[cuda]', or pass --cpu", status=1)
        dev = xp.cuda.Device()
        device = (str(dev.id), pci_bus_id(xp, dev.id))

    manager.initialize_parallel(tensor_parallel_size=size)   # one group of every rank
    try:
        n = max(1, int(args.mib * 2**20) // 4)
        x = xp.full(n, rank + 1, dtype=xp.float32)
        out = xp.empty_like(x)
        y = mappings.reduce_from_all(x, out=out)
        ok = bool((y == size * (size + 1) / 2).all())
        times = []
        for _ in range(args.repeats):
            comm.Barrier()
            start = time.perf_counter()
            mappings.reduce_from_all(x, out=out)
            if not args.cpu:
                xp.cuda.get_current_stream().synchronize()
            times.append(time.perf_counter() - start)
        rows = comm.gather((rank, socket.gethostname(), *device, ok), root=0)
        seconds = comm.reduce(float(np.median(times)), op=MPI.MAX, root=0)
    finally:
        manager.destroy_parallel()

    failed = False
    if rank == 0:
        print(f"MPI: {MPI.Get_library_version().splitlines()[0].strip()}")
        if not args.cpu:
            print(f"CUDA-aware MPI: library says {backend.mpi_library_cuda_support()}, pympar "
                  f"{'passes device buffers' if backend.cuda_aware() else 'stages via host'}")
        print("rank  host  gpu  pci_bus_id  sum_ok")
        for r, host, gpu, bus, good in rows:
            print(f"{r:4d}  {host}  {gpu}  {bus}  {good}")
        shared = {}
        for r, host, gpu, bus, _ in rows:
            if gpu != "cpu":
                shared.setdefault((host, bus), []).append(r)
        clashes = [ranks for ranks in shared.values() if len(ranks) > 1]
        # Bus bandwidth: what each rank sends in a bandwidth-optimal all-reduce, per second.
        bus = (f", bus bandwidth {2 * (size - 1) / size * n * 4 / seconds / 1e9:.2f} GB/s"
               if size > 1 else "")
        print(f"all-reduce {n * 4 / 2**20:.1f} MiB over {size} ranks: {seconds * 1e3:.2f} ms "
              f"median{bus}")
        if clashes:
            print(f"ERROR: ranks sharing a GPU: {clashes} (run through select_gpu.py)",
                  file=sys.stderr)
        if not all(row[-1] for row in rows):
            print("ERROR: wrong all-reduce result on some rank", file=sys.stderr)
        failed = bool(clashes) or not all(row[-1] for row in rows)
    return 1 if comm.bcast(failed, root=0) else 0


if __name__ == "__main__":
    finalize_and_exit(main())
