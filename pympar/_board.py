"""The boards of the agreement check: one 64-bit word per rank and check (private).

Before its data call every rank of a group writes the call's 32-bit signature (odd;
:data:`REFUSED` for a rank refusing its own arguments) and reads every rank's; the group
agrees when all equal this rank's. Ranks making different calls meet in the same exchange.

* :class:`Board` (one node): each rank writes its word into a shared mapping (a file in
  ``/dev/shm``) and polls the others'. Check ``k`` (1 to ``2**32 - 2``) writes ``k << 32 |
  signature`` at ``(k & 1) * size + rank``: aligned 8-byte stores and loads are single
  instructions on x86-64 and aarch64 and the data moves through MPI afterwards, so no
  fences; a rank starts check ``k + 2`` only after every rank read the words of ``k``.
* :class:`NodeBoard` (several nodes): the words of each node's ranks in its shared memory,
  one 8-byte ``Iallgather`` among the nodes' leaders, the verdict back through the node's
  memory. A check across nodes costs one exchange among the leaders, whatever the ranks
  per node.

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
import zlib
import weakref
from typing import Any

import numpy as np
from mpi4py import MPI

from . import errors
from .errors import CollectiveTimeoutError, ended_error, timeout_error, wait, yield_core

__all__ = ["Board", "NodeBoard", "create", "depart", "REFUSED", "DEPARTED"]

#: Where the shared boards' files are made (memory-backed on Linux); without it, messages.
SHARED_DIR = "/dev/shm"
#: Whether ranks on one node share memory for the check (read when a group is created;
#: tests switch it off to take the path across nodes: every rank a node of its own).
SHARED = True
#: The signature of a rank that refuses its own arguments (calls' signatures are odd).
REFUSED = 0
DEPARTED = 2  #: The signature of a rank that ended, in the leaders' exchange.
MIXED = 4  # a node whose ranks' words differ, in the leaders' exchange
_AGREE, _DISAGREE, _ENDED = 1, 0, 2  # verdicts: _ENDED + r, group rank r ended
_LOW = 2**32 - 1
#: Leaders up to this many exchange their words directly (each with each), beyond it in one
#: Iallgather (logarithmic, but a leader that times out cannot tell whom it misses).
DIRECT_LEADERS = 16
_TAG = 46  # the leaders' direct words
_startall, _testall = MPI.Prequest.Startall, MPI.Request.Testall
_LAST = 2**32 - 2  # the last check count before wrapping to 1 (even: parities alternate)
_GONE = 2**32 - 1  # the count field of an ended rank's word: no check reaches it
_LIVE: Any = weakref.WeakSet()  # the boards not yet freed, for depart()
_NAME_BYTES = 256


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
                seen = _await_word(half, at, k, group, what, timeout, deadline)
            if seen != word:
                return False
        return True

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


class NodeBoard:
    """The check of a group across nodes: the shared words within each node, one exchange
    among the nodes' leaders, and the verdict back in the node's shared memory.

    Each rank writes its word as on a :class:`Board` of its node's ranks of the group; the
    node's leader (its lowest rank) waits for them, joins one 8-byte ``Iallgather`` among
    the leaders (its node's signature, or mixed, and a rank that ended), and writes the
    verdict (agree, disagree, rank ``r`` ended) where the node's other ranks wait for it.
    Groups with one rank per node are all leaders: the one exchange. Up to
    :data:`DIRECT_LEADERS` leaders send their word to each other leader instead (persistent
    requests, the same one round trip), so that a leader that times out names the leaders
    it did not hear from.

    Parameters
    ----------
    memory : mmap.mmap or None
        ``2 * len(members) + 2`` zeroed 64-bit words shared by the node's ranks (None for a
        node of one rank).
    members : list of int
        The group ranks on this node, the leader first.
    node_rank : int
        This rank's index in ``members``.
    leaders : mpi4py.MPI.Intracomm or None
        The leaders' communicator, on the leader (None on the others).
    leader_ranks : list of int
        The group rank of each leader (by its rank in ``leaders``).
    node_sizes : list of int
        The ranks of the group on each leader's node.
    """

    __slots__ = ("memory", "slots", "halves", "verdicts", "members", "node_rank", "leaders",
                 "leader_ranks", "node_sizes", "me", "mine", "table", "requests", "count", "__weakref__")

    shared = False

    def __init__(self, memory: mmap.mmap | None, members: list[int], node_rank: int,
                 leaders: MPI.Intracomm | None, leader_ranks: list[int],
                 node_sizes: list[int]) -> None:
        n = len(members)
        self.memory, self.members, self.node_rank, self.leaders = memory, members, node_rank, \
            leaders
        words = memoryview(memory if memory is not None else bytearray(8 * (2 * n + 2)))
        self.slots = words.cast("Q")
        self.halves = (self.slots[:n], self.slots[n:2 * n])
        self.verdicts = self.slots[2 * n:2 * n + 2]
        self.leader_ranks, self.node_sizes = leader_ranks, node_sizes
        self.mine = np.zeros(1, np.int64)
        self.table = np.zeros(len(leader_ranks) if leaders is not None else 0, np.int64)
        self.requests: list[MPI.Prequest] = []
        self.me = leaders.Get_rank() if leaders is not None else -1
        if leaders is not None and len(leader_ranks) <= DIRECT_LEADERS:
            others = [q for q in range(len(leader_ranks)) if q != self.me]
            self.requests = [leaders.Recv_init([self.table[q:q + 1], MPI.INT64_T], q, _TAG)
                             for q in others]
            self.requests += [leaders.Send_init([self.mine, MPI.INT64_T], q, _TAG)
                              for q in others]
        self.count = 0
        _LIVE.add(self)

    def agree(self, sig: int, group: Any, what: str, timeout: float | None) -> bool:
        """As :meth:`Board.agree`, over every node (the same answer on every rank)."""
        k = self.count = self.count + 1 if self.count < _LAST else 1
        half = self.halves[k & 1]
        half[self.node_rank] = k << 32 | sig
        verdict = (self._await_verdict(k, group, what, timeout) if self.leaders is None else
                   self._decide(k, sig, half, group, what, timeout))
        if verdict == _AGREE:
            return True
        if verdict == _DISAGREE:
            return False
        raise ended_error(what, group, [verdict - _ENDED])

    def _decide(self, k: int, sig: int, half: memoryview, group: Any, what: str,
                timeout: float | None) -> int:
        """The leader: its node's words of check ``k``, the leaders' exchange, the verdict
        written for the node."""
        word, value, deadline = k << 32 | sig, sig, None
        if len(self.members) > 1 and half.tolist().count(word) != len(self.members):
            for at in range(1, len(self.members)):
                seen = half[at]
                if seen >> 32 != k:
                    if deadline is None and timeout is not None:
                        deadline = time.monotonic() + timeout
                    seen = _await_word(half, at, k, group, what, timeout, deadline,
                                       self.members, ended_too=True)
                if seen >> 32 == _GONE:
                    value = (self.members[at] + 1) << 32 | DEPARTED
                    break
                if seen != word:
                    value = MIXED
        self.mine[0] = value
        table, requests = self.table, self.requests
        if requests:
            table[self.me] = value
            _startall(requests)
            for _ in range(errors.SPINS):  # the words come within microseconds: no wait()'s frame
                if _testall(requests):
                    break
            else:
                self._wait_direct(group, what, timeout)
        else:
            wait(self.leaders.Iallgather([self.mine, MPI.INT64_T], [table, MPI.INT64_T]),
                 what, group, timeout)
        words = table.tolist()
        if words.count(sig) == len(words):  # (a node's sig only when it is not mixed)
            verdict = _AGREE
        else:
            ended = [w >> 32 for w in words if w >> 32]
            verdict = _ENDED + ended[0] - 1 if ended else _DISAGREE
        self.verdicts[k & 1] = k << 32 | verdict
        return verdict

    def _wait_direct(self, group: Any, what: str, timeout: float | None) -> None:
        """Wait for the other leaders' words; a timeout names those not heard from."""
        try:
            wait(self.requests, what, group, timeout)
        except CollectiveTimeoutError:
            others = [q for q in range(len(self.table)) if q != self.me]
            heard = [q for q, r in zip(others, self.requests) if not r.Test()]
            raise timeout_error(what, group, timeout, list(self.requests),
                                [self.leader_ranks[q] for q in heard],
                                across=any(self.node_sizes[q] > 1 for q in heard)) from None

    def _await_verdict(self, k: int, group: Any, what: str, timeout: float | None) -> int:
        """A rank that is not its node's leader: the verdict of check ``k``."""
        verdicts, at = self.verdicts, k & 1
        for _ in range(errors.SPINS):
            seen = verdicts[at]
            if seen >> 32 == k:
                return seen & _LOW
        deadline = None if timeout is None else time.monotonic() + timeout
        poke = group.comm.Iprobe
        leader = (self.halves[0], self.halves[1])
        while True:
            yield_core()
            poke()
            seen = verdicts[at]
            if seen >> 32 == k:
                return seen & _LOW
            if leader[0][0] >> 32 == _GONE or leader[1][0] >> 32 == _GONE:
                raise ended_error(what, group, [self.members[0]])
            if deadline is not None and time.monotonic() >= deadline:
                late = [self.members[q] for q, w in enumerate(self.halves[at].tolist())
                        if w >> 32 != k]
                raise timeout_error(what, group, timeout, None, late or None)

    def depart(self) -> None:
        """Mark this rank ended in the next check's slot; a leader also joins the leaders'
        next exchange as ended (never completed here: it ends)."""
        k = self.count + 1 if self.count < _LAST else 1
        self.halves[k & 1][self.node_rank] = _GONE << 32
        if self.leaders is not None:
            self.mine[0] = (self.members[0] + 1) << 32 | DEPARTED
            if self.requests:
                me = self.leaders.Get_rank()
                for q in range(len(self.table)):
                    if q != me:
                        self.leaders.Isend([self.mine, MPI.INT64_T], q, _TAG)
            else:
                self.leaders.Iallgather([self.mine, MPI.INT64_T], [self.table, MPI.INT64_T])

    def free(self) -> None:
        """Unmap the words and free the leaders' communicator."""
        _LIVE.discard(self)
        for view in (*self.halves, self.verdicts, self.slots):
            view.release()
        if self.memory is not None:
            self.memory.close()
        if self.leaders is not None:
            for request in self.requests:
                request.Free()
            self.requests = []
            self.leaders.Free()
            self.leaders = None


