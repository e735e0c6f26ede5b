"""The boards of the agreement check: one 64-bit word per rank and check (private).

Before its data call every rank of a group writes the call's 32-bit signature (odd;
:data:`REFUSED` for a rank refusing its own arguments) and reads every rank's. The group
agrees when every signature equals this rank's. One mechanism for every collective
means that two ranks making different calls always meet in the same exchange and see
the difference, instead of waiting in two different ones.

* :class:`Board` (every rank on one node): no message. Each rank writes its word into
  memory the group's ranks map together (a file in ``/dev/shm``) and polls the others'.
  A word is ``(k << 32) | signature``, where ``k`` counts the group's checks (1 to
  ``2**32 - 2``, the same on every rank of a correct program); rank ``r``'s word of check
  ``k`` sits at ``(k & 1) * size + r``. A reader waits until the word carries ``k``. An
  aligned 8-byte store or load is one instruction on x86-64 and aarch64 (no torn words)
  and the data moves through MPI afterwards, so the check needs no fences. Two parities
  suffice: a rank starts check ``k + 2`` only after every rank wrote its word of ``k + 1``,
  that is after every rank finished reading the words of ``k``.
* :class:`MessageBoard` (ranks on several nodes): one 8-byte ``Iallgather`` per check.

A rank that never reaches the check leaves the others waiting (a :class:`Board` spins
politely, yielding the core after a short tight spin) until ``PYMPAR_TIMEOUT``; without a
timeout they wait for ever, as they would in the MPI call the check precedes. While it
yields, a waiting rank drives MPI's progress engine (one ``Iprobe`` per look), as a
waiting MPI call would: the rank it waits for may be in a send that needs this rank's
earlier receive to progress.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from .errors import timeout_error, wait

__all__ = ["Board", "MessageBoard", "create", "REFUSED"]

#: Where the shared boards' files are made (memory-backed on Linux); without it, messages.
SHARED_DIR = "/dev/shm"
#: Whether groups on one node check through shared memory (read when a group is created;
#: tests switch it off to take the message path).
SHARED = True
#: Polls of a tight spin before each further poll yields the core (8 ranks on 2 cores
#: must not starve the rank they wait for).
_TIGHT = 200
#: The signature of a rank that refuses its own arguments (calls' signatures are odd).
REFUSED = 0
_LAST = 2**32 - 2  # the last check count before wrapping to 1 (even: parities alternate)
_NAME_BYTES = 256
# Give the core to another runnable process (time.sleep(0) where the OS has no sched_yield).
_YIELD = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))


class Board:
    """One group's shared-memory words: two parities of one 64-bit word per rank.

    Parameters
    ----------
    memory : mmap.mmap
        The shared mapping of ``2 * size`` words (zeroed).
    size, rank : int
        The group's size and this process's rank in it.
    """

    __slots__ = ("memory", "slots", "size", "rank", "count")

    shared = True

    def __init__(self, memory: mmap.mmap, size: int, rank: int) -> None:
        self.memory, self.size, self.rank = memory, size, rank
        # A memoryview, not NumPy: indexing it with a Python int costs ~40 ns.
        self.slots = memoryview(memory).cast("Q")
        self.count = 0  # checks made; word 0 (all slots at start) never carries k >= 1

    def agree(self, sig: int, group: Any, what: str, timeout: float | None) -> bool:
        """Write ``sig`` for the next check; wait for every rank's; whether all equal it.

        Every rank sees the same words, so every rank returns the same answer.

        Raises
        ------
        pympar.debug.CollectiveTimeoutError
            When ``timeout`` seconds pass before every rank wrote its word.
        """
        k = self.count = self.count + 1 if self.count < _LAST else 1
        word, slots = k << 32 | sig, self.slots
        lo = (k & 1) * self.size
        slots[lo + self.rank] = word
        deadline = None  # one deadline for the whole wait, set when a rank is late
        for at in range(lo, lo + self.size):
            seen = slots[at]
            if seen >> 32 != k:
                if deadline is None and timeout is not None:
                    deadline = time.monotonic() + timeout
                seen = self._spin(at, k, group, what, timeout, deadline)
            if seen != word:
                return False
        return True

    def _spin(self, at: int, k: int, group: Any, what: str, timeout: float | None,
              deadline: float | None) -> int:
        """Poll word ``at`` until it carries check ``k``: tight first, then yielding the core."""
        slots = self.slots
        for _ in range(_TIGHT):
            seen = slots[at]
            if seen >> 32 == k:
                return seen
        yield_core, poke = _YIELD, group.comm.Iprobe
        while True:
            yield_core()
            poke()  # drive MPI's progress engine (MPICH has no progress thread by default)
            seen = slots[at]
            if seen >> 32 == k:
                return seen
            if deadline is not None and time.monotonic() >= deadline:
                raise timeout_error(what, group, timeout, None)

    def free(self) -> None:
        """Unmap the words (local)."""
        self.slots.release()
        self.memory.close()


class MessageBoard:
    """The same check for ranks on several nodes: one ``Iallgather`` of an int64 per rank.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The group's communicator.
    """

    __slots__ = ("comm", "mine", "table")

    shared = False

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self.mine = np.zeros(1, np.int64)
        self.table = np.zeros(comm.Get_size(), np.int64)

    def agree(self, sig: int, group: Any, what: str, timeout: float | None) -> bool:
        """Exchange ``sig``; whether every rank's equals it (see :meth:`Board.agree`)."""
        self.mine[0] = sig
        wait(self.comm.Iallgather([self.mine, MPI.INT64_T], [self.table, MPI.INT64_T]),
             what, group, timeout)
        return bool(self.table.min() == sig == self.table.max())

    def free(self) -> None:
        """Nothing to release (kept for symmetry with :class:`Board`)."""


