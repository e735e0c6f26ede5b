"""The boards of the agreement check (private to :mod:`pympar.collectives`).

Before a data call, every rank of a group posts three numbers: the call's signature
(nonzero; :data:`REFUSED` for a rank refusing its own arguments), and for a gather whose
ranks' extents are unknown, its extent along the gathered axis and the extent of its
``out`` there (+1; 0 for none). Every rank reads every rank's numbers. A group agrees
when every signature equals this rank's; the extents then give the gather's sizes. One
mechanism for every collective means that two ranks making different calls always meet
in the same exchange and see the difference, instead of waiting in two different ones.

* :class:`Board` (every rank on one node): no message. Each rank writes 64-bit words
  into memory the group's ranks map together (a file in ``/dev/shm``) and polls the
  others'. A word is ``(k << 40) | payload`` where ``k`` counts the group's checks
  (24 bits, the same on every rank of a correct program). Rank ``r``'s words of check
  ``k`` sit at ``3 * ((k & 1) * size + r)``: the signature, then the two extents, which
  only gathers write (a reader needs them only when the signatures agree, that is when
  the writer made the same gather). Every word carries ``k``, so a reader waits for each
  one itself; an aligned 8-byte store or load is one instruction on x86-64 and aarch64
  (no torn words), and the data moves through MPI afterwards, so the check needs no
  fences. One corner assumes stores become visible in order (x86-64 does; aarch64 need
  not): an extent word last written exactly ``2**24`` checks earlier carries the same
  ``k`` as the one being written. Two parities suffice: a rank starts check
  ``k + 2`` only after every rank wrote its signature for ``k + 1``, that is after every
  rank finished reading the words of ``k``.
* :class:`MessageBoard` (ranks on several nodes): one 24-byte ``Iallgather`` per check.

A rank that never reaches the check leaves the others waiting (a :class:`Board` spins
politely, yielding the core after a short tight spin) until ``PYMPAR_TIMEOUT``; without a
timeout they wait for ever, as they would in the MPI call the check replaces. While it
yields, a waiting rank also drives MPI's progress engine (one ``Iprobe`` per look), as a
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

from . import debug

__all__ = ["Board", "MessageBoard", "create", "REFUSED", "MAX_EXTENT"]

#: Where the shared boards' files are made (memory-backed on Linux); without it, messages.
SHARED_DIR = "/dev/shm"
#: Whether groups on one node check through shared memory (tests switch it off to force
#: the message path; read when a group is created).
_ENABLED = True
#: Polls of a tight spin before each further poll yields the core (8 ranks on 2 cores
#: must not starve the rank they wait for).
_TIGHT = 200
#: The signature of a rank that refuses its own arguments (calls' signatures are odd).
REFUSED = 0
#: Extents at or above this do not fit a board word (40 bits).
MAX_EXTENT = 1 << 40
_PAYLOAD = MAX_EXTENT - 1
_COUNT = (1 << 24) - 1
_NAME_BYTES = 256
# Give the core to another runnable process (time.sleep(0) where the OS has no sched_yield).
_YIELD = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))


class Board:
    """One group's shared-memory words: two parities of three 64-bit words per rank.

    Parameters
    ----------
    memory : mmap.mmap
        The shared mapping of ``6 * size`` words (zeroed).
    size, rank : int
        The group's size and this process's rank in it.
    """

    __slots__ = ("memory", "slots", "size", "rank", "count")

    shared = True

    def __init__(self, memory: mmap.mmap, size: int, rank: int) -> None:
        self.memory, self.size, self.rank = memory, size, rank
        # A memoryview, not NumPy: indexing it with a Python int costs ~40 ns, a NumPy
        # scalar operation ~1 us.
        self.slots = memoryview(memory).cast("Q")
        self.count = 0  # checks made; word 0 (all slots at start) never carries k >= 1

    def publish(self, sig: int, extent: int = 0, claim: int = 0, gathers: bool = False) -> int:
        """Write this rank's words for the next check; return the signature word (the token).

        ``extent`` and ``claim`` (each below :data:`MAX_EXTENT`) are written only when
        ``gathers``.
        """
        k = self.count = (self.count + 1) & _COUNT
        tag = k << 40
        at = 3 * ((k & 1) * self.size + self.rank)
        slots = self.slots
        if gathers:
            slots[at + 1] = tag | extent
            slots[at + 2] = tag | claim
        word = slots[at] = tag | sig
        return word

    def wait(self, word: int, group: Any, what: str, timeout: float | None) -> bool:
        """Wait until every rank wrote its signature of ``word``'s check; whether all equal it.

        Returns False as soon as a signature differs: every rank sees the same words, so
        every rank returns False (and then meets the others in the mismatch report).

        Raises
        ------
        pympar.debug.CollectiveTimeoutError
            When ``timeout`` seconds pass before every rank wrote its word.
        """
        slots, k = self.slots, word >> 40
        lo = 3 * (k & 1) * self.size
        deadline = None  # one deadline for the whole wait, set when a rank is late
        for at in range(lo, lo + 3 * self.size, 3):
            seen = slots[at]
            if seen >> 40 != k:
                if deadline is None and timeout is not None:
                    deadline = time.monotonic() + timeout
                seen = self._spin(at, k, group, what, timeout, deadline)
            if seen != word:
                return False
        return True

    def extents(self, word: int, group: Any, what: str,
                timeout: float | None) -> tuple[list[int], list[int]]:
        """Every rank's extent and claim of an agreed gather check (after :meth:`wait`)."""
        slots, k = self.slots, word >> 40
        lo = 3 * (k & 1) * self.size
        values = []
        deadline = None if timeout is None else time.monotonic() + timeout
        for at in range(lo, lo + 3 * self.size):
            if at % 3:
                seen = slots[at]
                if seen >> 40 != k:
                    seen = self._spin(at, k, group, what, timeout, deadline)
                values.append(seen & _PAYLOAD)
        return values[0::2], values[1::2]

    def _spin(self, at: int, k: int, group: Any, what: str, timeout: float | None,
              deadline: float | None) -> int:
        """Poll word ``at`` until it carries check ``k``: tight first, then yielding the core."""
        slots = self.slots
        for _ in range(_TIGHT):
            seen = slots[at]
            if seen >> 40 == k:
                return seen
        yield_core, poke = _YIELD, group.comm.Iprobe
        while True:
            yield_core()
            # Drive MPI's progress engine, as a waiting MPI call would: the rank we wait
            # for may be inside a send that completes only when this rank progresses a
            # receive it posted earlier (MPICH has no progress thread by default).
            poke()
            seen = slots[at]
            if seen >> 40 == k:
                return seen
            # A yield costs a system call or a time slice: reading the clock is cheap beside it.
            if deadline is not None and time.monotonic() >= deadline:
                raise debug.timeout_error(what, group, timeout, None)

    def free(self) -> None:
        """Unmap the words (local; kept collective-safe for callers that free groups together)."""
        self.slots.release()
        self.memory.close()


