"""The boards of the agreement check: one 64-bit word per rank and check (private).

Before its data call every rank of a group writes the call's 32-bit signature (odd;
:data:`REFUSED` for a rank refusing its own arguments) and reads every rank's; the group
agrees when all equal this rank's. Ranks making different calls meet in the same exchange.

* :class:`Board` (one node): each rank writes its word into a shared mapping (a file in
  ``/dev/shm``) and polls the others'. Check ``k`` (1 to ``2**32 - 2``) writes ``k << 32 |
  signature`` at ``(k & 1) * size + rank``: aligned 8-byte stores and loads are single
  instructions on x86-64 and aarch64 and the data moves through MPI afterwards, so no
  fences; a rank starts check ``k + 2`` only after every rank read the words of ``k``.
* :class:`MessageBoard` (several nodes): one 8-byte ``Iallgather`` per check.

A late rank makes the others raise after the watchdog's timeout; one that ended
(:func:`depart`), :class:`~pympar.errors.PeerEndedError` at once. A waiting rank yields
its core after a short spin and drives MPI's progress (``Iprobe``).
"""
from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import time
import weakref
from typing import Any

import numpy as np
from mpi4py import MPI

from .errors import ended_error, timeout_error, wait

__all__ = ["Board", "MessageBoard", "create", "depart", "REFUSED", "DEPARTED"]

#: Where the shared boards' files are made (memory-backed on Linux); without it, messages.
SHARED_DIR = "/dev/shm"
#: Whether groups on one node check through shared memory (read when a group is created;
#: tests switch it off to take the message path).
SHARED = True
#: Polls of a tight spin before each further poll yields the core.
_TIGHT = 200
#: The signature of a rank that refuses its own arguments (calls' signatures are odd).
REFUSED = 0
DEPARTED = 2  #: The signature of a rank that ended, on a message board.
_LAST = 2**32 - 2  # the last check count before wrapping to 1 (even: parities alternate)
_GONE = 2**32 - 1  # the count field of an ended rank's word: no check reaches it
_LIVE: Any = weakref.WeakSet()  # the boards not yet freed, for depart()
_NAME_BYTES = 256
# Give the core to another runnable process (time.sleep(0) where the OS has no sched_yield).
_YIELD = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))


class Board:
    """One group's shared words (``memory``: ``2 * size`` zeroed 64-bit words)."""

    __slots__ = ("memory", "slots", "halves", "size", "rank", "count", "__weakref__")

    shared = True

    def __init__(self, memory: mmap.mmap, size: int, rank: int) -> None:
        self.memory, self.size, self.rank = memory, size, rank
        # A memoryview, not NumPy: indexing it with a Python int costs ~40 ns.
        self.slots = memoryview(memory).cast("Q")
        # The words of the even and the odd checks: check k writes and reads halves[k & 1].
        self.halves = (self.slots[:size], self.slots[size:2 * size])
        self.count = 0  # checks made; word 0 (all slots at start) never carries k >= 1
        _LIVE.add(self)

    def agree(self, sig: int, group: Any, what: str, timeout: float | None) -> bool:
        """Write ``sig`` for the next check, wait for every rank's, and tell whether all equal
        it (the same answer on every rank); CollectiveTimeoutError after ``timeout`` s."""
        k = self.count = self.count + 1 if self.count < _LAST else 1
        word, half = k << 32 | sig, self.halves[k & 1]
        half[self.rank] = word
        # Every rank there already with the same word (so for the last to arrive): one pass
        # in C, 0.3 us less than the loop below on 2 ranks.
        if half.tolist().count(word) == self.size:
            return True
        deadline = None  # one deadline for the whole wait, set when a rank is late
        for at in range(self.size):
            seen = half[at]
            if seen >> 32 != k:
                if deadline is None and timeout is not None:
                    deadline = time.monotonic() + timeout
                seen = self._spin(half, at, k, group, what, timeout, deadline)
            if seen != word:
                return False
        return True

    def _spin(self, half: memoryview, at: int, k: int, group: Any, what: str,
              timeout: float | None, deadline: float | None) -> int:
        """Poll word ``at`` of ``half`` until it carries check ``k``: tight, then yielding
        the core."""
        for _ in range(_TIGHT):
            seen = half[at]
            if seen >> 32 == k:
                return seen
        yield_core, poke = _YIELD, group.comm.Iprobe
        while True:
            yield_core()
            poke()
            seen = half[at]
            if seen >> 32 == k:
                return seen
            gone = seen >> 32 == _GONE
            if gone or deadline is not None and time.monotonic() >= deadline:
                counts = [w >> 32 for w in half.tolist()]
                if gone:
                    raise ended_error(what, group, [r for r, c in enumerate(counts) if c == _GONE])
                raise timeout_error(what, group, timeout, None,
                                    [r for r, c in enumerate(counts) if c != k])

    def depart(self) -> None:
        """Mark this rank ended in the next check's slot (others may still read this one's)."""
        k = self.count + 1 if self.count < _LAST else 1
        self.slots[(k & 1) * self.size + self.rank] = _GONE << 32

    def free(self) -> None:
        """Unmap the words."""
        _LIVE.discard(self)
        for view in (*self.halves, self.slots):
            view.release()
        self.memory.close()


