"""Helpers shared by the benchmark scripts: timing, threads, machine facts, torch setup.

Every script in ``benchmarks/`` runs under a launcher (``mpiexec -n N python
benchmarks/<name>.py``) and writes one JSON document; :mod:`benchmarks.run`
spawns them and turns their JSON into plots and a markdown table.

Timing rules used throughout:

* a sample is timed between barriers and its time is the slowest rank's;
* every variant is warmed up first, then sampled in rounds that visit the
  variants in a new (seeded, rank-independent) order each round, so slow drift
  of the machine (frequency, other load) and the after-effects of one variant
  on the next fall on all of them alike;
* the reported figure is the median over rounds;
* ranks that sit out a serial variant wait in :func:`sleep_barrier`, which
  sleeps instead of spinning, so the working rank has the machine to itself.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

#: Environment variables that change how fast NumPy's BLAS runs; recorded with every result.
BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
            "MKL_NUM_THREADS", "OMP_WAIT_POLICY")


def sleep_barrier(comm: MPI.Comm, pause: float = 5e-4) -> None:
    """A barrier that sleeps while it waits instead of spinning on a core.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        The communicator to synchronise.
    pause : float
        Seconds between polls; a poll costs microseconds.
    """
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(pause)


def timed_parallel(comm: MPI.Comm, fn: Callable[[], Any], calls: int = 1) -> float:
    """Seconds per call of ``fn`` run by every rank; the slowest rank's.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        Ranks that all call ``fn``.
    fn : callable
        One call of the operation.
    calls : int
        Calls per sample (to make short operations long enough to time).
    """
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) / calls
    return comm.allreduce(elapsed, op=MPI.MAX)


def timed_on_root(comm: MPI.Comm, fn: Callable[[], Any], calls: int = 1) -> float:
    """Seconds per call of ``fn`` on rank 0 alone while the other ranks sleep.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        The job's ranks; only rank 0 calls ``fn``.
    fn : callable
        One call of the serial operation (it must not communicate).
    calls : int
        Calls per sample.
    """
    sleep_barrier(comm)
    elapsed = 0.0
    if comm.Get_rank() == 0:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = (time.perf_counter() - start) / calls
    sleep_barrier(comm)
    return comm.bcast(elapsed, root=0)


def interleaved(samplers: dict[str, Callable[[], float]], repeats: int, warmup: int,
                comm: MPI.Comm, settle: float = 0.0) -> dict[str, list[float]]:
    """Sample every variant ``repeats`` times, in a new order each round.

    Parameters
    ----------
    samplers : dict of str to callable
        ``name -> sampler``; a sampler runs the variant once and returns its
        time in seconds (already agreed by all ranks).
    repeats : int
        Rounds; each round takes one sample of every variant.
    warmup : int
        Untimed samples of each variant before the first round.
    comm : mpi4py.MPI.Comm
        The job's ranks (every rank must call the samplers alike).
    settle : float
        Seconds every rank sleeps after each sample. Idle BLAS and OpenMP
        worker threads spin for up to ~0.1 s after a multi-threaded call
        before they sleep; without a pause they steal a core from whatever
        variant comes next.

    Returns
    -------
    dict of str to list of float
        The samples of each variant, in round order.

    Notes
    -----
    The order of each round is a permutation drawn from a generator seeded
    with the round number, the same on every rank, so each variant follows
    each other variant about equally often (a fixed rotation would always put
    the same variant before it).
    """
    names = list(samplers)
    for name in names:
        for _ in range(warmup):
            samplers[name]()
            time.sleep(settle)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        order = [names[i] for i in np.random.default_rng(round_).permutation(len(names))]
        for name in order:
            samples[name].append(float(samplers[name]()))
            time.sleep(settle)
    comm.Barrier()
    return samples


def median(values: Sequence[float]) -> float:
    """Median of the samples, NaN for none."""
    return float(statistics.median(values)) if len(values) else float("nan")


def paired_ratio(over: Sequence[float], under: Sequence[float]) -> float:
    """Median over rounds of ``over[i] / under[i]``: two variants sampled in the same rounds
    (:func:`interleaved`), so that the machine's drift falls on both alike."""
    return median([a / b for a, b in zip(over, under)])


