"""Array collectives of :class:`~pympar.group.Group`, for NumPy and CuPy arrays.

``Group.all_reduce`` and its siblings are these functions (the group comes first; a last
``label=`` names the caller in statistics and errors, as mappings do). Each returns
``out``, or a new C-contiguous array of ``x``'s module and dtype, after one path:
**validate** the input (an array; a dtype MPI can move; native byte order), **plan**
(look up, or build once, the :class:`~pympar._plans.Plan` of the call), **check** that
every rank makes the same call (:mod:`pympar._agreement`), **pack** into the buffer MPI
reads (the input itself when C-contiguous), **call MPI** (non-blocking and polled under
``PYMPAR_TIMEOUT``), **unpack** into the result.

Notes
-----
* Agreement: every call of more than one rank first checks that all ranks pass the same
  operation, dtype, extents (those not gathered), axis, sizes, root, op and
  :func:`label`. Every collective makes the same check, so ranks making different calls
  meet in it and raise the same :class:`~pympar.errors.CollectiveMismatchError`; a rank
  refusing its own arguments joins it with a signature no call has (:func:`refuse`). On
  one node the check is a write and a read of shared memory; across nodes one 8-byte
  ``Iallgather``.
* Layout: MPI sees C-contiguous buffers only; a non-leading axis is packed into (or
  unpacked from) rank-major blocks in a cached scratch buffer, so results follow
  ``numpy.concatenate`` and ``numpy.array_split`` (uneven extents: the balanced rule of
  :mod:`pympar.partition`). A gather given no ``sizes=`` learns every rank's extent in
  one small exchange after its check.
* Counts above 2**31 - 1 go to MPI-4 libraries as they are; for MPI-3 the data moves in
  units of a contiguous derived datatype (gathers, all-to-all) or in chunks (all-reduce,
  broadcast); a reduce-scatter is then an all-reduce that keeps this rank's block.
* dtypes: bool reduces with logical or (sum, max) and and (min), as NumPy's ufuncs do;
  float16 and bfloat16 sum in float32; complex has no max/min; ``max``/``min`` with NaN
  give what MPI gives, not NumPy's propagation.
* CuPy: device buffers go to MPI directly when :func:`pympar.backend.cuda_aware`, else
  through pinned host buffers. The data call is blocking for every buffer; the
  watchdog bounds the check before it (:mod:`pympar.debug`).
"""

from __future__ import annotations

import operator
import zlib
from typing import Any, Sequence

import numpy as np
from mpi4py import MPI

from . import _agreement, backend
from ._agreement import agree, label, refuse
from ._comm_state import Communicator
from ._plans import Blocks, Plan, in_units
from ._transfer import claim as out_claim, run
from .partition import balanced_sizes, block_slice

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "label",
           "agree", "refuse", "balanced_sizes", "block_slice", "large_counts_supported",
           "INT_MAX"]

#: The largest count or displacement an MPI-3 (``int``) interface can take.
INT_MAX = 2**31 - 1

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
_BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND}
_MOVABLE = "biufc"  # dtype kinds: bool, int, uint, float, complex
_IN_PLACE = MPI.IN_PLACE
_MOVE: Any = object()  # the op of a collective that reduces nothing


def large_counts_supported(mpi_version: tuple[int, int] | None = None) -> bool:
    """Return whether counts above :data:`INT_MAX` reach MPI as they are (MPI-4 ``_c``
    routines) for the standard ``mpi_version`` (``MPI.Get_version()`` by default)."""
    return tuple(MPI.Get_version() if mpi_version is None else mpi_version) >= (4, 0)


# --------------------------------------------------------------------------- validation


def as_array(x: Any, what: str) -> Any:
    """``x`` if it is a NumPy or CuPy array (a NumPy scalar becomes a 0-d array), else
    ``TypeError`` naming ``what``: array-likes are refused, not converted (a copy)."""
    if type(x) is not np.ndarray:
        if isinstance(x, (np.ndarray, np.generic)):
            return np.asarray(x)
        if not backend.is_cupy_array(x):
            raise TypeError(f"{what}: x must be a numpy.ndarray or cupy.ndarray, not "
                            f"{type(x).__name__} (convert it with numpy.asarray)")
    return x


def _index(value: Any, what: str, name: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what}: {name} must be an int, not {type(value).__name__}") from None


