"""``Group``: one MPI intracommunicator with a name and its members' global ranks.

The array collectives (``all_reduce``, ``all_gather``, ``reduce_scatter``,
``all_to_all``, ``broadcast``) are methods of the group that delegate to
:mod:`pympar.collectives`.
"""

from __future__ import annotations

from typing import Sequence

from mpi4py import MPI

from . import collectives as _collectives
from ._comm_state import CommState, freed_error

__all__ = ["Group"]


class Group:
    """A process group: an mpi4py intracommunicator plus a name and global ranks.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The communicator; its rank ``i`` is the member ``ranks[i]``.
    name : str
        Axis key and member ranks, e.g. ``"tp-0-1"``.
    ranks : sequence of int
        Global ranks (ranks in the mesh's parent communicator) in group order.
    owns_comm : bool, optional
        Whether :meth:`free` may free ``comm``. Groups made by ``Comm.Split``
        own their communicator; a group wrapping ``COMM_WORLD`` does not.

    Attributes
    ----------
    comm : mpi4py.MPI.Intracomm
    name : str
    ranks : tuple of int
    rank : int
        This process's position in the group (its local rank).
    size : int
        Number of members.

    Notes
    -----
    Collectives: :meth:`all_reduce`, :meth:`all_gather`, :meth:`reduce_scatter`,
    :meth:`all_to_all` and :meth:`broadcast` take NumPy or CuPy arrays and
    return arrays of the same module and dtype. Every member must call them in
    the same order with matching arguments (``PYMPAR_DEBUG=1`` checks it). A
    group caches MPI counts and scratch buffers, so it is not thread-safe. "Rank" in
    the collectives' arguments (``root``, the order of ``sizes``) is the rank in this
    group, :attr:`rank`, not the global rank.

    Creating a group of more than one rank is collective over ``comm`` (like the
    ``Comm.Split`` that made it): when all members share a node, the group allocates the
    small shared-memory board of its agreement check; :meth:`free` unmaps it.
    """

    def __init__(self, comm: MPI.Intracomm, name: str, ranks: Sequence[int],
                 owns_comm: bool = True) -> None:
        self.comm = comm
        self.name = name
        self.ranks = tuple(int(r) for r in ranks)
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        if self.size != len(self.ranks):
            raise ValueError(f"group {name}: communicator has {self.size} ranks "
                             f"but {len(self.ranks)} global ranks were given")
        self._owns_comm = owns_comm
        # The collectives' plans, scratch buffers and agreement board (collective).
        self._state = CommState(comm)

    def __repr__(self) -> str:
        return f"Group({self.name!r}, rank={self.rank}, size={self.size})"

    all_reduce = _collectives.all_reduce
    all_gather = _collectives.all_gather
    reduce_scatter = _collectives.reduce_scatter
    all_to_all = _collectives.all_to_all
    broadcast = _collectives.broadcast

    def release_buffers(self) -> None:
        """Drop the cached scratch arrays and MPI count plans of the collectives.

        They are rebuilt on the next call; use this to return the memory of
        large temporaries (at most 16 arrays, 2 GiB, per group) after a phase
        with big messages.
        """
        self._state.release()

    def barrier(self) -> None:
        """Block until every member has reached the barrier.

        Raises
        ------
        RuntimeError
            When the group has been freed.
        """
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
