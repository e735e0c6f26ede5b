"""The launcher and MPI must agree on the ranks: name the wrong Slurm PMI plugin at once.

``srun --mpi=none`` (or a plugin the MPI library does not speak) starts every task as an
MPI world of its own, one rank each. Every task then fails its own way ("world size 1 is
not divisible by ..."), once per task. :func:`check_launcher` tells this case apart: Slurm
says that the job step has several tasks while MPI sees one rank. It raises
:class:`LauncherMismatchError` naming the fix, and :func:`first_task` says which of those
separate worlds prints it, so that the message appears once.
"""

from __future__ import annotations

import os

from mpi4py import MPI

__all__ = ["LauncherMismatchError", "check_launcher", "first_task", "slurm_step_tasks"]


class LauncherMismatchError(RuntimeError):
    """Slurm started several tasks, but MPI sees each of them as a world of one rank."""


def slurm_step_tasks() -> int:
    """The number of tasks of the Slurm job step this process belongs to (0 outside one).

    ``SLURM_STEP_NUM_TASKS`` is set in job steps (``srun``) only; ``SLURM_NTASKS`` and
    ``SLURM_NPROCS`` count only inside a step (``SLURM_STEP_ID`` set): the batch script
    itself, and a plain ``python`` started from it, see the job's task count too.
    """
    names = ("SLURM_STEP_NUM_TASKS",)
    if "SLURM_STEP_ID" in os.environ:
        names += ("SLURM_NTASKS", "SLURM_NPROCS")
    for name in names:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def first_task() -> bool:
    """Whether this process is the one that prints for the job: rank 0 of ``COMM_WORLD``,
    and, in a world of one rank inside a Slurm step, task 0 of the step."""
    if MPI.COMM_WORLD.Get_rank() != 0:
        return False
    if MPI.COMM_WORLD.Get_size() > 1:
        return True
    return os.environ.get("SLURM_PROCID", "0").strip() in ("", "0")


def _pmi_plugins() -> str:
    """What ``srun --mpi=list`` offers, as ``"pmi2, pmix"`` ("" when it cannot be asked)."""
    import shutil
    import subprocess  # only on the way to an error: not at import

    srun = shutil.which("srun")
    if srun is None:
        return ""
    try:
        done = subprocess.run([srun, "--mpi=list"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    words = (done.stdout + done.stderr).replace(":", " ").split()
    return ", ".join(sorted({w for w in words if w.startswith(("pmi", "cray_shasta"))}))


def check_launcher(comm: MPI.Comm | None = None) -> None:
    """Raise when Slurm started several tasks but MPI sees one rank.

    Checked only for ``MPI.COMM_WORLD`` (the default): a program that runs many
    independent one-rank jobs on ``MPI.COMM_SELF`` on purpose is not refused.
    Not collective; the same on every task.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm, optional
        The communicator about to be laid out; ``MPI.COMM_WORLD`` by default.

    Raises
    ------
    LauncherMismatchError
        On every task, naming the ``srun --mpi=`` plugins to use instead.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if comm != MPI.COMM_WORLD or MPI.COMM_WORLD.Get_size() != 1:
        return
    tasks = slurm_step_tasks()
    if tasks <= 1:
        return
    plugins = _pmi_plugins() if first_task() else ""
    offered = f" (this Slurm offers: {plugins})" if plugins else ""
    raise LauncherMismatchError(
        f"Slurm started {tasks} tasks but MPI sees a world of 1 rank in each: srun's PMI "
        f"plugin does not match the MPI library. Use srun --mpi=pmi2 (MPICH, Intel MPI, "
        f"MVAPICH) or --mpi=pmix (Open MPI), as `srun --mpi=list` shows{offered}")