class MessageBoard:
    """The same check for ranks on several nodes: one ``Iallgather`` of three int64 per rank.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The group's communicator.
    """

    __slots__ = ("comm", "mine", "table", "request")

    shared = False

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self.mine = np.zeros(3, np.int64)
        self.table = np.zeros((comm.Get_size(), 3), np.int64)
        self.request = MPI.REQUEST_NULL  # one check in flight per group at a time

    def publish(self, sig: int, extent: int = 0, claim: int = 0, gathers: bool = False) -> int:
        """Start the exchange of this rank's numbers; return the signature (the token)."""
        mine = self.mine
        mine[0], mine[1], mine[2] = sig, extent, claim
        self.request = self.comm.Iallgather([mine, MPI.INT64_T], [self.table, MPI.INT64_T])
        return sig

    def wait(self, sig: int, group: Any, what: str, timeout: float | None) -> bool:
        """Finish the exchange; whether every rank's signature equals ``sig``.

        Raises
        ------
        pympar.debug.CollectiveTimeoutError
            When ``timeout`` seconds pass first; the error carries the pending request.
        """
        if timeout is None:
            self.request.Wait()
        else:
            debug.wait(self.request, what, group, timeout, time.monotonic())
        column = self.table[:, 0]
        return bool(column.min() == sig == column.max())

    def extents(self, sig: int, group: Any, what: str,
                timeout: float | None) -> tuple[list[int], list[int]]:
        """Every rank's extent and claim of an agreed gather check (after :meth:`wait`)."""
        return self.table[:, 1].tolist(), self.table[:, 2].tolist()

    def free(self) -> None:
        """Nothing to release (kept for symmetry with :class:`Board`)."""


def create(comm: MPI.Intracomm) -> Board | MessageBoard | None:
    """The board of ``comm``: shared memory when all its ranks share a node (collective).

    None for a communicator of one rank; a :class:`MessageBoard` when the ranks span
    nodes, shared memory cannot be set up, or :data:`_ENABLED` is off.

    Rank 0 creates a file of ``6 * size`` words in :data:`SHARED_DIR` (``/dev/shm``, memory
    only), the others open it by the name it broadcasts, each maps it, and once all have
    it mapped rank 0 unlinks it: nothing is left behind, even if the job dies later. Any
    failure (no such directory, ranks on several nodes) gives a :class:`MessageBoard` on
    every rank, so that every rank of the group takes the same path. Plain files rather
    than an MPI shared window: Open MPI's one-sided components print errors on machines
    without UCX hardware when a window is created, once per rank and group.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return None
    if not _ENABLED:  # alike on every rank; SHARED_DIR is tried by rank 0
        return MessageBoard(comm)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    together = node.Get_size() == size
    node.Free()
    if not together:
        return MessageBoard(comm)
    nbytes = 6 * size * 8
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
        return MessageBoard(comm)
    return board