def create(comm: MPI.Intracomm) -> Board | MessageBoard | None:
    """The board of ``comm``: shared memory when all its ranks share a node (collective).

    None for a communicator of one rank; a :class:`MessageBoard` when the ranks span
    nodes, shared memory cannot be set up, or :data:`SHARED` is off.

    Rank 0 creates a file of ``2 * size`` words in :data:`SHARED_DIR`, the others open it
    by the name it broadcasts, each maps it, and once all have it mapped rank 0 unlinks
    it: nothing is left behind, even if the job dies later. Any failure gives a
    :class:`MessageBoard` on every rank. Plain files rather than an MPI shared window:
    Open MPI's one-sided components print errors on machines without UCX hardware.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return None
    if not SHARED:  # alike on every rank
        return MessageBoard(comm)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    together = node.Get_size() == size
    node.Free()
    if not together:
        return MessageBoard(comm)
    nbytes = 2 * size * 8
    name = np.zeros(_NAME_BYTES, dtype=np.uint8)  # the path as bytes: nothing pickled
    if rank == 0:
        path = os.path.join(SHARED_DIR, f"pympar-board-{os.getpid()}-{secrets.token_hex(8)}")
        try:
            if len(path.encode()) >= _NAME_BYTES:
                raise OSError(f"{path} is too long to broadcast")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, nbytes)  # zero-filled
            finally:
                os.close(fd)
            name[:len(path.encode())] = np.frombuffer(path.encode(), dtype=np.uint8)
        except OSError:
            pass  # an empty name: no board anywhere
    comm.Bcast(name, root=0)
    path = bytes(name).rstrip(b"\0").decode() or None
    board = None
    if path is not None:
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
            try:
                board = Board(mmap.mmap(fd, nbytes), size, rank)
            finally:
                os.close(fd)
        except (OSError, ValueError):
            board = None
    # Every rank takes the shared path or none does; the reduction is also the barrier
    # after which nobody opens the file any more.
    agreed = np.array([board is not None], dtype=np.int32)
    comm.Allreduce(MPI.IN_PLACE, agreed, op=MPI.LAND)
    if rank == 0 and path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
    if not agreed[0]:
        if board is not None:
            board.free()
        return MessageBoard(comm)
    return board
