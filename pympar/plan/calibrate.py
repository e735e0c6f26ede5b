"""Measure this machine for the planner: ``python -m pympar plan --calibrate``.

Without a launcher it measures the local work on one rank (inside the examples' own loops,
:mod:`pympar.plan.in_examples`, where they are at hand, else :mod:`pympar.plan.kernels`) and
how much slower it runs beside another busy rank, then starts short ``mpiexec`` jobs of this
module on 2 ranks (the links, pympar's time per call and per check, how far apart ranks
arrive after equal work) and on 2 and 4 ranks per core (ranks sharing the cores: what each
synchronizing call costs on top; 4 and 8 ranks on two cores), and writes everything as a
:class:`~pympar.plan.machines.Machine` (to :func:`~pympar.plan.machines.this_file` by default:
the user's cache, never the package). About a minute on two cores. Under ``mpiexec`` it is
one of those jobs (``--part links``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
from mpi4py import MPI

from .machines import Link, Machine, this_file

__all__ = ["calibrate", "measure_links", "main"]


def _timed(comm: MPI.Comm, run: Callable[[], object], calls: int, repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean seconds per call of ``run`` (the slowest rank's)."""
    samples = []
    for _ in range(repeats + 1):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(calls):
            run()
        samples.append(comm.allreduce((time.perf_counter() - start) / calls, op=MPI.MAX))
    return statistics.median(samples[1:])


def measure_links(comm: MPI.Comm) -> dict[str, float]:
    """Under a launcher: one-way latency and bandwidth between ranks 0 and 1 (ping-pong), an
    8-byte all-reduce raw and through pympar, pympar's agreement check alone, and how late
    the slowest rank meets the others after short and after long equal work."""
    from ..collectives import agree
    from ..group import Group
    rank, size = comm.Get_rank(), comm.Get_size()
    out: dict[str, float] = {"ranks": size}
    for nbytes in (8, 4 * 2**20) if size == 2 else ():
        buf = np.zeros(nbytes, np.uint8)

        def pingpong() -> None:
            if rank == 0:
                comm.Send(buf, 1)
                comm.Recv(buf, 1)
            elif rank == 1:
                comm.Recv(buf, 0)
                comm.Send(buf, 0)
        out[f"pingpong_{nbytes}"] = _timed(comm, pingpong, 200 if nbytes == 8 else 10) / 2
    group = Group(comm.Dup(), "calibration", range(size))
    x, y = np.zeros(1), np.zeros(1)
    out["allreduce_raw"] = _timed(comm, lambda: comm.Allreduce(x, y), 200)
    out["allreduce_pympar"] = _timed(comm, lambda: group.all_reduce(x), 200)
    out["check"] = _timed(comm, lambda: agree(group, ("calibration",), "calibration"), 200)
    # Equal work, then a meeting: how much later than its own work the slowest arrives,
    # after short work (a share of it) and after long work (the bound: a few time slices
    # where ranks share a core).
    a = np.random.default_rng(rank).standard_normal((512, 256)).astype(np.float32)
    w = np.ones((256, 256), np.float32)

    def late(products: int, calls: int, repeats: int) -> tuple[float, float]:
        def work() -> None:
            for _ in range(products):
                a @ w
        alone = _timed(comm, work, calls, repeats)
        met = _timed(comm, lambda: (work(), group.all_reduce(x)), calls, repeats)
        return alone, max(met - alone - out["allreduce_pympar"], 0.0)
    short, extra = late(4, 10, 15)
    long, bound = late(48, 3, 5)
    # Lateness rises with the work, at the steeper of the two measured shares, up to the
    # bound (longer work is never met sooner).
    out["jitter"] = max(extra / short, bound / long)
    out["wait_cap"] = max(bound, extra)
    group.free()
    return out


def _mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.is_file() else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("calibration needs mpiexec (next to this Python or on PATH)")
    return found