class MessageBoard:
    """The same check for ranks on several nodes: one ``Iallgather`` of an int64 per rank."""

    __slots__ = ("comm", "mine", "table", "__weakref__")

    shared = False

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self.mine = np.zeros(1, np.int64)
        self.table = np.zeros(comm.Get_size(), np.int64)
        _LIVE.add(self)

    def agree(self, sig: int, group: Any, what: str, timeout: float | None) -> bool:
        """Exchange ``sig``; whether every rank's equals it (see :meth:`Board.agree`)."""
        self.mine[0] = sig
        wait(self.comm.Iallgather([self.mine, MPI.INT64_T], [self.table, MPI.INT64_T]),
             what, group, timeout)
        same = bool(self.table.min() == sig == self.table.max())
        if not same and DEPARTED in self.table:
            raise ended_error(what, group, np.flatnonzero(self.table == DEPARTED).tolist())
        return same

    def depart(self) -> None:
        """Join the others' next check as an ended rank (never completed here: it ends)."""
        self.mine[0] = DEPARTED
        self.comm.Iallgather([self.mine, MPI.INT64_T], [self.table, MPI.INT64_T])

    def free(self) -> None:
        """Forget the board."""
        _LIVE.discard(self)


def depart() -> None:
    """Tell every rank waiting for this one on a live board that it has ended."""
    for board in list(_LIVE):
        board.depart()


def create(comm: MPI.Intracomm) -> Board | MessageBoard | None:
    """The board of ``comm`` (collective): None for one rank, shared memory when every rank
    shares a node, else (or when anything fails, or :data:`SHARED` is off) messages.

    Rank 0 creates the file and unlinks it once all have mapped it. Plain files rather than
    an MPI shared window: Open MPI's one-sided components print errors without UCX hardware.
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
    nbytes, board = 2 * size * 8, None
    name = np.zeros(_NAME_BYTES, dtype=np.uint8)  # the path as bytes: nothing pickled
    if rank == 0:
        path = f"{SHARED_DIR}/pympar-board-{os.getpid()}-{secrets.token_hex(8)}".encode()
        with contextlib.suppress(OSError):  # an empty name: no board anywhere
            if len(path) < _NAME_BYTES:
                with open(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600), "wb") as file:
                    file.truncate(nbytes)  # zero-filled
                name[:len(path)] = np.frombuffer(path, dtype=np.uint8)
    comm.Bcast(name, root=0)
    path = bytes(name).rstrip(b"\0")
    if path:
        with contextlib.suppress(OSError, ValueError):
            with open(os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0)), "r+b") as file:
                board = Board(mmap.mmap(file.fileno(), nbytes), size, rank)
    # Every rank takes the shared path or none does; the reduction is also the barrier
    # after which nobody opens the file any more.
    agreed = np.array([board is not None], dtype=np.int32)
    comm.Allreduce(MPI.IN_PLACE, agreed, op=MPI.LAND)
    if rank == 0 and path:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if agreed[0]:
        return board
    if board is not None:
        board.free()
    return MessageBoard(comm)