def _await_word(half: memoryview, at: int, k: int, group: Any, what: str,
                timeout: float | None, deadline: float | None, members: list[int] | None = None,
                ended_too: bool = False, alone: bool = False) -> int:
    """Poll word ``at`` of ``half`` until it carries check ``k`` (tight, then yielding the
    core and driving MPI's progress); an ended rank's word is returned with ``ended_too``,
    else raises :class:`~pympar.errors.PeerEndedError`. ``members``: the group ranks of the
    words (default: word ``q`` is rank ``q``). The errors name every rank whose word is
    late or ended, or with ``alone`` that of word ``at`` only (the others' may rightly lag:
    a neighbour check reads only the neighbours')."""
    for _ in range(errors.SPINS):
        seen = half[at]
        if seen >> 32 == k:
            return seen
    poke = group.comm.Iprobe
    while True:
        yield_core()
        poke()
        seen = half[at]
        if seen >> 32 == k:
            return seen
        gone = seen >> 32 == _GONE
        if gone and ended_too:
            return seen
        if gone or deadline is not None and time.monotonic() >= deadline:
            name = members.__getitem__ if members is not None else int
            counts = [w >> 32 for w in half.tolist()]
            if gone:
                raise ended_error(what, group, [name(at)] if alone else
                                  [name(r) for r, c in enumerate(counts) if c == _GONE])
            raise timeout_error(what, group, timeout, None, [name(at)] if alone else
                                [name(r) for r, c in enumerate(counts) if c != k])


