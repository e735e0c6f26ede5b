"""``Group``: one MPI intracommunicator with a name and its members' global ranks."""

from __future__ import annotations

from typing import Sequence

from mpi4py import MPI

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

    def __repr__(self) -> str:
        return f"Group({self.name!r}, rank={self.rank}, size={self.size})"

    def barrier(self) -> None:
        """Block until every member has reached the barrier."""
        self.comm.Barrier()

    @property
    def freed(self) -> bool:
        """Whether :meth:`free` has released the communicator."""
        return self.comm == MPI.COMM_NULL

    def free(self) -> None:
        """Free the communicator (collective over the group); idempotent."""
        if self._owns_comm and not self.freed:
            self.comm.Free()
        self.comm = MPI.COMM_NULL
