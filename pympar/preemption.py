"""Ending a job early and well: notice a stop request, agree across ranks, save, exit 75.

Batch systems announce the end of a job with a signal (Slurm: ``--signal=USR1@<lead>`` to
the job steps, ``--signal=B:USR1@<lead>`` to the batch script, SIGTERM at the time limit).
A signal reaches one rank, or some ranks, at any moment, possibly inside an MPI call, so
the handler only sets a flag. A signal sent before the program has installed its handler
would be lost (or would kill the rank), so the batch script passes its own signal on as a
*stop file* instead: it creates the file named by ``$PYMPAR_STOP_FILE``, which
:class:`Preemption` looks for when it is created and at every step boundary.

The training loop calls :meth:`Preemption.should_stop` at step boundaries; it agrees across
all ranks with one tiny checked all-reduce (:mod:`pympar.collectives`), so every rank stops
after the same step and saves a checkpoint, and a rank that skips it is named by the
watchdog instead of leaving the others waiting. The program then ends with
``finalize_and_exit(REQUEUE_STATUS)`` (:func:`pympar.launch.finalize_and_exit`): MPI is finalized on every rank and the process
exits with :data:`REQUEUE_STATUS`. The batch script requeues the job
exactly when the step ended with that status (``examples/slurm/requeue.sh``); a program
that finished exits 0 and is not requeued. The program never requeues its own job: under
Slurm that kills the job's steps at once, before MPI has finalized.

Example
-------
>>> with Preemption(comm) as stop:                    # doctest: +SKIP
...     for step in range(start, steps):
...         if stop.should_stop():
...             checkpoint.save(f"ckpt/step_{step}", model, optimizer, step=step)
...             finalize_and_exit(REQUEUE_STATUS)     # MPI_Finalize, then exit 75
...         train_one_step()
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Iterable

import numpy as np
from mpi4py import MPI

from .group import Group
from .settings import check_same

__all__ = ["Preemption", "REQUEUE_STATUS", "STOP_FILE_VARIABLE"]

#: The exit status of a run that stopped early and wants to be requeued (``EX_TEMPFAIL``
#: of ``sysexits.h``: "try again later"). ``examples/slurm/requeue.sh`` requeues on it alone.
REQUEUE_STATUS = 75
#: The environment variable naming the stop file: when that file exists, the run stops.
STOP_FILE_VARIABLE = "PYMPAR_STOP_FILE"


class Preemption:
    """Flag set by a signal, a stop file or a wall-clock budget; checked collectively.

    Parameters
    ----------
    comm : mpi4py communicator or Group, optional
        The ranks that must stop together (``MPI.COMM_WORLD`` by default). Creating a
        Preemption is collective over them: every rank creates it, with a communicator it
        first agrees on (:func:`pympar.settings.check_same`) and a small board for the
        check of :meth:`should_stop`; :meth:`close` releases it.
    signals : iterable of signal numbers or names, default (SIGUSR1, SIGTERM)
        The signals whose arrival asks the job to stop. Their previous handlers are restored
        by :meth:`close` (or on leaving a ``with`` block).
    budget : float, optional
        Seconds after construction after which :meth:`should_stop` is true on its own
        (e.g. the job's time limit minus the measured save time).
    stop_file : str, optional
        A path whose existence asks the job to stop; ``$PYMPAR_STOP_FILE`` by default (none
        when unset or empty). Rank 0 of ``comm`` alone looks for it, once here and at every
        :meth:`should_stop`, so it must lie where rank 0 sees it (a shared file system).

    Attributes
    ----------
    received : int or None
        The last signal this rank received, or None.
    stop_file : str or None
        The stop file that rank 0 looks for (None on the other ranks).
    requested_at_start : bool
        Whether this rank found the stop file already there when it was created.
    """

    def __init__(self, comm: Any = None, signals: Iterable[Any] = ("SIGUSR1", "SIGTERM"),
                 budget: float | None = None, stop_file: str | None = None) -> None:
        comm = MPI.COMM_WORLD if comm is None else comm
        self.comm = getattr(comm, "comm", comm)
        self.group = comm if isinstance(comm, Group) else None
        self.signals = [signal.Signals[s] if isinstance(s, str) else signal.Signals(s)
                        for s in signals]
        if budget is not None and budget < 0:
            raise ValueError(f"Preemption: budget must be >= 0 seconds, got {budget}")
        self.deadline = None if budget is None else time.monotonic() + float(budget)
        self.received: int | None = None
        self._flag = np.zeros(1, dtype=np.int32)
        path = os.environ.get(STOP_FILE_VARIABLE, "") if stop_file is None else stop_file
        self.stop_file = path if path and self.comm.Get_rank() == 0 else None
        if self.group is None:
            check_same(self.comm, "Preemption", "")
            ranks = MPI.Group.Translate_ranks(self.comm.Get_group(), range(self.comm.Get_size()),
                                              MPI.COMM_WORLD.Get_group())
            self.group = Group(self.comm, "-".join(["preemption", *map(str, ranks)]), ranks,
                               owns_comm=False)
            self._own_group = True
        else:
            self._own_group = False
        self._previous = {sig: signal.signal(sig, self._handler) for sig in self.signals}
        self.requested_at_start = self._stop_file_exists()

    def _handler(self, signum: int, frame: Any) -> None:
        # Only set the flag: the signal may arrive in the middle of a collective.
        self.received = signum

    def _stop_file_exists(self) -> bool:
        return self.stop_file is not None and os.path.exists(self.stop_file)

    def requested(self) -> bool:
        """bool: Whether this rank alone has seen a signal, the stop file or the end of the
        budget (no MPI)."""
        late = self.deadline is not None and time.monotonic() >= self.deadline
        return self.received is not None or late or self._stop_file_exists()

    def should_stop(self) -> bool:
        """True on every rank when any rank was asked to stop or is past the budget; collective.

        Call it on every rank at the same point of every step (one 4-byte all-reduce,
        checked like every pympar collective), best before the step's work: the first call
        then also catches a stop requested before the program started.
        """
        self._flag[0] = self.requested()
        self.group.all_reduce(self._flag, op="max", out=self._flag,
                              label="Preemption.should_stop")
        return bool(self._flag[0])

    def close(self) -> None:
        """Restore the signal handlers that were installed before; release the board."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
        if self._own_group:
            self.group.free()  # the board only: the communicator is the caller's
            self._own_group = False

    def __enter__(self) -> "Preemption":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

