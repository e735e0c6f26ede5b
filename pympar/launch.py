"""Command lines of programs started on many ranks: say things once, exit together.

Every rank of an MPI program parses the same command line and reaches the same errors, so
without care each message is printed once per rank, interleaved; and under
``python -m mpi4py`` a non-zero exit aborts the job, whose last output the launcher often
drops. :class:`RankZeroParser` and :func:`report_error` print once, from rank 0, flush, and
let no rank leave before the message is out. (Started by ``srun`` with the wrong PMI plugin,
every task is rank 0 of a world of its own: task 0 alone prints, see :mod:`pympar.pmi`.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import IO, NoReturn

from mpi4py import MPI

from . import debug
from .errors import wait
from .faults import ABORT_DELAY
from .pmi import first_task
from .settings import _timeout_error

__all__ = ["LAUNCHER_VARIABLES", "launcher_hint", "report_error", "finalize_and_exit",
           "RankZeroParser"]

#: Environment variables that MPI launchers (MPICH's Hydra, Open MPI, PMIx, Slurm) set.
LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
                      "SLURM_PROCID", "MPI_LOCALNRANKS")


def launcher_hint(command: str) -> str:
    """A hint to start ``command`` under a launcher, when this is one process without one.

    Parameters
    ----------
    command : str
        How the program is run, e.g. ``"examples/burgers.py --tp 2"``.

    Returns
    -------
    str
        ``""`` on several ranks or under a launcher, else a ``"; ..."`` sentence to append.
    """
    if MPI.COMM_WORLD.Get_size() > 1 or any(v in os.environ for v in LAUNCHER_VARIABLES):
        return ""
    return ("; this is a single process started without a launcher: run "
            f"`mpiexec -n N python -m mpi4py {command}` for N ranks")


def _barrier(what: str) -> None:
    """Wait for every rank of the world, at most the watchdog's timeout."""
    wait(MPI.COMM_WORLD.Ibarrier(), what, MPI.COMM_WORLD, debug.get_timeout(), _timeout_error)


def _leave_together(status: int) -> None:
    # No rank exits before rank 0's message is out: python -m mpi4py aborts the job on a
    # non-zero exit, and the launcher stops forwarding output once it aborts.
    comm = MPI.COMM_WORLD
    _barrier("the end after an error every rank reports")
    if status and comm.Get_size() > 1:
        time.sleep(ABORT_DELAY)


def report_error(prog: str, message: str, status: int = 2) -> int:
    """Print ``prog: error: message`` once (rank 0, flushed) once every rank has the error.

    Call it on every rank alike (errors that every rank raises, e.g. a layout that does not
    fit). Returns ``status``, for ``return report_error(...)`` from ``main``.
    """
    if first_task():
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    _leave_together(status)
    return status


def finalize_and_exit(status: int) -> NoReturn:
    """Wait for every rank (at most the watchdog's timeout), finalize MPI, then exit with
    ``status``; collective.

    The end of a program that every rank reaches alike (``sys.exit(main())``): finalized
    first, the exit status reaches the launcher as it is. Under ``python -m mpi4py`` a
    non-zero exit with MPI still up becomes ``MPI_Abort``, which ends the job with another
    status, prints one abort line per rank and may cut the ranks' last output; the batch
    script of ``examples/slurm`` requeues on status 75 alone
    (:data:`pympar.preemption.REQUEUE_STATUS`).

    Parameters
    ----------
    status : int
        The exit status of every rank.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        _barrier("finalize_and_exit")
        MPI.Finalize()
    sys.exit(status)


class RankZeroParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` whose usage, help and errors rank 0 alone prints.

    Parameters
    ----------
    *args, **kwargs
        As for :class:`argparse.ArgumentParser`.
    command : str, optional
        How to run the program (e.g. ``"examples/burgers.py"``): errors of a single process
        started without a launcher then end with :func:`launcher_hint`.
    """

    def __init__(self, *args, command: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.command = command

    def _print_message(self, message: str, file: IO[str] | None = None) -> None:
        if first_task() and message:
            super()._print_message(message, file)
            (file or sys.stderr).flush()

    def error(self, message: str) -> NoReturn:
        """Print the usage and ``message`` (with the launcher hint) once; exit 2 everywhere."""
        self.print_usage(sys.stderr)
        hint = launcher_hint(self.command) if self.command else ""
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        """Print ``message`` once, wait for every rank, then exit with ``status``."""
        if message:
            self._print_message(message, sys.stderr)
        _leave_together(status)
        sys.exit(status)