def _axis(axis: Any, ndim: int, what: str) -> int:
    axis = _index(axis, what, "axis")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what}: axis {axis} is out of range for an array of {ndim} "
                         f"dimension{'s' if ndim != 1 else ''}")
    return axis % ndim


def _movable(x: Any, what: str) -> np.dtype:
    """``x``'s dtype in native byte order, after refusing one MPI cannot move."""
    dtype = x.dtype
    if dtype.kind not in _MOVABLE and dtype != backend.bfloat16:
        raise TypeError(f"{what}: pympar collectives move bool, integer, float and complex "
                        f"arrays, not dtype {dtype}")
    return dtype.newbyteorder("=")


def _new_plan(group: Communicator, x: Any, what: str, out_shape: tuple[int, ...],
              key: tuple, shown: str, op: Any = _MOVE) -> Plan:
    """A plan's common parts, after checking the group, the dtype and the op."""
    if group.comm == MPI.COMM_NULL:
        raise RuntimeError(f"{what}: group {group.name!r} has been freed (Group.free or "
                           f"manager.destroy_parallel); use the groups of the current state")
    native = _movable(x, what)
    work, mpi_op = native, None
    if op is not _MOVE:
        table = _BOOL_OPS if native.kind == "b" else _OPS
        mpi_op = table.get(op) if isinstance(op, str) else None
        if mpi_op is None:
            raise ValueError(f"{what}: op must be one of {sorted(_OPS)}, not {op!r}")
        if native.kind == "c" and op != "sum":
            raise TypeError(f"{what}: op={op!r} is not defined for complex dtype {native}")
        work = backend.accumulation_dtype(native)
    plan = Plan(out_shape, work, not x.dtype.isnative, backend.mpi_datatype(work), mpi_op,
                (what, native.str, *key), shown)
    plan.cast = work != native
    return plan


def _finish(group: Communicator, plan: Plan, key: tuple, numbers: tuple[int, ...]) -> Plan:
    """Cache ``plan``; on MPI-3, counts above INT_MAX move in chunks or in derived units."""
    if max(numbers, default=0) > INT_MAX and not large_counts_supported() and group.size > 1:
        if plan.method in ("Allreduce", "Bcast"):
            plan.chunk = INT_MAX
        elif plan.method is not None:
            in_units(plan, numbers, INT_MAX)
    return group._state.remember(key, plan)


# --------------------------------------------------------------------------- operations


def all_reduce(group: Communicator, x: Any, op: str = "sum", out: Any = None,
               label: str | None = None) -> Any:
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


    Raises
    ------
    ValueError, TypeError
        For an unknown ``op``, max/min of complex, a dtype MPI cannot reduce, or a
        wrong ``out``.
    pympar.errors.CollectiveMismatchError
        On every rank, when ranks pass different shapes, dtypes or ops.
    """
    try:
        if type(x) is not np.ndarray:
            x = as_array(x, label or "all_reduce")
        key = ("all_reduce", x.shape, x.dtype, op)
        plan = group._state.plans.get(key)
        if plan is None:
            plan = _new_plan(group, x, "all_reduce", x.shape, (x.shape, op),
                             f"all_reduce(shape={x.shape}, dtype={x.dtype}, op={op!r})", op)
            plan.method, plan.tail = "Allreduce", (plan.op,)
            _finish(group, plan, key, (x.size,))
    except (TypeError, ValueError) as err:
        refuse(group, "all_reduce", err)
        raise
    return run(group, plan, x, out, label)


def broadcast(group: Communicator, x: Any, root: int = 0, out: Any = None,
              label: str | None = None) -> Any:
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
    """
    try:
        if type(x) is not np.ndarray:
            x = as_array(x, label or "broadcast")
        key = ("broadcast", x.shape, x.dtype, root)
        plan = group._state.plans.get(key)
        if plan is None:
            root = _index(root, "broadcast", "root")
            if not 0 <= root < group.size:
                raise ValueError(f"broadcast: root {root} is not a rank of group {group.name!r} "
                                 f"of size {group.size} (root is a rank in the group)")
            plan = _new_plan(group, x, "broadcast", x.shape, (x.shape, root),
                             f"broadcast(shape={x.shape}, dtype={x.dtype}, root={root})")
            plan.method, plan.tail = "Bcast", (root,)
            _finish(group, plan, key, (x.size,))
    except (TypeError, ValueError) as err:
        refuse(group, "broadcast", err)
        raise
    return run(group, plan, x, out, label)


