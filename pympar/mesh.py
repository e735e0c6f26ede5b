"""``Mesh``: named axes laid over a communicator; every group is a slice of it.

An order string names the axes innermost first: with ``"tp-cp-dp"`` the ``tp``
coordinate has stride 1, ``cp`` stride ``TP`` and ``dp`` stride ``TP*CP``. The
rank arithmetic is pure NumPy (:func:`group_ranks`) and needs no MPI, so layouts
of any world size can be inspected on a laptop; :meth:`Mesh.group` turns one
slice into a communicator with a single collective ``Comm.Split``.

Creating a mesh and each group is collective over the parent communicator, and
first agrees (:func:`pympar.settings.check_same`): one small timed exchange compares
what every rank passed, and the settings that must be alike on every rank, so ranks
that lay out or cut differently get an error on every rank instead of groups whose
names lie.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
from mpi4py import MPI

from .group import Group
from .settings import check_same

__all__ = ["Mesh", "parse_order", "group_ranks", "check_sizes"]


# --------------------------------------------------------------------------- rank arithmetic


def check_sizes(sizes: Mapping[str, int]) -> dict[str, int]:
    """Return ``sizes`` as a dict after checking every size is an integer >= 1.

    Raises
    ------
    TypeError
        When ``sizes`` is not a mapping.
    ValueError
        When a size is not a positive integer.
    """
    if not isinstance(sizes, Mapping):
        raise TypeError(f"sizes must be a mapping of axis names to sizes, such as "
                        f"{{'dp': 2, 'tp': 4}}, not {type(sizes).__name__}")
    checked = {}
    for axis, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"size of axis {axis!r} must be an integer >= 1, got {size!r}")
        checked[str(axis)] = int(size)
    return checked


def parse_order(order: str, sizes: Mapping[str, int]) -> tuple[str, ...]:
    """Return the axes innermost first, as the order string names them.

    Axes of size 1 that the order leaves out are appended as the outermost axes
    (their position does not change any rank).

    Raises
    ------
    ValueError
        For an unknown or repeated token, or an axis of size > 1 that the order
        leaves out.
    """
    tokens = [t.strip() for t in str(order).split("-")] if order else []
    unknown = [t for t in tokens if t not in sizes]
    if unknown:
        raise ValueError(f"order {order!r} names unknown axis {unknown[0]!r}; "
                         f"known axes: {', '.join(sizes)}")
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        raise ValueError(f"order {order!r} repeats axis {repeated[0]!r}")
    missing = [a for a, s in sizes.items() if a not in tokens and s > 1]
    if missing:
        raise ValueError(f"order {order!r} leaves out axis {missing[0]!r} "
                         f"of size {sizes[missing[0]]}")
    return tuple(tokens) + tuple(a for a in sizes if a not in tokens)


def group_ranks(sizes: Mapping[str, int], order: str, *axes: str) -> np.ndarray:
    """Return the global ranks of every group along ``axes``, as pure math.

    Parameters
    ----------
    sizes : mapping of str to int
        Size of each named axis; their product is the world size.
    order : str
        Axis names innermost first, joined by ``-``.
    *axes : str
        The axes a group spans. Members are ordered by the mesh order (the
        innermost axis varies fastest), whatever order ``axes`` are given in.

    Returns
    -------
    numpy.ndarray
        Shape ``(number_of_groups, group_size)``, dtype int64. Row ``g`` lists
        the members of group ``g``; groups are ordered by the remaining axes,
        innermost fastest, which is also the order of their smallest ranks.

    Examples
    --------
    >>> group_ranks({"tp": 2, "cp": 2, "dp": 2}, "tp-cp-dp", "cp").tolist()
    [[0, 2], [1, 3], [4, 6], [5, 7]]
    """
    sizes = check_sizes(sizes)
    mesh_axes = parse_order(order, sizes)
    unknown = [a for a in axes if a not in sizes]
    if unknown:
        raise ValueError(f"unknown axis {unknown[0]!r}; mesh axes: {', '.join(mesh_axes)}")
    if len(set(axes)) != len(axes):
        raise ValueError(f"axes {axes} repeat an axis")
    outer_first = mesh_axes[::-1]
    grid = np.arange(math.prod(sizes.values()), dtype=np.int64)
    grid = grid.reshape([sizes[a] for a in outer_first])
    spanned = [a for a in outer_first if a in axes]
    others = [a for a in outer_first if a not in axes]
    group_size = math.prod(sizes[a] for a in spanned)
    permutation = [outer_first.index(a) for a in others + spanned]
    return grid.transpose(permutation).reshape(-1, group_size)


class Mesh:
    """Named axes over a communicator, from which every process group is cut.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm or None
        The parent communicator (``MPI.COMM_WORLD`` when None). Its ranks are
        the "global" ranks of every group cut from this mesh.
    sizes : mapping of str to int
        Size of each axis, e.g. ``{"tp": 2, "cp": 2, "dp": 2}``. The product
        must equal the communicator's size.
    order : str, optional
        Axis names innermost first, e.g. ``"tp-cp-dp"``; defaults to the order
        of ``sizes``.

    Attributes
    ----------
    comm : mpi4py.MPI.Intracomm
    sizes : dict of str to int
    axes : tuple of str
        Axis names innermost first.
    rank : int
        This process's rank in ``comm``.
    coords : dict of str to int
        This process's coordinate on each axis.

    Raises
    ------
    ValueError
        On every rank, for sizes < 1, a bad order string, sizes whose product is
        not the communicator's size, or settings of :data:`pympar.settings.MUST_AGREE` that
        differ between ranks.
    pympar.errors.CollectiveMismatchError
        On every rank, when ranks pass different sizes or orders.

    Notes
    -----
    Collective over ``comm``: every rank of it must create the mesh, with the same
    arguments. The arguments are compared first (:func:`check_same`), then checked,
    so every rank raises the same error.
    """

    def __init__(self, comm: MPI.Intracomm | None, sizes: Mapping[str, int],
                 order: str | None = None) -> None:
        self.comm = MPI.COMM_WORLD if comm is None else comm
        try:
            self.sizes = check_sizes(sizes)
            self.axes = parse_order("-".join(self.sizes) if order is None else order,
                                    self.sizes)
        except (TypeError, ValueError) as err:
            # Still agree first (an erring rank must not leave the others waiting),
            # with the error as this rank's arguments.
            check_same(self.comm, "Mesh", f"{sizes!r}, order={order!r}: {err}")
            raise
        shape = " x ".join(f"{a}={self.sizes[a]}" for a in self.axes)
        check_same(self.comm, "Mesh", f"{shape}, innermost first")
        world = self.comm.Get_size()
        product = math.prod(self.sizes.values())
        if product != world:
            raise ValueError(f"mesh {shape} holds {product} ranks but the communicator has {world}")
        self.rank = self.comm.Get_rank()
        self.coords = self.coords_of(self.rank)

    @property
    def order(self) -> str:
        """The axis names innermost first, joined by ``-``."""
        return "-".join(self.axes)

    @property
    def size(self) -> int:
        """The number of ranks in the mesh."""
        return math.prod(self.sizes.values())

    def coords_of(self, rank: int) -> dict[str, int]:
        """Return the coordinates of global ``rank`` on every axis."""
        coords = {}
        for axis in self.axes:
            rank, coords[axis] = divmod(rank, self.sizes[axis])
        return coords

    def group_ranks(self, *axes: str) -> np.ndarray:
        """Return the global ranks of every group along ``axes`` (see :func:`group_ranks`)."""
        return group_ranks(self.sizes, self.order, *axes)

    def group(self, *axes: str, key: str | None = None) -> Group:
        """Create this rank's group along ``axes``; collective over the parent communicator.

        Every rank of the mesh must call this with the same arguments in the
        same order, since it splits the parent communicator. It checks that first
        (:func:`check_same`), with one small exchange over the parent communicator.

        Parameters
        ----------
        *axes : str
            Axes the group spans; none gives a size-1 group per rank.
        key : str, optional
            Name prefix; defaults to the axes joined by ``-``. The group is
            named ``key`` followed by its members, e.g. ``"dp-cp-0-2-4-6"``.

        Returns
        -------
        Group

        Raises
        ------
        pympar.errors.CollectiveMismatchError
            On every rank, when ranks ask for different axes or keys (or create
            their groups in different orders).
        ValueError
            On every rank, for an unknown or repeated axis, or settings of
            :data:`pympar.settings.MUST_AGREE` that differ between ranks.
        """
        check_same(self.comm, "Mesh.group", ", ".join([*map(repr, axes), f"key={key!r}"]))
        table = self.group_ranks(*axes)
        row, column = (int(i) for i in np.argwhere(table == self.rank)[0])
        members = table[row].tolist()
        prefix = key or "-".join(axes) or "self"
        call = f"Mesh.group({', '.join(map(repr, axes))})"
        try:
            comm = self.comm.Split(color=row, key=column)
        except MPI.Exception as err:
            raise _out_of_communicators(call, err) from None
        try:
            return Group(comm, "-".join([prefix, *map(str, members)]), members)
        except MPI.Exception as err:  # the group's agreement board splits the node
            comm.Free()
            raise _out_of_communicators(call, err) from None

    def __repr__(self) -> str:
        shape = ", ".join(f"{a}={self.sizes[a]}" for a in self.axes)
        return f"Mesh({shape}; rank {self.rank})"


def _out_of_communicators(call: str, err: MPI.Exception) -> RuntimeError:
    """The error of ``call`` when MPI refused to create a communicator with ``err``.

    Parameters
    ----------
    call : str
        What was creating it, e.g. ``"Mesh.group('tp')"``.
    err : mpi4py.MPI.Exception
        MPI's error ("Other MPI error" and a stack, on MPICH).

    Returns
    -------
    RuntimeError
        One line: MPI's error class, and the usual cause and its remedy.
    """
    reason = str(err).split(",")[0].split("\n")[0].strip()
    return RuntimeError(
        f"{call}: MPI could not create a communicator ({reason}, error class "
        f"{err.Get_error_class()}); most likely the job has run out of them: MPI allows a "
        f"few thousand at once (MPICH about 2,000), and every group holds one until it is "
        f"freed. Free the groups no longer needed (Group.free, or manager.destroy_parallel "
        f"for the parallel state's) instead of creating new ones each step")
