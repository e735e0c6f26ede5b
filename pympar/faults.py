"""How a job ends: every rank on its own terms, never one left waiting; settings checked at start.

:func:`pympar.manager.initialize_parallel` calls :func:`start` first, and
:func:`pympar.manager.destroy_parallel` calls :func:`stop`. In between, under any launcher
(plain ``python script.py`` too, not only ``python -m mpi4py``):

1. **An uncaught error raised alike on every rank** (its ``raised_alike`` attribute is true:
   :class:`~pympar.errors.CollectiveMismatchError`, a layout that does not fit the job,
   settings that differ) and a :class:`~pympar.errors.PeerEndedError`: the rank tells the
   ranks waiting for it on its groups' boards that it has ended (they raise
   :class:`~pympar.errors.PeerEndedError` at once, see :mod:`pympar._board`) and joins the
   end-of-program exchange. Once every rank is there (within :data:`END_WAIT` s) the
   lowest rank with such an error prints it as one line, the others nothing (the traceback
   too in debug mode, ``PYMPAR_DEBUG=1``); MPI is finalized and every rank exits 1. Ranks
   not there in time (busy outside pympar): each prints its line and the job aborts.
2. **Any other uncaught error**, in any thread: the traceback and one line naming the rank,
   then ``MPI.COMM_WORLD.Abort(1)`` after :data:`ABORT_DELAY` (a timeout of the watchdog
   prints its one line without a traceback, outside debug mode).
3. **The end of the program** (a return from the script, or ``sys.exit`` with any status):
   the rank tells the ranks waiting for it on its groups' boards, and waits until every rank
   has ended, at most the watchdog's ``PYMPAR_TIMEOUT`` (then it names itself and aborts the
   job). When every rank ended well each keeps its exit status; when another rank ended by
   an error, this one exits 1 too (after finalizing MPI; handlers that ``atexit`` registered
   before ``initialize_parallel`` are then skipped).
4. **Settings that must agree** (``PYMPAR_DEBUG`` and ``PYMPAR_TIMEOUT``, as in effect)
   are compared with one timed non-blocking allgather of a checksum
   (:func:`pympar.settings.check_same`, which every ``Mesh`` and ``Mesh.group`` also
   makes): different settings raise ``ValueError`` on every rank, and
   ``initialize_parallel`` called on only some ranks raises
   :class:`~pympar.errors.CollectiveTimeoutError` on those ranks within the watchdog's
   timeout (the ranks that did not call it cannot know).
5. **Ranks whose states differ** (``destroy_parallel`` called on some ranks only, then
   ``initialize_parallel`` on all): :func:`start` makes the same calls on every rank
   whatever each holds, so they meet, and ``initialize_parallel`` raises ``RuntimeError``
   alike, naming the ranks that still hold a state.

None of this relies on how a launcher ends a job (MPICH's ``mpiexec`` waits for every
rank, Open MPI's ``mpirun`` kills the others once one exits non-zero, ``srun`` waits
unless ``--kill-on-bad-exit``): every line is printed before any rank leaves.
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

import numpy as np
from mpi4py import MPI

from . import _board, debug, settings
from .errors import CollectiveMismatchError, CollectiveTimeoutError, PeerEndedError
from .settings import check_same

__all__ = ["start", "stop", "alike", "MUST_AGREE", "EXIT_NOTE_AFTER", "ABORT_DELAY", "END_WAIT"]

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
#: Seconds (at most the watchdog's timeout) that a rank with an error raised alike waits
#: for every rank to end, so that one rank prints it and none aborts.
END_WAIT = 10.0
# What each rank says in the end-of-program exchange.
_ENDED, _ALIKE, _PEER = 0, 1, 2
_previous: tuple[Any, Any] | None = None  # the hooks start() replaced, until stop()
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
    code = (_ALIKE if getattr(value, "raised_alike", False) else
            _PEER if isinstance(value, PeerEndedError) else None)
    if code is not None and _exit_comm is not None and not MPI.Is_finalized():
        timeout = debug.get_timeout()
        table = _gather_ends(code, END_WAIT if timeout is None else min(timeout, END_WAIT))
        if table is not None:  # every rank has ended: one line, from one rank, no abort
            ranks = np.flatnonzero(table == (_ALIKE if (table == _ALIKE).any() else _PEER))
            if ranks[0] == _exit_comm.Get_rank():
                if debug.is_enabled():
                    traceback.print_exception(kind, value, tb)
                said = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
                sys.stderr.write(f"[pympar] {kind.__name__} on rank{'s' * (len(ranks) > 1)} "
                                 f"{said}: {str(value).replace(chr(10), ' ')}\n")
            _finalize()
            return  # the interpreter exits 1
    if debug.is_enabled() or not (code or isinstance(value, CollectiveTimeoutError)):
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


def _finalize() -> None:
    # Every rank has ended (the exchange completed): leave MPI together, then wait a moment,
    # for a launcher kills the ranks still inside MPI_Finalize when one exits non-zero.
    sys.stdout.flush()
    sys.stderr.flush()
    _exit_comm.Barrier()
    MPI.Finalize()
    time.sleep(ABORT_DELAY)


def _completes(request: MPI.Request, timeout: float | None,
               note: tuple[float, str] | None = None) -> bool:
    """Whether ``request`` completes within ``timeout`` s (None: it is waited for), polled
    with growing pauses; ``note``: after that many seconds, write that line once."""
    start, pause = time.monotonic(), 1e-5
    while not request.Test():
        waited = time.monotonic() - start
        if timeout is not None and waited >= timeout:
            return False
        if note is not None and waited >= note[0]:
            sys.stderr.write(note[1])
            sys.stderr.flush()
            note = None
        time.sleep(pause)
        pause = min(2 * pause, 1e-2)
    return True


def _gather_ends(code: int, timeout: float | None) -> np.ndarray | None:
    """Tell the boards this rank has ended, then every rank's ``code`` in the end-of-program
    exchange (None when not every rank is there within ``timeout`` s)."""
    comm = _exit_comm
    assert comm is not None
    _board.depart()
    mine, table = np.array([code], np.int64), np.empty(comm.Get_size(), np.int64)
    request = comm.Iallgather([mine, MPI.INT64_T], [table, MPI.INT64_T])
    note = None if code != _ENDED else (EXIT_NOTE_AFTER, (
        f"[pympar rank {comm.Get_rank()}/{comm.Get_size()}] this rank reached the end of the "
        f"program and waits for the other ranks to end too (PYMPAR_TIMEOUT="
        f"{'never' if timeout is None else f'{timeout:g} s'})\n"))
    return table if _completes(request, timeout, note) else None


def _end_at_exit() -> None:
    """Wait for every rank to end; abort when some do not in time, exit 1 when one failed."""
    comm = _exit_comm
    if comm is None or MPI.Is_finalized():
        return
    timeout = debug.get_timeout()
    table = _gather_ends(_ENDED, timeout)
    if table is None:
        sys.stderr.write(
            f"[pympar rank {comm.Get_rank()}/{comm.Get_size()}] this rank reached the end "
            f"of the program (return or sys.exit) but other ranks did not within "
            f"PYMPAR_TIMEOUT={timeout:g} s; aborting the job (MPI_Abort)\n")
        sys.stderr.flush()
        time.sleep(ABORT_DELAY)
        MPI.COMM_WORLD.Abort(1)
    if table.any():  # another rank ended by an error, said there: leave MPI with it
        _finalize()


def alike(error: BaseException) -> BaseException:
    """Mark ``error`` as raised alike on every rank (``raise alike(ValueError(...))``):
    uncaught, it is printed once, by the lowest rank, as one line."""
    error.raised_alike = True  # type: ignore[attr-defined]
    return error


def _install() -> None:
    """Make an uncaught exception in any thread end the job (no MPI call)."""
    global _previous
    if _previous is None:
        _previous = (sys.excepthook, threading.excepthook)
        sys.excepthook = _excepthook
        threading.excepthook = _threading_excepthook


def _install_exit(comm: MPI.Comm, timeout: float | None) -> None:
    """Register the end of the program over a duplicate of ``comm``, the communicator being
    laid out when it has more than one rank.

    Collective on every rank of ``comm`` whatever each holds already, so that ranks whose
    states differ still match: a rank that kept the hooks of an earlier state (which others
    destroyed) swaps its old communicator for the new one. Not installed when the other
    ranks do not join within ``timeout`` s (None: waited for), which only happens on the way
    to an error, when they made another call: this rank's error then ends the job alone.
    """
    global _exit_comm
    if comm.Get_size() == 1:
        return
    # A communicator of its own: the end-of-program exchange can never match a collective
    # left pending on the user's communicators. Non-blocking, so its wait can be bounded.
    fresh, request = comm.Idup()
    if not _completes(request, timeout):
        return  # pending: the ranks that skipped it end by their own errors
    if _exit_comm is None:
        atexit.register(_end_at_exit)
    else:
        _exit_comm.Free()
    _exit_comm = fresh


def stop() -> None:
    """Remove what :func:`start` installed (collective over its communicator; idempotent).

    Called by :func:`pympar.manager.destroy_parallel`: from then on an uncaught error and
    the end of the program are Python's and MPI's own again.
    """
    global _previous, _exit_comm
    if _previous is not None:
        sys.excepthook, threading.excepthook = _previous
        _previous = None
    if _exit_comm is not None:
        atexit.unregister(_end_at_exit)
        _exit_comm.Free()
        _exit_comm = None


def start(comm: MPI.Comm) -> None:
    """Install the end-of-job hooks, then check that the ranks of ``comm`` agree on settings.

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
        When other ranks of ``comm`` do not call this within the watchdog's
        ``PYMPAR_TIMEOUT``. ``comm`` then has a pending operation.
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

    _install()
    check_launcher(comm)  # before any collective: the wrong srun --mpi plugin, said once
    timeout = debug.get_timeout()
    try:
        check_same(comm, "initialize_parallel", "")
    except (ValueError, CollectiveMismatchError):
        # Raised alike: where every rank is here they end together; where some made another
        # call instead (a Mesh), they are not, and this rank stops waiting for them.
        _install_exit(comm, END_WAIT if timeout is None else min(timeout, END_WAIT))
        raise
    _install_exit(comm, timeout)  # every rank passed the check: every rank is here