def _learn_sizes(group: Communicator, x: Any, axis: int, sizes: Any, what: str, key: tuple,
                 claim: int = 0, label: str | None = None) -> tuple[tuple[int, ...], bool]:
    """Every rank's extent along ``axis``, and whether the call's check was made for it.

    Given ``sizes``, they are checked against this rank's extent. Else every rank's
    extent (and each rank's ``claim``, see :func:`pympar._transfer.claim`) is learned
    after the check of ``key``, the call with this axis's extent masked, under ``label``
    (the call's own, within the enclosing block's) as the ordinary check compares it.
    """
    extent = x.shape[axis]
    if sizes is not None:
        sizes = tuple(_index(s, what, "sizes[i]") for s in sizes)
        if len(sizes) == group.size and sizes[group.rank] == extent:
            return sizes, False
        raise ValueError(f"{what}(shape={x.shape}, axis={axis}, sizes={sizes}) on group "
                         f"{group.name!r}: sizes (every rank's extent along the axis, in "
                         f"group-rank order) do not fit {group.size} ranks with this rank "
                         f"({group.rank}) holding {extent}")
    if group.size == 1:
        return (extent,), True
    if group.comm == MPI.COMM_NULL:
        _new_plan(group, x, what, (), (), what)  # raises: the group is freed
    name = _agreement.within(label)
    shown = f"{what}(shape={x.shape}, dtype={x.dtype}, axis={axis}, sizes unknown)"
    sig = zlib.crc32(repr(((what, _movable(x, what).str, *key), name)).encode()) | 1
    return _agreement.extents(group, sig, shown, name, extent, claim), True


def all_gather(group: Communicator, x: Any, axis: int = 0, out: Any = None,
               sizes: Sequence[int] | None = None, label: str | None = None) -> Any:
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
    """
    checked = False
    try:
        if type(x) is not np.ndarray:
            x = as_array(x, label or "all_gather")
        if type(sizes) is not tuple or not x.ndim:
            if not x.ndim:
                raise ValueError("all_gather needs an array of at least one dimension")
            ax = _axis(axis, x.ndim, "all_gather")
            masked = x.shape[:ax] + (-1,) + x.shape[ax + 1:]
            claim = 0 if sizes is not None else out_claim(x, out, ax, masked, "all_gather")
            sizes, checked = _learn_sizes(group, x, ax, sizes, "all_gather", (masked, ax),
                                          claim, label)
        key = ("all_gather", x.shape, x.dtype, axis, sizes)
        plan = group._state.plans.get(key)
        if plan is None:
            ax = _axis(axis, x.ndim, "all_gather")
            sizes, _ = _learn_sizes(group, x, ax, sizes, "all_gather", ())
            shape = x.shape[:ax] + (sum(sizes),) + x.shape[ax + 1:]
            b = Blocks(shape, ax, sizes)
            plan = _new_plan(group, x, "all_gather", shape,
                             (shape[:ax] + (-1,) + shape[ax + 1:], ax, sizes),
                             f"all_gather(shape={x.shape}, dtype={x.dtype}, axis={ax}, "
                             f"sizes={sizes})")
            plan.recv = None if b.lead == 1 else b
            plan.method = "Allgather" if b.even else "Allgatherv"
            if not b.even:
                plan.recv_spec = ((b.counts, b.displs), plan.mpi_type)
            _finish(group, plan, key, b.counts + b.displs)
    except (TypeError, ValueError) as err:
        if not checked:  # after the exchange, every rank raises alike
            refuse(group, "all_gather", err)
        raise
    return run(group, plan, x, out, label, checked)


def reduce_scatter(group: Communicator, x: Any, axis: int = 0, out: Any = None,
                   op: str = "sum", label: str | None = None) -> Any:
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
        The reduction, as in :func:`all_reduce`.
    """
    try:
        if type(x) is not np.ndarray:
            x = as_array(x, label or "reduce_scatter")
        key = ("reduce_scatter", x.shape, x.dtype, axis, op)
        plan = group._state.plans.get(key)
        if plan is None:
            if not x.ndim:
                raise ValueError("reduce_scatter needs an array of at least one dimension")
            ax = _axis(axis, x.ndim, "reduce_scatter")
            sizes = balanced_sizes(x.shape[ax], group.size)
            b = Blocks(x.shape, ax, sizes)
            plan = _new_plan(group, x, "reduce_scatter",
                             x.shape[:ax] + (sizes[group.rank],) + x.shape[ax + 1:],
                             (x.shape, ax, op), f"reduce_scatter(shape={x.shape}, "
                             f"dtype={x.dtype}, axis={ax}, op={op!r})", op)
            plan.send = None if b.lead == 1 else b
            plan.method = "Reduce_scatter_block" if b.even else "Reduce_scatter"
            plan.tail = (plan.op,) if b.even else (b.counts, plan.op)
            if x.size > INT_MAX and not large_counts_supported() and group.size > 1:
                # Built-in reductions refuse derived datatypes: reduce it all, keep my block.
                plan.method = None
                plan.tail = (slice(None),) * ax + (block_slice(x.shape[ax], group.size,
                                                               group.rank),)
            _finish(group, plan, key, ())
    except (TypeError, ValueError) as err:
        refuse(group, "reduce_scatter", err)
        raise
    if plan.method is None:
        mine = all_reduce(group, x, op, None, label)[plan.tail]
        if out is None:
            return mine.copy()
        out[...] = mine
        return out
    return run(group, plan, x, out, label)


