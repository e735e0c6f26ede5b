"""Ending a job well: notice a signal or a time budget, agree across ranks, save, exit 0.

Batch systems announce the end of a job with a signal (Slurm: ``--signal=B:USR1@<lead>``
forwarded by the batch script, or SIGTERM at the time limit). The signal reaches one rank,
or some ranks, at any moment, possibly inside an MPI call. So the handler only sets a flag;
the training loop calls :meth:`Preemption.should_stop` at step boundaries, which agrees across
all ranks with one tiny all-reduce, so that every rank stops after the same step, saves a
checkpoint and exits 0. Under Slurm, :meth:`Preemption.requeue` asks for the job to be
requeued.

Example
-------
>>> stop = Preemption(comm)                           # doctest: +SKIP
>>> for step in range(start, steps):                  # doctest: +SKIP
...     train_one_step()
...     if stop.should_stop():
...         checkpoint.save(f"ckpt/step_{step + 1}", model, optimizer, step=step + 1)
...         stop.requeue()
...         break
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from typing import Any, Iterable

import numpy as np
from mpi4py import MPI

__all__ = ["Preemption"]


class Preemption:
    """Flag set by a signal (or a wall-clock budget), checked collectively at step boundaries.

    Parameters
    ----------
    comm : mpi4py communicator or Group, optional
        The ranks that must stop together (``MPI.COMM_WORLD`` by default).
    signals : iterable of signal numbers or names, default (SIGUSR1, SIGTERM)
        The signals whose arrival asks the job to stop. Their previous handlers are restored
        by :meth:`close` (or on leaving a ``with`` block).
    budget : float, optional
        Seconds after construction after which :meth:`should_stop` is true on its own
        (e.g. the job's time limit minus the measured save time).

    Attributes
    ----------
    received : int or None
        The last signal this rank received, or None.
    """

    def __init__(self, comm: Any = None, signals: Iterable[Any] = ("SIGUSR1", "SIGTERM"),
                 budget: float | None = None) -> None:
        comm = MPI.COMM_WORLD if comm is None else comm
        self.comm = getattr(comm, "comm", comm)
        self.signals = [signal.Signals[s] if isinstance(s, str) else signal.Signals(s)
                        for s in signals]
        if budget is not None and budget < 0:
            raise ValueError(f"Preemption: budget must be >= 0 seconds, got {budget}")
        self.deadline = None if budget is None else time.monotonic() + float(budget)
        self.received: int | None = None
        self._flag = np.zeros(1, dtype=np.int32)
        self._previous = {sig: signal.signal(sig, self._handler) for sig in self.signals}

    def _handler(self, signum: int, frame: Any) -> None:
        # Only set the flag: the signal may arrive in the middle of a collective.
        self.received = signum

    def requested(self) -> bool:
        """bool: Whether this rank alone has seen a signal or passed the budget (no MPI)."""
        late = self.deadline is not None and time.monotonic() >= self.deadline
        return self.received is not None or late

    def should_stop(self) -> bool:
        """True on every rank when any rank was signalled or is past the budget; collective.

        Call it on every rank at the same point of every step (one 4-byte all-reduce).
        """
        self._flag[0] = self.requested()
        self.comm.Allreduce(MPI.IN_PLACE, self._flag, op=MPI.MAX)
        return bool(self._flag[0])

    def requeue(self, root: int = 0) -> bool:
        """Ask Slurm to requeue this job (``scontrol requeue $SLURM_JOB_ID``) from rank ``root``.

        Does nothing outside Slurm or where ``scontrol`` is not installed. Not collective.

        Returns
        -------
        bool
            Whether this rank asked and ``scontrol`` succeeded.
        """
        job = os.environ.get("SLURM_JOB_ID")
        scontrol = shutil.which("scontrol")
        if self.comm.Get_rank() != root or not job or scontrol is None:
            return False
        done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True)
        return done.returncode == 0

    def close(self) -> None:
        """Restore the signal handlers that were installed before."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def __enter__(self) -> "Preemption":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
