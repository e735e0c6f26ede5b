"""A failing rank ends the whole job; settings that must agree are checked at start.

:func:`pympar.manager.initialize_parallel` calls :func:`start` first. It

1. from then on, for the rest of the process, makes an uncaught exception in
   any thread print the rank and the error and call ``MPI.COMM_WORLD.Abort``,
   under any launcher (plain ``python script.py`` too, not only ``python -m
   mpi4py``): the other ranks would otherwise wait forever in their next
   collective. This comes before any collective, so that an error inside
   ``initialize_parallel`` itself ends the job too;
2. compares, with one timed non-blocking allgather of a checksum, the settings
   every rank must share (``PYMPAR_DEBUG`` and ``PYMPAR_TIMEOUT``, as in
   effect), so that ``initialize_parallel`` called
   on only some ranks raises :class:`~pympar.debug.CollectiveTimeoutError` on those ranks
   within ``PYMPAR_TIMEOUT`` (the ranks that did not call it cannot know), and
   different settings raise :class:`ValueError` on every rank, naming the
   variable and each rank's value (the exchange is :func:`pympar.settings.check_same`,
   which every ``Mesh`` and ``Mesh.group`` also makes);
3. when the job has more than one rank, makes the end of the program (a return
   from the script, or ``sys.exit`` with any status) agree across the ranks
   first: a rank that ends while another has not ended waits for it; with
   ``PYMPAR_TIMEOUT`` set it waits that long, then prints which rank ended and
   aborts the job. Without a timeout it waits as long as MPI itself would in
   ``MPI_Finalize``: one rank's ``sys.exit`` while others are still computing
   cannot be told from a rank that finished early.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Any

from mpi4py import MPI

from . import debug, settings
from .settings import check_same

__all__ = ["start", "MUST_AGREE", "EXIT_NOTE_AFTER", "ABORT_DELAY"]

#: Environment variables whose settings must be the same on every rank (compared by
#: :func:`pympar.settings.check_same`, where the tuple lives).
MUST_AGREE = settings.MUST_AGREE
#: Seconds a rank waits at the end of the program, without a timeout, before it
#: says that it is waiting for the others.
EXIT_NOTE_AFTER = 30.0
#: Seconds between printing the error and ``MPI_Abort``: launchers (MPICH's Hydra
#: among them) stop forwarding a job's output once it aborts, so what was printed
#: just before is otherwise often lost.
ABORT_DELAY = 0.5
_installed = False
_exit_comm: MPI.Comm | None = None


def _report(kind: type[BaseException], value: BaseException, where: str) -> None:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    action = "aborting the job (MPI_Abort)" if size > 1 else "exiting"
    sys.stderr.write(f"[pympar rank {rank}/{size}] uncaught {kind.__name__}{where}: {value}; "
                     f"{action}\n")
    sys.stderr.flush()


def _abort() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if MPI.COMM_WORLD.Get_size() > 1:
        time.sleep(ABORT_DELAY)
        MPI.COMM_WORLD.Abort(1)


def _excepthook(kind: type[BaseException], value: BaseException,
                tb: TracebackType | None) -> None:
    from .pmi import LauncherMismatchError, first_task

    if isinstance(value, LauncherMismatchError):
        # Each task is a world of its own: one line from task 0, and every task fails.
        if first_task():
            sys.stderr.write(f"pympar: error: {value}\n")
        sys.stderr.flush()
        os._exit(1)
    traceback.print_exception(kind, value, tb)
    _report(kind, value, "")
    _abort()


def _threading_excepthook(args: Any) -> None:
    if args.exc_type is SystemExit:  # a thread's sys.exit ends only that thread
        return
    traceback.print_exception(args.exc_type, args.exc_value, args.exc_traceback)
    name = getattr(args.thread, "name", "?")
    _report(args.exc_type, args.exc_value, f" in thread {name!r}")
    _abort()


def _agree_at_exit() -> None:
    """Wait for every rank to reach the end; with a timeout, abort when some do not."""
    comm = _exit_comm
    if comm is None or MPI.Is_finalized():
        return
    request = comm.Ibarrier()
    timeout = debug.get_timeout()
    start, pause, noted = time.monotonic(), 1e-5, False
    while not request.Test():
        waited = time.monotonic() - start
        if timeout is not None and waited >= timeout:
            sys.stderr.write(
                f"[pympar rank {comm.Get_rank()}/{comm.Get_size()}] this rank reached the end "
                f"of the program (return or sys.exit) but other ranks did not within "
                f"PYMPAR_TIMEOUT={timeout:g} s; aborting the job (MPI_Abort)\n")
            sys.stderr.flush()
            time.sleep(ABORT_DELAY)
            MPI.COMM_WORLD.Abort(1)
        if not noted and waited >= EXIT_NOTE_AFTER:
            noted = True
            sys.stderr.write(
                f"[pympar rank {comm.Get_rank()}/{comm.Get_size()}] this rank reached the end "
                f"of the program and waits for the other ranks to end too (set PYMPAR_TIMEOUT "
                f"to abort the job instead when they do not)\n")
            sys.stderr.flush()
        time.sleep(pause)
        pause = min(2 * pause, 1e-2)


def _install_hooks() -> None:
    """Make an uncaught exception in any thread end the job (once per process; no MPI call)."""
    global _installed
    if not _installed:
        _installed = True
        sys.excepthook = _excepthook
        threading.excepthook = _threading_excepthook


def _install_exit(comm: MPI.Comm) -> None:
    """Register the end-of-program agreement over ``comm`` (collective: it duplicates ``comm``).

    The agreement covers the first communicator of more than one rank that is
    laid out (usually ``MPI.COMM_WORLD``).
    """
    global _exit_comm
    if _exit_comm is None and comm.Get_size() > 1:
        # A communicator of its own: the end-of-program barrier can never match a
        # collective left pending on the user's communicators.
        _exit_comm = comm.Dup()
        atexit.register(_agree_at_exit)


def start(comm: MPI.Comm) -> None:
    """Install the fault hooks, then check that the ranks of ``comm`` agree on their settings.

    Collective over ``comm``; called first by
    :func:`pympar.manager.initialize_parallel`. The hooks come before the first
    collective, so that an error raised there (a timeout on the ranks that called
    it, different settings) ends the whole job under any launcher.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The communicator being laid out.

    Raises
    ------
    pympar.debug.CollectiveTimeoutError
        When ``PYMPAR_TIMEOUT`` is set on this rank and other ranks of ``comm``
        do not call this within it. ``comm`` then has a pending operation.
    ValueError
        On every rank, when ``PYMPAR_DEBUG`` or ``PYMPAR_TIMEOUT``
        differ between ranks; the message names the
        variable and each rank's value.
    pympar.debug.CollectiveMismatchError
        On every rank, when other ranks make another agreed call meanwhile (a
        :class:`~pympar.mesh.Mesh`, say) instead of ``initialize_parallel``.
    pympar.pmi.LauncherMismatchError
        On every task, when Slurm started several tasks but MPI sees a world of one
        rank (the wrong ``srun --mpi`` plugin); uncaught, it is printed once (task 0)
        and every task exits 1.
    """
    from .pmi import check_launcher

    _install_hooks()
    check_launcher(comm)  # before any collective: the wrong srun --mpi plugin, said once
    check_same(comm, "initialize_parallel", "")
    _install_exit(comm)
