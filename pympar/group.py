"""``Group``: one MPI intracommunicator with a name, its members' global ranks and the
array collectives of :mod:`pympar.collectives` as methods."""

from __future__ import annotations

from typing import Sequence

from mpi4py import MPI

from . import collectives as _collectives
from ._comm_state import CommState, freed_error

__all__ = ["Group", "self_group"]


class Group:
    """A process group: an mpi4py intracommunicator plus a name and global ranks.

    Its collectives (:meth:`all_reduce`, :meth:`all_gather`, :meth:`reduce_scatter`,
    :meth:`all_to_all`, :meth:`broadcast`: :mod:`pympar.collectives`) take NumPy or CuPy
    arrays; every member calls them in the same order with matching arguments, "rank" in
    them (``root``, the order of ``sizes``) meaning :attr:`rank`. A group caches plans and
    scratch buffers (not thread-safe); creating one of several ranks is collective over
    ``comm`` (members on one node map the check's board, which :meth:`free` unmaps).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The communicator; its rank ``i`` is the member ``ranks[i]``.
    name : str
        Axis key and member ranks, e.g. ``"tp-0-1"``.
    ranks : sequence of int
        Global ranks (ranks in the mesh's parent communicator) in group order.
    owns_comm : bool, optional
        Whether :meth:`free` may free ``comm`` (not for a group wrapping ``COMM_WORLD``).

    Attributes
    ----------
    rank : int
        This process's position in the group (its local rank); ``comm``, ``name`` and
        ``ranks`` (a tuple) are the parameters.
    size : int
        Number of members.
    """

    def __init__(self, comm: MPI.Intracomm, name: str, ranks: Sequence[int],
                 owns_comm: bool = True) -> None:
        self.comm, self.name = comm, name
        self.ranks = tuple(int(r) for r in ranks)
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        if self.size != len(self.ranks):
            raise ValueError(f"group {name}: communicator has {self.size} ranks "
                             f"but {len(self.ranks)} global ranks were given")
        self._owns_comm = owns_comm
        self._state = CommState(comm)  # plans, scratch, agreement board (collective)

    def __repr__(self) -> str:
        return f"Group({self.name!r}, rank={self.rank}, size={self.size})"

    all_reduce = _collectives.all_reduce
    all_gather = _collectives.all_gather
    reduce_scatter = _collectives.reduce_scatter
    all_to_all = _collectives.all_to_all
    broadcast = _collectives.broadcast

    def release_buffers(self) -> None:
        """Drop the collectives' cached plans and scratch arrays (at most 16 arrays, 2 GiB),
        rebuilt on the next call: the memory of a phase with big messages comes back."""
        self._state.release()

    def barrier(self) -> None:
        """Block until every member has reached the barrier (RuntimeError once freed)."""
        if self.freed:
            raise freed_error("barrier", self)
        self.comm.Barrier()

    @property
    def freed(self) -> bool:
        """Whether :meth:`free` has released the communicator."""
        return self.comm == MPI.COMM_NULL

    def free(self) -> None:
        """Free the communicator (collective) and unmap the check's board; idempotent."""
        self._state.free()
        if self._owns_comm and not self.freed:
            self.comm.Free()
        self.comm = MPI.COMM_NULL


def self_group() -> Group:
    """A size-1 group holding only this rank (no collective call is needed to make it)."""
    rank = MPI.COMM_WORLD.Get_rank()
    return Group(MPI.COMM_SELF, f"self-{rank}", [rank], owns_comm=False)