def blas_info() -> list[dict[str, Any]]:
    """What threadpoolctl sees: the BLAS and OpenMP libraries, kernels and thread counts.

    Returns
    -------
    list of dict
        One entry per library with ``internal_api``, ``version``,
        ``architecture`` (the BLAS kernel, e.g. ``"SkylakeX"``),
        ``num_threads`` and ``prefix``; empty when threadpoolctl is missing.
    """
    try:
        import threadpoolctl
    except ImportError:
        return []
    keys = ("user_api", "internal_api", "prefix", "version", "architecture", "threading_layer",
            "num_threads")
    return [{k: info.get(k) for k in keys} for info in threadpoolctl.threadpool_info()]


def blas_threads(n: int) -> Any:
    """A context manager that limits NumPy's BLAS to ``n`` threads (threadpoolctl).

    Parameters
    ----------
    n : int
        Threads for the BLAS library (OpenBLAS, MKL or BLIS).
    """
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=n, user_api="blas")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_version() -> str | None:
    """The installed torch version, or None; imports nothing heavy when absent."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    return str(torch.__version__)


def machine_info(comm: MPI.Comm | None = None) -> dict[str, Any]:
    """Facts a reader needs to judge a result: date, CPU, load, libraries, BLAS.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm, optional
        The job's communicator: its size and hosts are recorded.

    Returns
    -------
    dict
        JSON-serialisable facts.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    hosts = sorted(set(comm.allgather(socket.gethostname())))
    try:
        load = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        load = []
    import mpi4py

    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "hosts": hosts,
        "ranks": comm.Get_size(),
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "loadavg": load,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "mpi4py": mpi4py.__version__,
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "torch": torch_version(),
        "blas": blas_info(),
        "env": {name: os.environ.get(name) for name in BLAS_ENV},
    }


def write_json(path: str | os.PathLike[str] | None, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON to ``path`` (creating folders); no-op for None."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")


# --------------------------------------------------------------------------- torch


def import_torch_distributed() -> tuple[Any, str | None]:
    """Import ``torch`` with ``torch.distributed`` and gloo, or say why not.

    Returns
    -------
    (module or None, str or None)
        ``(torch, None)`` when usable, else ``(None, reason)``.
    """
    try:
        import torch
        import torch.distributed as dist
    except ImportError as err:
        return None, f"torch is not installed ({err}); install it to compare with torch.distributed"
    if not dist.is_available():
        return None, f"torch {torch.__version__} was built without torch.distributed"
    if not dist.is_gloo_available():
        return None, f"torch {torch.__version__} has no gloo backend"
    return torch, None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_torch_gloo(comm: MPI.Comm) -> Any:
    """Start ``torch.distributed`` on gloo with the MPI job's ranks (env init).

    Rank 0 picks a free TCP port on the loopback interface and broadcasts it;
    ``RANK`` and ``WORLD_SIZE`` come from ``comm``. All ranks must be on one
    host (the benchmarks compare shared-memory MPI with gloo over loopback).

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        The job's ranks.

    Returns
    -------
    module
        ``torch.distributed``, initialised; call ``destroy_process_group`` at the end.

    Raises
    ------
    RuntimeError
        When the ranks are on more than one host.
    """
    import torch.distributed as dist

    if len(set(comm.allgather(socket.gethostname()))) > 1:
        raise RuntimeError("the torch comparison runs all ranks on one host (loopback)")
    port = comm.bcast(_free_port() if comm.Get_rank() == 0 else None, root=0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(comm.Get_rank()), WORLD_SIZE=str(comm.Get_size()))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method="env://", rank=comm.Get_rank(),
                            world_size=comm.Get_size())
    return dist


def say(comm: MPI.Comm, *parts: Any) -> None:
    """Print on rank 0 only, flushed (progress lines of a benchmark)."""
    if comm.Get_rank() == 0:
        print(*parts, flush=True)
        sys.stdout.flush()


def nodes(comm: Any) -> int:
    """How many nodes ``comm``'s ranks are on (``COMM_TYPE_SHARED``; collective): 2 under
    MPICH's ``MPIR_CVAR_ODD_EVEN_CLIQUES=1``, which the cross-node jobs set."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    first = int(node.Get_rank() == 0)
    node.Free()
    return comm.allreduce(first)