def _split_concat(x: Any, split_axis: Any, concat_axis: Any) -> tuple[int, int]:
    """The all-to-all's two axes, normalized; refused when out of range or alike."""
    if not x.ndim:
        raise ValueError("all_to_all needs an array of at least one dimension")
    split = _axis(split_axis, x.ndim, "all_to_all")
    cat = _axis(concat_axis, x.ndim, "all_to_all")
    if split == cat:
        raise ValueError(f"all_to_all: split_axis and concat_axis must differ, both are {split}")
    return split, cat


def all_to_all(group: Communicator, x: Any, split_axis: int, concat_axis: int,
               out: Any = None, sizes: Sequence[int] | None = None,
               label: str | None = None) -> Any:
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
    """
    checked = False
    try:
        if type(x) is not np.ndarray:
            x = as_array(x, label or "all_to_all")
        if type(sizes) is not tuple:
            split, cat = _split_concat(x, split_axis, concat_axis)
            masked = x.shape[:cat] + (-1,) + x.shape[cat + 1:]
            claim = 0
            if sizes is None:
                mine = list(masked)
                mine[split] = balanced_sizes(x.shape[split], group.size)[group.rank]
                claim = out_claim(x, out, cat, tuple(mine), "all_to_all")
            sizes, checked = _learn_sizes(group, x, cat, sizes, "all_to_all",
                                          (masked, split, cat), claim, label)
        key = ("all_to_all", x.shape, x.dtype, split_axis, concat_axis, sizes)
        plan = group._state.plans.get(key)
        if plan is None:
            split, cat = _split_concat(x, split_axis, concat_axis)
            sizes, _ = _learn_sizes(group, x, cat, sizes, "all_to_all", ())
            split_sizes = balanced_sizes(x.shape[split], group.size)
            shape = list(x.shape)
            shape[split], shape[cat] = split_sizes[group.rank], sum(sizes)
            sb, rb = Blocks(x.shape, split, split_sizes), Blocks(tuple(shape), cat, sizes)
            masked = x.shape[:cat] + (-1,) + x.shape[cat + 1:]
            plan = _new_plan(group, x, "all_to_all", tuple(shape), (masked, split, cat, sizes),
                             f"all_to_all(shape={x.shape}, dtype={x.dtype}, split_axis={split}, "
                             f"concat_axis={cat}, sizes={sizes})")
            plan.send, plan.recv = None if sb.lead == 1 else sb, None if rb.lead == 1 else rb
            if sb.even and rb.even and sb.counts[0] == rb.counts[0]:
                plan.method = "Alltoall"
            else:
                plan.method = "Alltoallv"
                plan.send_spec = ((sb.counts, sb.displs), plan.mpi_type)
                plan.recv_spec = ((rb.counts, rb.displs), plan.mpi_type)
            _finish(group, plan, key, sb.counts + sb.displs + rb.counts + rb.displs)
    except (TypeError, ValueError) as err:
        if not checked:  # after the exchange, every rank raises alike
            refuse(group, "all_to_all", err)
        raise
    return run(group, plan, x, out, label, checked)
