"""The shared-memory board of the agreement check (private to :mod:`pympar.collectives`).

When every rank of a group shares one node, the collectives' agreement check needs no
message: each rank writes one 64-bit word into memory that the group's ranks map
together (a file in ``/dev/shm``) and reads every other rank's. The word is
``(k << 32) | sig32``: ``k`` counts the group's checks (modulo 2**32, the same on every
rank of a correct program) and ``sig32`` is the call's 32-bit signature. Rank ``r``
writes slot ``(k & 1) * size + r`` and waits until every slot of that parity carries
``k``; the ranks agree when every word equals its own.

Why two parities suffice: a rank starts check ``k + 2`` only after every rank wrote its
word for ``k + 1``, that is after every rank finished reading the words of ``k``. An
aligned 8-byte store or load is a single instruction on x86-64 and aarch64 (no torn
words), and the data moves through MPI afterwards, so the check needs no fences.

A rank that never reaches the check leaves the others spinning (politely, yielding the
core after a short tight spin) until ``PYMPAR_TIMEOUT``; without a timeout they wait for
ever, as they would in the MPI call the check replaces. While it yields, a waiting rank
also drives MPI's progress engine (one ``Iprobe`` per look), as a waiting MPI call would:
the rank it waits for may be in a send that needs this rank's earlier receive to progress.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from . import debug

__all__ = ["Board", "create"]

#: Where the boards' files are made (memory-backed on Linux); without it, no board.
SHARED_DIR = "/dev/shm"
#: Whether groups on one node check through shared memory (tests switch it off to force
#: the Iallreduce path; read when a group is created).
_ENABLED = True
#: Polls of a tight spin before each further poll yields the core (8 ranks on 2 cores
#: must not starve the rank they wait for).
_TIGHT = 200
_MASK = 0xFFFFFFFF
_NAME_BYTES = 256
# Give the core to another runnable process (time.sleep(0) where the OS has no sched_yield).
_YIELD = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))


class Board:
    """One group's shared-memory slots: two parities of one 64-bit word per rank.

    Parameters
    ----------
    memory : mmap.mmap
        The shared mapping of ``2 * size`` words (zeroed).
    size, rank : int
        The group's size and this process's rank in it.
    """

    __slots__ = ("memory", "slots", "size", "rank", "count")

    def __init__(self, memory: mmap.mmap, size: int, rank: int) -> None:
        self.memory, self.size, self.rank = memory, size, rank
        # A memoryview, not NumPy: indexing it with a Python int costs ~40 ns, a NumPy
        # scalar operation ~1 us.
        self.slots = memoryview(memory).cast("Q")
        self.count = 0  # checks made; word 0 (all slots at start) never carries k >= 1

    def publish(self, sig: int) -> int:
        """Write this rank's word for the next check; return it (the token of :meth:`wait`)."""
        k = self.count = (self.count + 1) & _MASK
        word = k << 32 | sig
        self.slots[(k & 1) * self.size + self.rank] = word
        return word

    def wait(self, word: int, group: Any, what: str, timeout: float | None) -> bool:
        """Wait until every rank wrote its word of ``word``'s check; whether all equal ``word``.

        Returns False as soon as a word differs: every rank sees the same words, so every
        rank returns False (and then meets the others in the mismatch report).

        Raises
        ------
        pympar.debug.CollectiveTimeoutError
            When ``timeout`` seconds pass before every rank wrote its word.
        """
        slots, k = self.slots, word >> 32
        lo = (k & 1) * self.size
        deadline = None  # one deadline for the whole wait, set when a rank is late
        for q in range(lo, lo + self.size):
            seen = slots[q]
            if seen >> 32 != k:
                if deadline is None and timeout is not None:
                    deadline = time.monotonic() + timeout
                seen = self._spin(q, k, group, what, timeout, deadline)
            if seen != word:
                return False
        return True

    def _spin(self, q: int, k: int, group: Any, what: str, timeout: float | None,
              deadline: float | None) -> int:
        """Poll slot ``q`` until it carries check ``k``: tight first, then yielding the core."""
        slots = self.slots
        for _ in range(_TIGHT):
            seen = slots[q]
            if seen >> 32 == k:
                return seen
        yield_core, poke = _YIELD, group.comm.Iprobe
        while True:
            yield_core()
            # Drive MPI's progress engine, as a waiting MPI call would: the rank we wait
            # for may be inside a send that completes only when this rank progresses a
            # receive it posted earlier (MPICH has no progress thread by default).
            poke()
            seen = slots[q]
            if seen >> 32 == k:
                return seen
            # A yield costs a system call or a time slice: reading the clock is cheap beside it.
            if deadline is not None and time.monotonic() >= deadline:
                raise debug.timeout_error(what, group, timeout, None)

    def free(self) -> None:
        """Unmap the slots (local; kept collective-safe for callers that free groups together)."""
        self.slots.release()
        self.memory.close()


def create(comm: MPI.Intracomm) -> Board | None:
    """The board of ``comm`` when all its ranks share a node, else None (collective).

    Rank 0 creates a file of ``2 * size`` words in :data:`SHARED_DIR` (``/dev/shm``, memory
    only), the others open it by the name it broadcasts, each maps it, and once all have
    it mapped rank 0 unlinks it: nothing is left behind, even if the job dies later. Any
    failure (no such directory, ranks on several nodes) gives None on every rank, so that
    every rank of the group takes the same path. Plain files rather than an MPI shared
    window: Open MPI's one-sided components print errors on machines without UCX
    hardware when a window is created, once per rank and group.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or not _ENABLED:  # alike on every rank; SHARED_DIR is tried by rank 0
        return None
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    together = node.Get_size() == size
    node.Free()
    if not together:
        return None
    nbytes = 2 * size * 8
    name = np.zeros(_NAME_BYTES, dtype=np.uint8)  # the path as bytes: nothing pickled
    if rank == 0:
        path = os.path.join(SHARED_DIR, f"pympar-board-{os.getpid()}-{secrets.token_hex(8)}")
        raw = path.encode()
        try:
            if len(raw) >= _NAME_BYTES:
                raise OSError(f"{path} is too long to broadcast")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, nbytes)  # zero-filled
            finally:
                os.close(fd)
            name[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
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
        return None
    return board