def _job(ranks: int, folder: Path) -> dict[str, float]:
    """Run the links part on ``ranks`` ranks (one BLAS thread each); its figures."""
    target = folder / f"links_{ranks}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    launcher = _mpiexec()
    version = subprocess.run([launcher, "--version"], capture_output=True, text=True).stdout
    flags = ["--oversubscribe"] if "open" in version.lower() else []
    subprocess.run([launcher, *flags, "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m",
                    "pympar.plan.calibrate", "--part", "links", "--out", str(target)],
                   check=True, env=env, timeout=600)
    return json.loads(target.read_text())


def _node_memory() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2.0**30


def calibrate(out: Path | str | None = None) -> Machine:
    """Measure this machine and write its :class:`Machine` to ``out`` (default:
    :func:`~pympar.plan.machines.this_file`); return it."""
    from threadpoolctl import threadpool_limits
    from . import in_examples, kernels
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = int(cores or 1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    with threadpool_limits(1):  # the examples' own loops where they are at hand
        found = in_examples.samples() if in_examples.available() else kernels.chain_samples()
        fitted = kernels.fit(found + kernels.numpy_samples())
        corun = in_examples.corun(cores) if in_examples.available() and cores > 1 else 1.0
    with tempfile.TemporaryDirectory(prefix="pympar-calibrate-") as scratch:
        links = {n: _job(n, Path(scratch)) for n in sorted({2, 2 * cores, 4 * cores})}
    two = links[2]
    latency = two["pingpong_8"]
    bandwidth = 4 * 2**20 / max(two[f"pingpong_{4 * 2**20}"] - latency, 1e-9)
    check = two["check"]
    call = max(two["allreduce_pympar"] - two["allreduce_raw"] - check, 0.0)
    over = [n for n in links if n > cores]
    shared_check = {str(n // cores): max(links[n]["check"] - check, 0.0) for n in over}
    shared = {str(n // cores): max(links[n]["allreduce_pympar"] - two["allreduce_pympar"]
                                   - shared_check[str(n // cores)], 0.0) for n in over}
    waits = {str(n // cores): [links[n]["jitter"], links[n]["wait_cap"]] for n in over}
    copy = fitted.get("copy", [0.0, 0.0, 1e-10])
    machine = Machine(
        "this", f"this machine ({platform.node()}, {cores} cores), measured",
        cores=cores, intra=Link(latency, bandwidth), inter=Link(latency, bandwidth),
        memory_bandwidth=1.0 / max(copy[2], 1e-12), flop_rate=1.0 / max(
            fitted.get("linear.forward", [0, 1e-11, 0])[1], 1e-13),
        op_overhead=statistics.median(v[0] for v in fitted.values()), call_overhead=call,
        check_intra=check, kernels=fitted, shared=shared, shared_check=shared_check,
        jitter=two.get("jitter", 0.0) if 2 <= cores else 0.0,
        wait_cap=two.get("wait_cap") if 2 <= cores else None, shared_waits=waits, corun=corun,
        node_memory=_node_memory(),
        measured={"host": platform.node(), "date": datetime.date.today().isoformat(),
                  "mpi": MPI.Get_library_version().splitlines()[0].strip(),
                  "load_average": round(load, 2), "links": links,
                  "command": "python -m pympar plan --calibrate"})
    out = Path(out) if out is not None else this_file()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(machine.to_json())
    return machine


def main(argv: list[str] | None = None) -> int:
    """``python -m pympar.plan.calibrate [--part links] [--out FILE]``."""
    parser = argparse.ArgumentParser(prog="python -m pympar.plan.calibrate",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["all", "links"], default="all")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.part == "links":
        figures = measure_links(MPI.COMM_WORLD)
        if MPI.COMM_WORLD.Get_rank() == 0 and args.out:
            Path(args.out).write_text(json.dumps(figures))
        return 0
    machine = calibrate(args.out)
    print(f"wrote {args.out or this_file()}: latency {machine.intra.latency * 1e6:.2f} us, "
          f"{machine.intra.bandwidth / 1e9:.2f} GB/s, check {machine.check_intra * 1e6:.2f} "
          f"us, {len(machine.kernels)} kinds of work")
    return 0


if __name__ == "__main__":
    sys.exit(main())
