"""``Mesh``: named axes laid over a communicator; every group is a slice of it.

An order string names the axes innermost first: with ``"tp-cp-dp"`` the ``tp``
coordinate has stride 1, ``cp`` stride ``TP`` and ``dp`` stride ``TP*CP``. The
rank arithmetic is pure NumPy (:func:`group_ranks`) and needs no MPI, so layouts
of any world size can be inspected on a laptop; :meth:`Mesh.group` turns one
slice into a communicator with a single collective ``Comm.Split``.

Creating a mesh and each group is collective over the parent communicator, and
first agrees (:func:`check_same`): one small timed exchange compares what every
rank passed, and the settings that must be alike on every rank
(:data:`MUST_AGREE`), so ranks that lay out or cut differently get an error on
every rank instead of groups whose names lie.
"""

from __future__ import annotations

import json
import math
import os
import time
import zlib
from typing import Mapping

import numpy as np
from mpi4py import MPI

from . import collectives, debug
from .group import Group

__all__ = ["Mesh", "parse_order", "group_ranks", "check_sizes", "MUST_AGREE", "settings",
           "check_settings", "check_same"]

#: Environment variables whose settings must be the same on every rank.
MUST_AGREE = ("PYMPAR_DEBUG", "PYMPAR_TIMEOUT", "PYMPAR_CHECK_BYTES")


# --------------------------------------------------------------------------- agreement

def settings() -> dict[str, list[str]]:
    """Return this rank's settings that must agree, by variable name.

    Returns
    -------
    dict of str to [str, str]
        Per variable of :data:`MUST_AGREE`: what is in effect (compared) and how it
        reads in the environment (shown in errors).
    """
    timeout = debug.get_timeout()
    effective = {"PYMPAR_DEBUG": "on" if debug.is_enabled() else "off",
                 "PYMPAR_TIMEOUT": "off" if timeout is None else f"{timeout!r} s",
                 "PYMPAR_CHECK_BYTES": f"{collectives.CHECK_BYTES} bytes"}
    # The raw text is cut short: it is shown in one line of an error.
    return {name: [value, f"{value} ({name}={os.environ.get(name, '<unset>')[:40]})"]
            for name, value in effective.items()}


def _wait(comm: MPI.Comm, request: MPI.Request, what: str) -> None:
    """Wait for ``request``, at most this rank's timeout (then CollectiveTimeoutError)."""
    timeout = debug.get_timeout()
    if timeout is None:
        request.Wait()
        return
    deadline, pause = time.monotonic() + timeout, 1e-5
    while not request.Test():
        if time.monotonic() >= deadline:
            error = debug.CollectiveTimeoutError(
                f"{what} did not complete within {timeout:g} s on rank {comm.Get_rank()} of "
                f"{comm.Get_size()}: other ranks of the communicator have not called it (the "
                "ranks that did not call it cannot know and wait in their own next "
                "collective); the communicator is no longer usable")
            error.request = request
            raise error
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)


def check_settings(seen: list[dict[str, list[str]]]) -> None:
    """Raise ValueError when the ranks' :func:`settings` differ (the same error on every rank).

    Parameters
    ----------
    seen : list of dict
        Every rank's :func:`settings`, by rank.

    Raises
    ------
    ValueError
        Naming the first variable that differs and each rank's value.
    """
    for name in MUST_AGREE:
        if len({row[name][0] for row in seen}) == 1:
            continue
        shown: dict[str, list[int]] = {}
        for rank, row in enumerate(seen):
            shown.setdefault(row[name][1], []).append(rank)
        listing = "; ".join(f"{value} on ranks {ranks}" for value, ranks in shown.items())
        raise ValueError(f"{name} must be set alike on every rank, but the ranks differ: "
                         f"{listing}")


def check_same(comm: MPI.Comm, what: str, arguments: str) -> None:
    """Check that every rank of ``comm`` calls ``what`` with the same ``arguments`` and settings.

    Collective over ``comm``: one timed non-blocking Allgather of a 32-bit checksum of
    ``what``, ``arguments`` and this rank's :func:`settings` (non-blocking always, so
    ranks whose timeouts differ still match). Every agreed call of pympar uses this one
    exchange, so ranks that make different such calls (``initialize_parallel`` on one,
    ``Mesh`` on another) match each other and are told so. Only when the checksums
    differ does a second exchange gather the texts, to name what each rank passed.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The communicator every rank calls over.
    what : str
        The call, named in errors (e.g. ``"Mesh.group"``).
    arguments : str
        This rank's arguments, as text that is equal exactly when they mean the same.

    Raises
    ------
    ValueError
        On every rank, when a setting of :data:`MUST_AGREE` differs between ranks; it
        names the variable and each rank's value.
    pympar.debug.CollectiveMismatchError
        On every rank, when the calls or arguments differ; the message lists each
        distinct call and the ranks that made it.
    pympar.debug.CollectiveTimeoutError
        When ``PYMPAR_TIMEOUT`` is set here and other ranks do not call it in time
        (``comm`` then has a pending operation; the error's ``request``).
    """
    if comm.Get_size() == 1:
        return
    call = f"{what}({arguments})"
    mine = settings()
    effective = {name: value for name, (value, _) in mine.items()}
    send = np.array([zlib.crc32(json.dumps([call, effective]).encode())], np.uint32)
    sums = np.empty(comm.Get_size(), np.uint32)
    _wait(comm, comm.Iallgather(send, sums), what)
    if (sums == sums[0]).all():
        return
    # Every rank saw the same checksums, so every rank takes this (rare) path.
    seen: list[tuple[str, dict[str, list[str]]]] = comm.allgather((call, mine))
    check_settings([row for _, row in seen])
    made: dict[str, list[int]] = {}
    for rank, (text, _) in enumerate(seen):
        made.setdefault(text, []).append(rank)
    listing = "; ".join(f"{text} on ranks {ranks}" for text, ranks in made.items())
    raise debug.CollectiveMismatchError(
        f"{what} is collective over its communicator: every rank must make the same call "
        f"with the same arguments, but the ranks differ: {listing}")


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
        not the communicator's size, or settings of :data:`MUST_AGREE` that
        differ between ranks.
    pympar.debug.CollectiveMismatchError
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
        pympar.debug.CollectiveMismatchError
            On every rank, when ranks ask for different axes or keys (or create
            their groups in different orders).
        ValueError
            On every rank, for an unknown or repeated axis, or settings of
            :data:`MUST_AGREE` that differ between ranks.
        """
        check_same(self.comm, "Mesh.group", ", ".join([*map(repr, axes), f"key={key!r}"]))
        table = self.group_ranks(*axes)
        row, column = (int(i) for i in np.argwhere(table == self.rank)[0])
        members = table[row].tolist()
        comm = self.comm.Split(color=row, key=column)
        prefix = key or "-".join(axes) or "self"
        return Group(comm, "-".join([prefix, *map(str, members)]), members)

    def __repr__(self) -> str:
        shape = ", ".join(f"{a}={self.sizes[a]}" for a in self.axes)
        return f"Mesh({shape}; rank {self.rank})"
