"""Array collectives of :class:`~pympar.group.Group`, for NumPy and CuPy arrays.

``Group.all_reduce`` and its siblings are these functions (the group first; a last
``label=`` names the caller in statistics and errors). Each returns ``out``, or a new
C-contiguous array of ``x``'s module and dtype.

Notes
-----
* Agreement: all ranks must pass the same operation, dtype, extents (those not gathered),
  axis, sizes, root, op and :func:`label`, else every rank raises the same
  :class:`~pympar.errors.CollectiveMismatchError`, also when one rank refuses its own
  arguments (:func:`refuse`). The check is one word per rank (``pympar._board``).
* Layout: a non-leading axis is packed into rank-major blocks of a cached scratch buffer;
  results follow ``numpy.concatenate`` and ``numpy.array_split`` (:mod:`pympar.partition`).
  A gather given no ``sizes=`` learns every rank's extent in one small exchange.
* Counts above 2**31 - 1 go to MPI-4 as they are; for MPI-3 the data moves in units of a
  contiguous derived datatype (gathers, all-to-all) or in chunks (all-reduce, broadcast),
  and a reduce-scatter is an all-reduce that keeps this rank's block.
* dtypes: bool reduces with logical or (sum, max) and and (min), as NumPy's ufuncs do;
  float16 and bfloat16 sum in float32; complex has no max/min; ``max``/``min`` with NaN
  give what MPI gives, not NumPy's propagation.
* CuPy: device buffers go to MPI directly when :func:`pympar.backend.cuda_aware`, else
  through pinned host buffers.
"""

from __future__ import annotations

from typing import Any, Sequence

from mpi4py import MPI

from . import _agreement, backend
from ._agreement import agree, label, refuse
from ._comm_state import Communicator, freed_error
from ._plans import Blocks, Plan, in_units, signature
from ._transfer import as_array, check_out, claim as out_claim, index, run
from .partition import balanced_sizes, block_slice

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "label",
           "agree", "refuse", "balanced_sizes", "block_slice", "large_counts_supported",
           "INT_MAX"]

#: The largest count or displacement an MPI-3 (``int``) interface can take.
INT_MAX = 2**31 - 1

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
_BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND}


def large_counts_supported(mpi_version: tuple[int, int] | None = None) -> bool:
    """Return whether counts above :data:`INT_MAX` reach MPI as they are (MPI-4) for the
    standard ``mpi_version`` (``MPI.Get_version()`` by default)."""
    return tuple(MPI.Get_version() if mpi_version is None else mpi_version) >= (4, 0)


def _axis(axis: Any, x: Any, what: str) -> int:
    """``axis`` of ``x`` normalized, refused when ``x`` has none or it is out of range."""
    axis = index(axis, what, "axis")
    if not x.ndim:
        raise ValueError(f"{what} needs an array of at least one dimension")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{what}: axis {axis} is out of range for an array of {x.ndim} "
                         f"dimension{'s' if x.ndim != 1 else ''}")
    return axis % x.ndim


def _movable(x: Any, what: str) -> str:
    """``x``'s dtype in native byte order (its ``str``), after refusing one MPI cannot move."""
    if x.dtype.kind not in "biufc" and x.dtype != backend.bfloat16:
        raise TypeError(f"{what}: pympar collectives move bool, integer, float and complex "
                        f"arrays, not dtype {x.dtype}")
    return x.dtype.newbyteorder("=").str


def _new_plan(group: Communicator, x: Any, what: str, out_shape: tuple[int, ...],
              masked: tuple[int, ...], **fields: Any) -> Plan:
    """A plan's common parts, after checking the group, the dtype and any ``op``: its key
    is ``what``, the dtype, ``masked`` (the shape, with -1 for the extent that may differ
    between ranks) and the ``fields``, which its text names after the shape and dtype."""
    if group.comm == MPI.COMM_NULL:
        raise freed_error(what, group)
    movable = _movable(x, what)
    native = work = x.dtype.newbyteorder("=")
    mpi_op, op = None, fields.get("op")
    if "op" in fields:
        table = _BOOL_OPS if native.kind == "b" else _OPS
        mpi_op = table.get(op) if isinstance(op, str) else None
        if mpi_op is None:
            raise ValueError(f"{what}: op must be one of {sorted(_OPS)}, not {op!r}")
        if native.kind == "c" and op != "sum":
            raise TypeError(f"{what}: op={op!r} is not defined for complex dtype {native}")
        work = backend.accumulation_dtype(native)
    shown = "".join(f", {name}={value!r}" for name, value in fields.items())
    plan = Plan(out_shape, work, not x.dtype.isnative, backend.mpi_datatype(work), mpi_op,
                (what, movable, masked, *fields.values()),
                f"{what}(shape={x.shape}, dtype={x.dtype}{shown})")
    plan.cast = work != native
    return plan


