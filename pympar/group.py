"""``Group``: one MPI intracommunicator with a name and its members' global ranks.

The array collectives (``all_reduce``, ``all_gather``, ``reduce_scatter``,
``all_to_all``, ``broadcast``) are methods of the group that delegate to
:mod:`pympar.collectives`.
"""

from __future__ import annotations

from typing import Any, Sequence

from mpi4py import MPI

from . import collectives as _collectives
from ._comm_state import CommState

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

    def all_reduce(self, x: Any, op: str = "sum", out: Any = None) -> Any:
        """Reduce ``x`` element-wise over the group; every rank gets the result.

        Parameters
        ----------
        x : numpy.ndarray or cupy.ndarray
            Same shape and dtype on every rank; any memory layout.
        op : {"sum", "max", "min"}
            The reduction. float16 and bfloat16 sum in float32, rounded once at the end;
            bool reduces as NumPy's ufuncs do (or for sum and max, and for min).
        out : array, optional
            Where to write the result (same module, shape and dtype as ``x``). It may be
            ``x`` itself (in place); otherwise it must not overlap ``x``.

        Returns
        -------
        array
            ``out``, or a new C-contiguous array of ``x``'s module and dtype.

        Raises
        ------
        ValueError, TypeError
            For an unknown ``op``, max/min of complex, a dtype MPI cannot reduce, or a
            wrong ``out``.
        pympar.errors.CollectiveMismatchError
            On every rank, when ranks pass different shapes, dtypes or ops.
        """
        return _collectives.all_reduce(self, x, op, out)

    def all_gather(self, x: Any, axis: int = 0, out: Any = None,
                   sizes: Sequence[int] | None = None) -> Any:
        """Concatenate every rank's ``x`` along ``axis``, in group-rank order, on every rank.

        The result equals ``numpy.concatenate([x_0, ..., x_{p-1}], axis)``.

        Parameters
        ----------
        x : numpy.ndarray or cupy.ndarray
            This rank's block; every dimension but ``axis`` agrees across ranks.
        axis : int, default 0
            The axis to concatenate along.
        out : array, optional
            Where to write the result; must not overlap ``x``.
        sizes : sequence of int, optional
            Every rank's extent along ``axis``, indexed by rank in this group, when the
            caller knows them (e.g. ``balanced_sizes(n, group.size)``). Without it the
            ranks learn each other's extents in one small exchange.

        Returns
        -------
        array
            ``out``, or a new C-contiguous array of ``x``'s module and dtype.
        """
        return _collectives.all_gather(self, x, axis, out, sizes)

    def reduce_scatter(self, x: Any, axis: int = 0, out: Any = None, op: str = "sum") -> Any:
        """Reduce ``x`` over the group and give each rank its block along ``axis``.

        ``axis`` is split with the balanced rule of ``numpy.array_split``: the rank of
        group rank ``r`` receives block ``r`` of the element-wise reduction.

        Parameters
        ----------
        x : numpy.ndarray or cupy.ndarray
            Same shape and dtype on every rank; any memory layout.
        axis : int, default 0
            The axis to split.
        out : array, optional
            Where to write this rank's block; must not overlap ``x``.
        op : {"sum", "max", "min"}
            The reduction, as in :meth:`all_reduce`.

        Returns
        -------
        array
            ``out``, or a new C-contiguous array of ``x``'s module and dtype.
        """
        return _collectives.reduce_scatter(self, x, axis, out, op)

    def all_to_all(self, x: Any, split_axis: int, concat_axis: int, out: Any = None,
                   sizes: Sequence[int] | None = None) -> Any:
        """Split ``x`` along ``split_axis``, send block ``q`` to rank ``q``, concatenate the rest.

        Group rank ``r`` receives block ``r`` (balanced rule) of every rank's ``x`` and
        concatenates them in rank order along ``concat_axis``: the result equals
        ``numpy.concatenate([array_split(x_q, p, split_axis)[r] for q in range(p)],
        concat_axis)``.

        Parameters
        ----------
        x : numpy.ndarray or cupy.ndarray
            Every dimension but ``concat_axis`` agrees across ranks.
        split_axis, concat_axis : int
            Different axes.
        out : array, optional
            Where to write the result; must not overlap ``x``.
        sizes : sequence of int, optional
            Every rank's extent along ``concat_axis``, indexed by group rank; otherwise
            the ranks learn them in one small exchange.

        Returns
        -------
        array
            ``out``, or a new C-contiguous array of ``x``'s module and dtype.
        """
        return _collectives.all_to_all(self, x, split_axis, concat_axis, out, sizes)

    def broadcast(self, x: Any, root: int = 0, out: Any = None) -> Any:
        """Return the root's ``x`` on every rank.

        Parameters
        ----------
        x : numpy.ndarray or cupy.ndarray
            On the root, the data; on the other ranks an array of the same shape and
            dtype whose values are ignored.
        root : int, default 0
            The sending rank, as a rank in this group (not a global rank).
        out : array, optional
            Where to write the result; may be ``x`` (in place).

        Returns
        -------
        array
            ``out``, or a new C-contiguous array of ``x``'s module and dtype.
        """
        return _collectives.broadcast(self, x, root, out)

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
            raise RuntimeError(f"barrier: group {self.name!r} has been freed (Group.free or "
                               f"manager.destroy_parallel); use the groups of the current state")
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
