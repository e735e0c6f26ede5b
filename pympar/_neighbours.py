"""The agreement check with the neighbours only: a halo exchange's (private).

A halo exchange talks to at most two ranks per axis, and only their arguments can hurt it,
so it checks with them alone: its cost and its waiting do not grow with the group, and a
late rank holds up only its neighbours. Each rank writes its word (check count and
signature, as on a :class:`pympar._board.Board`) where its neighbours read it: in the shared
memory of its node for the neighbours there, in one 8-byte message to each neighbour on
another node. A rank starts check ``k + 2`` only after its neighbours, the only readers of
its word, have written theirs of ``k + 1``, so two words per rank suffice.

A mismatch raises on both ranks of every pair that differs. The ranks beyond cannot learn it
in the same check; the caller makes the ranks that raise tell the neighbours that agreed
(see :mod:`pympar.halo`), so that nobody waits for data that does not come.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import numpy as np
from mpi4py import MPI

from . import _board
from .errors import ended_error, wait

__all__ = ["NeighbourBoard"]

#: The tag of the words sent to neighbours on other nodes, and of the mismatch report.
WORD_TAG, REPORT_TAG = 43, 44


class NeighbourBoard:
    """The check of one rank with its ``neighbours`` (ranks of ``comm``, a symmetric relation:
    a rank is its neighbour's neighbour); creating one is collective over ``comm``.

    Attributes
    ----------
    neighbours : list of int
        The ranks checked with (``MPI.PROC_NULL`` and this rank left out).
    words_read : int
        The neighbours' words read so far (one per neighbour and check: the cost of a check,
        whatever the size of the group).
    """

    def __init__(self, comm: MPI.Intracomm, neighbours: Any) -> None:
        rank = comm.Get_rank()
        self.neighbours = sorted({int(r) for r in neighbours} - {MPI.PROC_NULL, rank})
        node = comm.Split_type(MPI.COMM_TYPE_SHARED) if _board.SHARED else comm.Split(rank, 0)
        try:
            n = node.Get_size()
            memory = _board._map_shared(node, 16 * n) if n > 1 else None
            members = node.allgather(rank) if memory is not None else [rank]
        finally:
            node.Free()
        self.comm, self.memory, self.count, self.words_read = comm, memory, 0, 0
        words = memoryview(memory if memory is not None else bytearray(16)).cast("Q")
        n = len(members)
        self.halves = (words[:n], words[n:2 * n])
        self.slot, self.members = members.index(rank), members
        self.local = [(members.index(r), r) for r in self.neighbours if r in members]
        self.remote = [r for r in self.neighbours if r not in members]
        self.word = np.zeros(1, np.int64)
        self.received = np.zeros(len(self.remote), np.int64)
        self.requests = [comm.Recv_init([self.received[i:i + 1], MPI.INT64_T], r, WORD_TAG)
                         for i, r in enumerate(self.remote)]
        self.requests += [comm.Send_init([self.word, MPI.INT64_T], r, WORD_TAG)
                          for r in self.remote]
        weakref.finalize(self, _release, self.requests, self.halves, memory)
        _board._LIVE.add(self)

    def agree(self, sig: int, group: Any, what: str, timeout: float | None) -> list[int]:
        """Write ``sig`` for the next check and read the neighbours' words: the neighbours
        whose word differs (empty when all agree). Raises
        :class:`~pympar.errors.PeerEndedError` for a neighbour that ended and
        :class:`~pympar.errors.CollectiveTimeoutError` after ``timeout`` s (naming it)."""
        k = self.count = self.count + 1 if self.count < _board._LAST else 1
        word, half = k << 32 | sig, self.halves[k & 1]
        half[self.slot] = word
        requests = self.requests
        if requests:
            self.word[0] = word
            MPI.Prequest.Startall(requests)
        differ = []
        for at, r in self.local:
            seen = half[at]
            if seen >> 32 != k:
                deadline = None if timeout is None else time.monotonic() + timeout
                seen = _board._await_word(half, at, k, group, what, timeout, deadline,
                                          self.members, alone=True)
            if seen != word:
                differ.append(r)
        if requests:
            wait(requests, what, group, timeout)
            for r, seen in zip(self.remote, self.received.tolist()):
                if seen >> 32 == _board._GONE:
                    raise ended_error(what, group, [r])
                if seen != word:
                    differ.append(r)
        self.words_read += len(self.neighbours)
        return differ

    def depart(self) -> None:
        """Mark this rank ended where its neighbours read its next word."""
        k = self.count + 1 if self.count < _board._LAST else 1
        self.halves[k & 1][self.slot] = _board._GONE << 32
        if self.remote:
            self._gone = np.array([_board._GONE << 32], np.int64)  # alive until it is sent
            for r in self.remote:
                self.comm.Isend([self._gone, MPI.INT64_T], r, WORD_TAG)


def _release(requests: list, halves: tuple, memory: Any) -> None:
    for req in requests:
        if req != MPI.REQUEST_NULL:
            req.Free()
    for view in halves:
        view.release()
    if memory is not None:
        memory.close()