def _big_counts(group: Communicator, plan: Plan, numbers: tuple[int, ...]) -> Plan:
    """``plan``, whose counts above INT_MAX move on MPI-3 in chunks or in derived units."""
    if max(numbers, default=0) > INT_MAX and not large_counts_supported() and group.size > 1:
        if plan.method in ("Allreduce", "Bcast"):
            plan.chunk = INT_MAX
        else:
            in_units(plan, numbers, INT_MAX)
    return plan


def _sizes(group: Communicator, x: Any, axis: int, sizes: Any, what: str) -> tuple[int, ...]:
    """``sizes`` (every rank's extent along ``axis``), checked against this rank's."""
    sizes = tuple(index(s, what, "sizes[i]") for s in sizes)
    if len(sizes) == group.size and sizes[group.rank] == x.shape[axis]:
        return sizes
    raise ValueError(f"{what}(shape={x.shape}, axis={axis}, sizes={sizes}) on group "
                     f"{group.name!r}: sizes (every rank's extent along the axis, in group-"
                     f"rank order) do not fit {group.size} ranks with this rank ({group.rank}) "
                     f"holding {x.shape[axis]}")


def _learn_sizes(group: Communicator, x: Any, out: Any, sizes: Any, label: str | None,
                 what: str, axes: tuple) -> tuple[Any, tuple[int, ...], bool]:
    """``x``, every rank's extent along the gathered axis (the last of the call's ``axes``)
    and whether the check was made: given ``sizes`` are checked, else the extents (and
    ``out``'s: :func:`pympar._transfer.claim`) are learned after the check of the call with
    that extent masked."""
    try:
        x = as_array(x, label or what)
        movable = _movable(x, what)  # refused with the rest: the others must not wait
        axes = (_axis(axes[0], x, what),) if len(axes) == 1 else _axes(x, *axes)
        ax = axes[-1]
        masked = x.shape[:ax] + (-1,) + x.shape[ax + 1:]
        if sizes is not None:
            return x, _sizes(group, x, ax, sizes, what), False
        mine = list(masked)
        if len(axes) == 2:  # the result's split axis holds this rank's block
            mine[axes[0]] = balanced_sizes(x.shape[axes[0]], group.size)[group.rank]
        claim = out_claim(x, out, ax, tuple(mine), what)
    except (TypeError, ValueError) as err:
        refuse(group, what, err)
        raise
    if group.size == 1:
        return x, (x.shape[ax],), True
    name = _agreement.within(label)
    shown = f"{what}(shape={x.shape}, dtype={x.dtype}, axis={ax}, sizes unknown)"
    sig = signature((what, movable, masked, *axes), name)
    return x, _agreement.extents(group, sig, shown, name, x.shape[ax], claim), True


def _plan_all_reduce(group: Communicator, x: Any, op: Any) -> Plan:
    plan = _new_plan(group, x, "all_reduce", x.shape, x.shape, op=op)
    plan.method = "Allreduce"
    return _big_counts(group, plan, (x.size,))


def _plan_broadcast(group: Communicator, x: Any, root: Any) -> Plan:
    root = index(root, "broadcast", "root")
    if not 0 <= root < group.size:
        raise ValueError(f"broadcast: root {root} is not a rank of group {group.name!r} "
                         f"of size {group.size} (root is a rank in the group)")
    plan = _new_plan(group, x, "broadcast", x.shape, x.shape, root=root)
    plan.method, plan.tail = "Bcast", (root,)
    return _big_counts(group, plan, (x.size,))


def _plan_all_gather(group: Communicator, x: Any, axis: Any, sizes: tuple) -> Plan:
    ax = _axis(axis, x, "all_gather")
    sizes = _sizes(group, x, ax, sizes, "all_gather")
    shape = x.shape[:ax] + (sum(sizes),) + x.shape[ax + 1:]
    b = Blocks(shape, ax, sizes)
    plan = _new_plan(group, x, "all_gather", shape, shape[:ax] + (-1,) + shape[ax + 1:],
                     axis=ax, sizes=sizes)
    plan.recv = None if b.lead == 1 else b
    plan.method = "Allgather" if b.even else "Allgatherv"
    if not b.even:
        plan.recv_spec = ((b.counts, b.displs), plan.mpi_type)
    return _big_counts(group, plan, b.counts + b.displs)


def _plan_reduce_scatter(group: Communicator, x: Any, axis: Any, op: Any) -> Plan:
    ax = _axis(axis, x, "reduce_scatter")
    sizes = balanced_sizes(x.shape[ax], group.size)
    b = Blocks(x.shape, ax, sizes)
    plan = _new_plan(group, x, "reduce_scatter",
                     x.shape[:ax] + (sizes[group.rank],) + x.shape[ax + 1:], x.shape,
                     axis=ax, op=op)
    plan.send = None if b.lead == 1 else b
    plan.method = "Reduce_scatter_block" if b.even else "Reduce_scatter"
    plan.tail = plan.tail if b.even else (b.counts, *plan.tail)
    return plan