def depart() -> None:
    """Tell every rank waiting for this one on a live board that it has ended."""
    for board in list(_LIVE):
        board.depart()


def _map_shared(comm: MPI.Intracomm, nbytes: int) -> mmap.mmap | None:
    """``nbytes`` of zeroed memory shared by the ranks of ``comm`` (one node; collective), or
    None on every rank when any rank could not map it.

    Rank 0 creates the file and unlinks it once all have mapped it. Plain files rather than
    an MPI shared window: Open MPI's one-sided components print errors without UCX hardware.
    """
    memory = None
    name = np.zeros(_NAME_BYTES, dtype=np.uint8)  # the path as bytes: nothing pickled
    if comm.Get_rank() == 0:
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
                memory = mmap.mmap(file.fileno(), nbytes)
    # Every rank maps it or none does; the reduction is also the barrier after which nobody
    # opens the file any more.
    agreed = np.array([memory is not None], dtype=np.int32)
    comm.Allreduce(MPI.IN_PLACE, agreed, op=MPI.LAND)
    if comm.Get_rank() == 0 and path:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if agreed[0]:
        return memory
    if memory is not None:
        memory.close()
    return None


def _outnumber_cores(comm: MPI.Intracomm) -> bool:
    """Whether the ranks of ``comm`` on this rank's host outnumber the cores they may run on
    (collective). By host name rather than ``COMM_TYPE_SHARED``: emulated nodes share one
    host's cores; ranks bound to a core each do not count as sharing."""
    host = comm.Split(zlib.crc32(MPI.Get_processor_name().encode()) & 0x7FFFFFFF, comm.Get_rank())
    try:
        affinity = getattr(os, "sched_getaffinity", None)
        mine = affinity(0) if affinity else set(range(os.cpu_count() or 1))
        return host.Get_size() > len(set().union(*host.allgather(mine)))
    finally:
        host.Free()


def create(comm: MPI.Intracomm) -> Board | NodeBoard | None:
    """The board of ``comm`` (collective): None for one rank; a :class:`Board` when every rank
    shares a node; else a :class:`NodeBoard` over the ranks' nodes (``COMM_TYPE_SHARED``),
    with one rank a node where shared memory cannot be had or :data:`SHARED` is off."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return None
    if _outnumber_cores(comm):
        errors.share_cores()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED) if SHARED else comm.Split(rank, 0)
    try:
        n = node.Get_size()
        memory = _map_shared(node, 8 * (2 * n if n == size else 2 * n + 2)) if n > 1 else None
        members = node.allgather(rank) if memory is not None else [rank]
    finally:
        node.Free()
    if len(members) == size:
        return Board(memory, size, rank)
    # Without shared memory (alike on every rank of a node) each rank is a node of its own.
    leader = members[0] == rank
    leaders = comm.Split(0 if leader else MPI.UNDEFINED, rank)
    leader_ranks, node_sizes = zip(*leaders.allgather((rank, len(members)))) if leader else \
        ((), ())
    return NodeBoard(memory, members, members.index(rank), leaders if leader else None,
                     list(leader_ranks), list(node_sizes))
