"""PETSc's DMDA ghost update as an anchor of ``bench_halo.py``, and the job that runs it.

:func:`exchanges` builds, where ``petsc4py`` is importable, a DMDA of a decomposition's
shape, split, boundaries and stencil width (a box stencil: corners are filled) and returns
its two ghost updates, each checked first against the field's own values:
``petsc_global_to_local`` (``DM.globalToLocal``: the local vector, interior and ghosts, from
the global one) and ``petsc_local_to_local`` (``DM.localToLocal`` in place: the ghosts of a
local vector from the others' interiors, pympar's ``exchange``).

:func:`spawn` runs ``bench_halo.py`` again under another interpreter where petsc4py is
(Debian's ``python3-petsc4py`` is built on Debian's Open MPI and its system Python, which a
virtual environment of MPICH cannot load) and returns that job's JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from benchmarks import common

VARIANTS = ("petsc_global_to_local", "petsc_local_to_local")
REPO = Path(__file__).resolve().parent.parent
#: Where docs/howto/benchmarks.rst puts the interpreter that has petsc4py.
DEFAULT_PYTHON = REPO / ".venv-petsc" / "bin" / "python"
#: Variables of the launcher of this job (MPICH's Hydra, Open MPI, PMIx, Slurm's PMI) that
#: must not reach the other MPI's job.
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPIR_", "MPICH_", "OMPI_", "PRTE_",
                      "OPAL_", "ORTE_", "I_MPI_")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The PETSc options of ``bench_halo.py``."""
    parser.add_argument("--petsc-python", default=os.environ.get("PYMPAR_PETSC_PYTHON"),
                        help="an interpreter where petsc4py and pympar import, to run the "
                             "PETSc anchor's job with (default: $PYMPAR_PETSC_PYTHON, else "
                             ".venv-petsc/bin/python where it exists)")
    parser.add_argument("--no-petsc", action="store_true",
                        help="no PETSc job, even where an interpreter for it exists")
    parser.add_argument("--petsc-job", action="store_true", help=argparse.SUPPRESS)


def available() -> str:
    """PETSc's version where petsc4py imports on every rank here, else "" (collective)."""
    try:
        import petsc4py

        petsc4py.init(["bench_halo"])
        from petsc4py import PETSc
        version = ".".join(map(str, PETSc.Sys.getVersion()))
    except ImportError:
        version = ""
    return version if MPI.COMM_WORLD.allreduce(int(bool(version)), op=MPI.MIN) else ""


def exchanges(d: Any, width: int) -> tuple[dict[str, Callable[[], None]], Callable[[], None]]:
    """The DMDA ghost updates of decomposition ``d``'s field (float64) with ghosts of
    ``width``, each checked first (every ghost holds its cell's value), and a cleanup."""
    from petsc4py import PETSc

    boundary = [PETSc.DM.BoundaryType.PERIODIC if p else PETSc.DM.BoundaryType.NONE
                for p in d.periodic]
    # PETSc's first axis (x) varies fastest: NumPy's last. The blocks are pympar's.
    da = PETSc.DMDA().create(dim=d.ndim, dof=1, sizes=d.global_shape[::-1],
                             proc_sizes=d.parts[::-1], boundary_type=boundary[::-1],
                             stencil_type=PETSc.DMDA.StencilType.BOX, stencil_width=width,
                             ownership_ranges=[tuple(s) for s in d.sizes[::-1]],
                             comm=PETSc.COMM_WORLD)
    glob, local = da.createGlobalVec(), da.createLocalVec()
    start, size = (np.array(c[::-1]) for c in da.getCorners())
    ghost_start, ghost_size = (np.array(c[::-1]) for c in da.getGhostCorners())
    owned = tuple(slice(s - g, s - g + n) for s, g, n in zip(start, ghost_start, size))
    # Each cell holds its global index: the ghosts must hold their (wrapped) cells' indices.
    at = np.indices(ghost_size).reshape(d.ndim, -1) + ghost_start[:, None]
    want = np.ravel_multi_index(tuple(at), d.global_shape, mode="wrap").reshape(ghost_size)
    with glob as values:
        values[:] = want[owned].reshape(-1)
    insert = PETSc.InsertMode.INSERT_VALUES
    runs = {"petsc_global_to_local": lambda: da.globalToLocal(glob, local, insert),
            "petsc_local_to_local": lambda: da.localToLocal(local, local, insert)}
    for name, run in runs.items():
        with local as values:
            values[:] = -1.0
            values.reshape(ghost_size)[owned] = want[owned]
        run()
        with local as values:
            if not np.array_equal(values.reshape(ghost_size), want):
                raise AssertionError(f"bench_halo: PETSc's {name} ghosts are not the "
                                     f"field's")

    def free() -> None:
        for made in (glob, local, da):
            made.destroy()
    return runs, free


def _interpreter(args: argparse.Namespace) -> str | None:
    if args.no_petsc or args.petsc_job:
        return None
    if args.petsc_python:
        return args.petsc_python
    return str(DEFAULT_PYTHON) if DEFAULT_PYTHON.exists() else None


def spawn(comm: MPI.Comm, args: argparse.Namespace, argv: list[str]) -> dict[str, Any] | None:
    """Rank 0 runs ``bench_halo.py`` with ``argv`` under the PETSc interpreter (see
    :func:`add_arguments`) and the ``mpiexec`` beside it, on as many ranks, while the other
    ranks sleep; returns its JSON document on rank 0, or a ``{"skipped": why}`` (None where
    no such interpreter is set or this job has petsc4py itself). Collective."""
    python = None if args.petsc_variants else _interpreter(args)
    if python is None:
        return None
    result: dict[str, Any] | None = None
    if comm.rank == 0:
        result = _run(python, comm.size, argv)
    common.sleep_barrier(comm)
    return result


def command(python: str, ranks: int, argv: list[str], out: Path) -> list[str]:
    """The PETSc job's command line: ``bench_halo.py`` under ``python`` and the ``mpiexec``
    beside it, with this job's arguments ``argv`` but its ``--json`` (``out`` instead) and
    PETSc options."""
    rest, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in ("--json", "--petsc-python"):
            skip = True
        elif not item.startswith(("--json=", "--petsc-python=", "--no-petsc", "--petsc-job")):
            rest.append(item)
    return [str(Path(python).parent / "mpiexec"), "--oversubscribe", "-n", str(ranks), python,
            str(Path(__file__).resolve().parent / "bench_halo.py"), *rest, "--petsc-job",
            "--json", str(out)]


def _run(python: str, ranks: int, argv: list[str]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=str(REPO))
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "halo_petsc.json"
        line = command(python, ranks, argv, out)
        if not Path(line[0]).exists():
            return {"skipped": f"no mpiexec beside {python}"}
        print("  PETSc job: " + " ".join(line), flush=True)
        code = subprocess.run(line, env=env, cwd=str(REPO)).returncode
        if code != 0 or not out.exists():
            return {"skipped": f"the PETSc job failed (exit {code})"}
        return json.loads(out.read_text())