def _axes(x: Any, split_axis: Any, concat_axis: Any) -> tuple[int, int]:
    """The all-to-all's two axes, normalized; refused when out of range or alike."""
    split, cat = _axis(split_axis, x, "all_to_all"), _axis(concat_axis, x, "all_to_all")
    if split == cat:
        raise ValueError(f"all_to_all: split_axis and concat_axis must differ, both are {split}")
    return split, cat


def _plan_all_to_all(group: Communicator, x: Any, split_axis: Any, concat_axis: Any,
                     sizes: tuple) -> Plan:
    split, cat = _axes(x, split_axis, concat_axis)
    sizes = _sizes(group, x, cat, sizes, "all_to_all")
    split_sizes = balanced_sizes(x.shape[split], group.size)
    shape = list(x.shape)
    shape[split], shape[cat] = split_sizes[group.rank], sum(sizes)
    sb, rb = Blocks(x.shape, split, split_sizes), Blocks(tuple(shape), cat, sizes)
    plan = _new_plan(group, x, "all_to_all", tuple(shape),
                     x.shape[:cat] + (-1,) + x.shape[cat + 1:], split_axis=split,
                     concat_axis=cat, sizes=sizes)
    plan.send, plan.recv = None if sb.lead == 1 else sb, None if rb.lead == 1 else rb
    if sb.even and rb.even and sb.counts[0] == rb.counts[0]:
        plan.method = "Alltoall"
    else:
        plan.method = "Alltoallv"
        plan.send_spec = ((sb.counts, sb.displs), plan.mpi_type)
        plan.recv_spec = ((rb.counts, rb.displs), plan.mpi_type)
    return _big_counts(group, plan, sb.counts + sb.displs + rb.counts + rb.displs)


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
        For an unknown ``op``, max/min of complex, a dtype MPI cannot reduce, a wrong
        ``out``; :class:`~pympar.errors.CollectiveMismatchError` when ranks differ.
    """
    return run(group, x, out, label, "all_reduce", _plan_all_reduce, (op,))


def broadcast(group: Communicator, x: Any, root: int = 0, out: Any = None,
              label: str | None = None) -> Any:
    """Return the root's ``x`` on every rank.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        The data on the root; elsewhere its values are ignored (same shape and dtype).
    root : int, default 0
        The sending rank, as a rank in this group (not a global rank).
    out : array, optional
        Where to write the result; may be ``x`` (in place).
    """
    return run(group, x, out, label, "broadcast", _plan_broadcast, (root,))


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
        Every rank's extent along ``axis`` in group-rank order (e.g. ``balanced_sizes(n,
        group.size)``); without it the ranks learn them in one small exchange.
    """
    checked = False
    if type(sizes) is not tuple:
        x, sizes, checked = _learn_sizes(group, x, out, sizes, label, "all_gather", (axis,))
    return run(group, x, out, label, "all_gather", _plan_all_gather, (axis, sizes), checked)


def reduce_scatter(group: Communicator, x: Any, axis: int = 0, out: Any = None,
                   op: str = "sum", label: str | None = None) -> Any:
    """Reduce ``x`` over the group and give each rank its block along ``axis``.

    Group rank ``r`` receives block ``r`` (balanced rule of ``numpy.array_split``) of the
    element-wise reduction.

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
    if getattr(x, "size", 0) > INT_MAX and not large_counts_supported() and group.size > 1:
        # MPI-3's built-in reductions refuse derived datatypes: reduce all, keep my block.
        try:
            ax = _axis(axis, x, "reduce_scatter")
            block = block_slice(x.shape[ax], group.size, group.rank)
            shape = x.shape[:ax] + (block.stop - block.start,) + x.shape[ax + 1:]
            if out is not None:  # as the plan of smaller counts checks it
                check_out(x, out, shape, "reduce_scatter", x.dtype.newbyteorder("="))
        except (TypeError, ValueError) as err:
            refuse(group, "reduce_scatter", err)
            raise
        mine = all_reduce(group, x, op, None, label)[(slice(None),) * ax + (block,)]
        if out is None:
            return mine.copy()
        out[...] = mine
        return out
    return run(group, x, out, label, "reduce_scatter", _plan_reduce_scatter, (axis, op))


def all_to_all(group: Communicator, x: Any, split_axis: int, concat_axis: int,
               out: Any = None, sizes: Sequence[int] | None = None,
               label: str | None = None) -> Any:
    """Split ``x`` along ``split_axis``, send block ``q`` to rank ``q``, concatenate the rest.

    The result equals ``numpy.concatenate([array_split(x_q, p, split_axis)[r] for q in
    range(p)], concat_axis)`` on group rank ``r``.

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
    if type(sizes) is not tuple:
        x, sizes, checked = _learn_sizes(group, x, out, sizes, label, "all_to_all",
                                         (split_axis, concat_axis))
    return run(group, x, out, label, "all_to_all", _plan_all_to_all,
               (split_axis, concat_axis, sizes), checked)
