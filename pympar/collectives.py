"""Array collectives of :class:`~pympar.group.Group`, for NumPy and CuPy arrays.

``Group.all_reduce`` and its siblings delegate here. Every operation takes one path:

1. **validate** the input (an array; native byte order; a dtype MPI can move);
2. **plan**: look up, or build once, the :class:`~pympar._plans.Plan` of (operation, shape,
   dtype, axis, sizes): output shape, MPI method, counts, rank blocks, signature;
3. **agree** (:func:`_run`): the ranks check that they make the same call -- cheaply by
   default (started here, finished just before step 5), fully in debug mode;
4. **pack** the input into the buffer MPI reads (itself when it is C-contiguous);
5. **call MPI** through :func:`_mpi` (blocking, or non-blocking polled under a timeout);
6. **unpack** into the result (``out``, or a new C-contiguous array).

Notes
-----
* Layout: MPI sees C-contiguous buffers only. A non-leading axis is packed into (or
  unpacked from) rank-major blocks in a cached scratch buffer, so results follow
  ``numpy.concatenate`` and ``numpy.array_split``; derived datatypes did the same
  rearrangement no faster here.
* Sizes: uneven extents follow the balanced rule of ``numpy.array_split``
  (:mod:`pympar.partition`). Gathering ranks of unknown extents learn them from the
  agreement check, which carries every rank's extent; ``sizes=`` (every rank's extent,
  in group-rank order) spares nothing more than that.
* Agreement, always on: before its data call every call checks that all ranks pass the
  same operation, dtype, extents (those not gathered), axis, sizes, root, op and label.
  Every collective makes the same check (:mod:`pympar._agreement`), so ranks making
  different calls meet in it and raise the same
  :class:`~pympar.debug.CollectiveMismatchError`; a rank refusing its own arguments joins
  it with a signature no call has (:func:`refuse`), so the others raise too.
  ``PYMPAR_CHECK_BYTES`` leaves out smaller calls (:data:`CHECK_BYTES`).
* Counts above 2**31 - 1 go to MPI-4 libraries as they are; for MPI-3 the data moves in
  units of a contiguous derived datatype (gathers, all-to-all) or in chunks
  (all-reduce, broadcast). Built-in reductions refuse derived datatypes, so there a
  reduce-scatter is an all-reduce that keeps this rank's block.
* dtypes: bool reduces with logical or (sum, max) and and (min), as NumPy's ufuncs do;
  float16 and bfloat16 sum in float32; complex has no max/min. ``max``/``min`` with NaN
  give what MPI gives, not NumPy's propagation (whether a NaN survives depends on the
  library and the order it combines ranks in): test ``numpy.isnan`` first where it matters.
* CuPy: device buffers go to MPI directly when :func:`pympar.backend.cuda_aware`, else
  through pinned host buffers (:func:`pympar.backend.to_wire`).
"""

from __future__ import annotations

import math
import operator
import time
import zlib
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from mpi4py import MPI

from . import _agreement, backend, debug, stats
from ._agreement import agree, label
from ._board import MAX_EXTENT
from ._plans import Blocks, Plan, in_units, pack, remember, scratch, unpack
from .partition import balanced_sizes, block_slice

if TYPE_CHECKING:  # group.py imports this module
    import pympar.group

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "label",
           "agree", "refuse", "balanced_sizes", "block_slice", "large_counts_supported", "INT_MAX",
           "CHECK_BYTES"]

#: The largest count or displacement an MPI-3 (``int``) interface can take.
INT_MAX = 2**31 - 1

#: Calls whose global array has at least this many bytes are checked for agreement
#: (``PYMPAR_CHECK_BYTES``, read at import; default 0: every call; every call is checked
#: under ``PYMPAR_TIMEOUT`` or ``PYMPAR_DEBUG`` whatever this says). On one node the check
#: is a write and a read of shared memory, 0.7-1.1 us per call on 2 ranks (MPICH 5.0.2,
#: 2-core VM); across nodes a 24-byte Iallgather. ``benchmarks/bench_mappings.py``
#: prices it per operation beside its floor (a bare handshake). Raise it to trade that
#: for unchecked small messages.
CHECK_BYTES = debug.parse_bytes("PYMPAR_CHECK_BYTES", "0")

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
_BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND}
_MOVABLE = "biufc"  # dtype kinds: bool, int, uint, float, complex
_IN_PLACE = MPI.IN_PLACE
_MOVE: Any = object()  # the op of a collective that reduces nothing

# Whether debug mode, a timeout or a stats recorder is on: the one branch they cost.
_hooked = False


def _refresh_hooks() -> None:
    global _hooked
    _hooked = debug.is_enabled() or debug.get_timeout() is not None or stats.is_recording()


debug._listeners.append(_refresh_hooks)
stats._listeners.append(_refresh_hooks)
_refresh_hooks()


def large_counts_supported(mpi_version: tuple[int, int] | None = None) -> bool:
    """Return whether counts above :data:`INT_MAX` reach MPI as they are (MPI-4 ``_c`` routines).

    Parameters
    ----------
    mpi_version : tuple of int, optional
        The standard version to judge; ``MPI.Get_version()`` by default.
    """
    return tuple(MPI.Get_version() if mpi_version is None else mpi_version) >= (4, 0)


# --------------------------------------------------------------------------- validation


def _array(x: Any, what: str) -> Any:
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
    """``x``'s dtype, after refusing one MPI cannot move."""
    dtype = x.dtype
    if dtype.kind not in _MOVABLE and not backend.is_bfloat16(dtype):
        raise TypeError(f"{what}: pympar collectives move bool, integer, float and complex "
                        f"arrays, not dtype {dtype}")
    return dtype


def _native(x: Any) -> str:
    """``x``'s dtype in native byte order, as the agreement check compares it."""
    return x.dtype.newbyteorder("=").str


def _new_plan(group: pympar.group.Group, x: Any, what: str, op: Any = _MOVE, **plan: Any) -> Plan:
    """The parts of a plan every operation shares; checks the group and the dtype."""
    if group.comm == MPI.COMM_NULL:
        raise RuntimeError(f"{what}: group {group.name!r} has been freed (Group.free or "
                           f"manager.destroy_parallel); use the groups of the current state")
    dtype = _movable(x, what)
    native = dtype.newbyteorder("=")
    work, mpi_op = native, None
    if op is not _MOVE:
        table = _BOOL_OPS if dtype.kind == "b" else _OPS
        mpi_op = table.get(op) if isinstance(op, str) else None
        if mpi_op is None:
            raise ValueError(f"{what}: op must be one of {sorted(_OPS)}, not {op!r}")
        if dtype.kind == "c" and op != "sum":
            raise TypeError(f"{what}: op={op!r} is not defined for complex dtype {dtype}")
        work = backend.accumulation_dtype(native)
    return Plan(work=work, cast=work != native, swap=not dtype.isnative,
                mpi_type=backend.mpi_datatype(work), op=mpi_op, **plan)


def _finish(group: pympar.group.Group, plan: Plan, key: tuple, shape: tuple[int, ...],
            numbers: tuple[int, ...]) -> Plan:
    """Sign and cache ``plan``; ``shape`` is the global array, ``numbers`` the call's counts.

    On an MPI-3 library, counts above INT_MAX move in chunks (one buffer) or in units of a
    derived datatype (blocks).
    """
    plan.nbytes = math.prod(shape) * plan.work.itemsize
    plan.sig = zlib.crc32(repr(plan.key).encode()) & 0x7FFFFFFF
    if max(numbers, default=0) > INT_MAX and not large_counts_supported() and group.size > 1:
        if plan.method in ("Allreduce", "Bcast"):
            plan.chunk = INT_MAX
        elif plan.method is not None:
            in_units(plan, numbers, INT_MAX)
    return remember(group, key, plan)


# --------------------------------------------------------------------------- the path


def _mpi(group: pympar.group.Group, method: str, args: tuple, what: str) -> None:
    """Run ``comm.<method>(*args)``, or under a timeout its non-blocking twin, polled."""
    timeout = debug.get_timeout() if _hooked else None
    try:
        if timeout is None:
            getattr(group.comm, method)(*args)
        else:
            twin = "I" + method[0].lower() + method[1:]  # Allgatherv -> Iallgatherv
            debug.wait(getattr(group.comm, twin)(*args), what, group, timeout,
                       time.monotonic())
    except MPI.Exception as err:
        if err.Get_error_class() != MPI.ERR_TRUNCATE:
            raise
        raise debug.CollectiveMismatchError(
            f"{what} on group {group.name!r}: MPI received more data than this rank expects "
            f"(message truncated): the ranks passed arrays of different shapes or sizes; "
            f"PYMPAR_DEBUG=1 shows every rank's call") from err


def refuse(group: pympar.group.Group, what: str, error: Exception,
           always_checked: bool = False) -> None:
    """Make every rank raise when this rank refuses its own arguments before a collective.

    Call it just before raising ``error``, and only where the other ranks of ``group``
    make one of these collectives next (else this rank waits for them): it joins their
    agreement check with a signature no call has, so every rank raises
    :class:`~pympar.debug.CollectiveMismatchError` naming ``error``. It returns, for this
    rank to raise ``error`` itself, when every rank refused.

    Parameters
    ----------
    group : Group
        The group of the collective the others are about to make.
    what : str
        The call refused, in words (``"RowParallelLinear.forward"``).
    error : Exception
        What this rank is about to raise.
    always_checked : bool
        Whether that collective is checked whatever ``PYMPAR_CHECK_BYTES`` says: a gather
        of unknown extents (no ``sizes=`` or ``global_size=``) or :func:`agree`. Other
        calls are checked by default; with the threshold raised (and no timeout or debug
        mode) this rank cannot tell whether the others check theirs, so it does not join,
        and a mistake on one rank only can then leave the others waiting.
    """
    _refuse(group, what, error, None, always_checked or _checks_every_call())


def _refuse(group: pympar.group.Group, what: str, error: Exception, label: str | None,
            others_check: bool) -> None:
    """:func:`pympar._agreement.refuse`, under the label the check compares."""
    _agreement.refuse(group, what, error, _agreement.within(label), others_check)


def _checks_every_call() -> bool:
    """Whether every call is checked, whatever its size (see :data:`CHECK_BYTES`)."""
    return CHECK_BYTES == 0 or debug.is_enabled() or debug.get_timeout() is not None


def _dest(group: pympar.group.Group, plan: Plan, x: Any, out: Any) -> Any:
    """The C-contiguous array MPI (or the unpacking) writes: None for a new result, ``out``
    itself, or scratch for a non-contiguous ``out``; raises for an ``out`` that does not
    fit or that overlaps ``x`` (MPI cannot read and write one buffer; ``out`` may be ``x``
    itself where the operation works in place)."""
    if out is None:
        return None
    if type(out) is type(x) and out.shape == plan.out_shape and out.dtype == x.dtype:
        # Two arrays that each own their memory (no base) cannot overlap: the common
        # case skips the 0.15 us bounds comparison.
        if (out is not x and (out.base is not None or x.base is not None)
                and backend.array_module(x).may_share_memory(out, x)):
            raise ValueError(f"{plan.shown}: out overlaps the input without being it; "
                             f"pass a separate array")
        return out if out.flags.c_contiguous else scratch(group, "dest", out.shape, x.dtype, x)
    raise _unfit(x, out, plan.out_shape, plan.shown)


def _unfit(x: Any, out: Any, shape: tuple[int, ...], shown: str,
           dtype: np.dtype | None = None) -> Exception:
    """The error of an ``out`` that is not an array of ``x``'s kind, ``dtype`` (``x``'s by
    default) and ``shape``."""
    return (TypeError if type(out) is not type(x) else ValueError)(
        f"{shown}: out is a {type(out).__name__} of shape {getattr(out, 'shape', '?')} and "
        f"dtype {getattr(out, 'dtype', '?')}, which does not fit: expected a "
        f"{type(x).__name__} of shape {shape} and dtype {dtype or x.dtype}"
        + (" (-1: the gathered extent)" if -1 in shape else ""))


def _claim(x: Any, out: Any, axis: int, shape: tuple[int, ...], shown: str) -> int:
    """What a gather of unknown extents posts about its ``out``: 0 without one, else its
    extent along ``axis`` plus one, after refusing an ``out`` that cannot fit whatever the
    extents are (``shape`` is the result's, with -1 along ``axis``)."""
    if out is None:
        return 0
    # The result has the input's dtype in native byte order (see _run), and so must out.
    native = x.dtype.newbyteorder("=")
    if (type(out) is type(x) and out.dtype == native and out.ndim == len(shape)
            and out.shape[:axis] + (-1,) + out.shape[axis + 1:] == shape):
        if backend.array_module(x).may_share_memory(out, x):
            raise ValueError(f"{shown}: out overlaps the input; pass a separate array")
        return out.shape[axis] + 1
    raise _unfit(x, out, shape, shown, native)


def _run(group: pympar.group.Group, plan: Plan, x: Any, out: Any, name: str | None,
         checked: bool = False) -> Any:
    """Agree, then move: the common tail of every collective."""
    if plan.swap:
        x = x.astype(x.dtype.newbyteorder("="))
    if not _hooked:
        if checked or plan.nbytes < CHECK_BYTES or group.size == 1:
            return _move(group, plan, x, _dest(group, plan, x, out), out, None, None)
        if _agreement._label is not None:
            name = _agreement.within(name)
        try:
            dest = _dest(group, plan, x, out)
        except (TypeError, ValueError) as err:
            _agreement.refuse(group, plan.key[0], err, name, True)
            raise
        return _move(group, plan, x, dest, out, _agreement.post(group, plan, name), name)
    # Statistics keep the collective's kind under a layer's label ("Linear3D.forward:all_gather"),
    # so that bytes can still be told apart by kind; a mapping's label already says it.
    outer = _agreement._label
    op = name or (f"{outer}:{plan.key[0]}" if outer else plan.key[0])
    name = _agreement.within(name)
    checks = group.size > 1 and not checked and (plan.nbytes >= CHECK_BYTES
                                                 or _checks_every_call())
    try:
        dest = _dest(group, plan, x, out)
    except (TypeError, ValueError) as err:
        _agreement.refuse(group, plan.key[0], err, name, checks)
        raise
    check = None
    if checks:
        if debug.is_enabled():  # the check every call makes, then the full comparison
            _agreement.check(group, plan, name, x)
        else:
            check = _agreement.post(group, plan, name)
    if group.size > 1 and debug.is_enabled():
        debug.verify(group, (plan.key, name), debug.describe(plan.shown, name), out, x)
    if not stats.is_recording():
        return _move(group, plan, x, dest, out, check, name)
    start = time.perf_counter()
    y = _move(group, plan, x, dest, out, check, name)
    stats.add(group.name, op, x.nbytes, y.nbytes, time.perf_counter() - start)
    return y


def _move(group: pympar.group.Group, plan: Plan, x: Any, dest: Any, out: Any,
          check: MPI.Request | int | None, name: str | None) -> Any:
    """Pack, settle the agreement check (when one was started), call MPI, unpack."""
    numpy = type(x) is np.ndarray
    if dest is None:
        dest = (np.empty if numpy else backend.array_module(x).empty)(plan.out_shape, x.dtype)
    if group.size == 1:
        dest[...] = x
    else:
        sb, rb, method = plan.send, plan.recv, plan.method
        if method == "Bcast":
            send = None
            if group.rank == plan.tail[0] and dest is not x:
                dest[...] = x
        elif sb is not None:
            send = scratch(group, "send", sb.scratch_shape, plan.work, x)
            pack(send, x, sb)
        elif dest is x and not plan.cast:
            send = _IN_PLACE  # an in-place all_reduce
        elif x.flags.c_contiguous and not plan.cast:
            send = x
        else:
            send = scratch(group, "send", x.shape, plan.work, x)
            send[...] = x  # C order (never memory order), float32 for half precision
        if rb is not None:
            recv = scratch(group, "recv", rb.scratch_shape, plan.work, x)
        elif plan.cast:
            recv = scratch(group, "acc", plan.out_shape, plan.work, x)
        else:
            recv = dest
        # Under a timeout MPI gets the non-blocking twin, which CUDA-aware MPIs do not
        # promise for device memory: device buffers are staged then (see _mpi).
        wsend, wrecv = (send, recv) if numpy else backend.to_wire(
            send, recv, staged=_hooked and debug.get_timeout() is not None)
        if check is not None:  # never start the data call before the check has passed
            _agreement.settle(group, plan, check, name, x,
                              debug.get_timeout() if _hooked else None)
        if plan.chunk is None:
            _mpi(group, method, _args(plan, wsend, wrecv), plan.shown)
        else:  # MPI-3 and a count above INT_MAX: a few calls on consecutive slices
            flat_r = wrecv.reshape(-1)
            flat_s = wsend.reshape(-1) if wsend is not None and wsend is not _IN_PLACE else wsend
            for lo in range(0, flat_r.size, plan.chunk):
                part = slice(lo, lo + plan.chunk)
                s = flat_s[part] if flat_s is not None and flat_s is not _IN_PLACE else flat_s
                _mpi(group, method, _args(plan, s, flat_r[part]), plan.shown)
        if not numpy:
            backend.from_wire(recv, wrecv)
        if rb is not None:
            unpack(dest, recv, rb)
        elif recv is not dest:
            dest[...] = recv  # rounds float32 sums back to half precision
    if out is None or dest is out:
        return dest
    out[...] = dest  # a non-contiguous out, written once at the end
    return out


def _args(plan: Plan, send: Any, recv: Any) -> tuple:
    receive = [recv, *plan.recv_spec]
    if send is None:
        return (receive, *plan.tail)
    return (send if send is _IN_PLACE else [send, *plan.send_spec], receive, *plan.tail)


# --------------------------------------------------------------------------- operations


def all_reduce(group: pympar.group.Group, x: Any, op: str = "sum", out: Any = None,
               label: str | None = None) -> Any:
    """Body of :meth:`pympar.group.Group.all_reduce`; ``label`` names the caller."""
    try:
        x = _array(x, label or "all_reduce")
        key = ("all_reduce", x.shape, x.dtype, op)
        plan = group._plans.get(key)
        if plan is None:
            plan = _new_plan(group, x, "all_reduce", op, out_shape=x.shape, method="Allreduce")
            plan.send_spec = plan.recv_spec = (plan.mpi_type,)
            plan.tail = (plan.op,)
            plan.key = ("all_reduce", x.shape, _native(x), op)
            plan.shown = f"all_reduce(shape={x.shape}, dtype={x.dtype}, op={op!r})"
            _finish(group, plan, key, x.shape, (x.size,))
    except (TypeError, ValueError) as err:
        _refuse(group, "all_reduce", err, label, _checks_every_call())
        raise
    return _run(group, plan, x, out, label)


def broadcast(group: pympar.group.Group, x: Any, root: int = 0, out: Any = None,
              label: str | None = None) -> Any:
    """Body of :meth:`pympar.group.Group.broadcast`; ``label`` names the caller."""
    try:
        x = _array(x, label or "broadcast")
        key = ("broadcast", x.shape, x.dtype, root)
        plan = group._plans.get(key)
        if plan is None:
            root = _index(root, "broadcast", "root")
            if not 0 <= root < group.size:
                raise ValueError(f"broadcast: root {root} is not a rank of group {group.name!r} "
                                 f"of size {group.size} (root is a rank in the group)")
            plan = _new_plan(group, x, "broadcast", out_shape=x.shape, method="Bcast",
                             tail=(root,))
            plan.recv_spec = (plan.mpi_type,)
            plan.key = ("broadcast", x.shape, _native(x), root)
            plan.shown = f"broadcast(shape={x.shape}, dtype={x.dtype}, root={root})"
            _finish(group, plan, key, x.shape, (x.size,))
    except (TypeError, ValueError) as err:
        _refuse(group, "broadcast", err, label, _checks_every_call())
        raise
    return _run(group, plan, x, out, label)


def _gathered_sizes(group: pympar.group.Group, x: Any, axis: int, sizes: Any, what: str,
                    key: tuple, name: str | None, claim: int = 0) -> tuple[tuple[int, ...], bool]:
    """Every rank's extent along ``axis`` and whether the ranks already agreed on the call.

    Without ``sizes`` every rank's extent travels with the agreement check of the call
    (``key``, the call with this axis's extent masked), together with each rank's
    ``claim`` (see :func:`_claim`): an ``out`` that does not fit the gathered extent on
    any rank makes every rank raise.
    """
    extent = x.shape[axis]
    if sizes is not None:
        sizes = tuple(_index(s, what, "sizes[i]") for s in sizes)
        if len(sizes) == group.size and sizes[group.rank] == extent:
            return sizes, False
        raise ValueError(f"{what}(shape={x.shape}, axis={axis}, sizes={sizes}, sizes fit: "
                         f"False) on group {group.name!r}: sizes (every rank's extent along "
                         f"the axis, in group-rank order) do not fit {group.size} ranks with "
                         f"this rank ({group.rank}) holding {extent}")
    if group.size == 1:
        return (extent,), True
    if group.comm == MPI.COMM_NULL:
        _new_plan(group, x, what)  # raises: the group is freed
    if max(extent, claim) >= MAX_EXTENT:
        raise ValueError(f"{what}: an extent of {extent} along axis {axis} needs sizes= "
                         f"(every rank's extent)")
    shown = f"{what}(shape={x.shape}, dtype={x.dtype}, axis={axis})"
    return _agreement.extents(group, key, name, shown, x, extent, claim), True


def all_gather(group: pympar.group.Group, x: Any, axis: int = 0, out: Any = None,
               sizes: Sequence[int] | None = None, label: str | None = None) -> Any:
    """Body of :meth:`pympar.group.Group.all_gather`; ``label`` names the caller."""
    unknown, checked = sizes is None, False
    try:
        x = _array(x, label or "all_gather")
        if type(sizes) is not tuple or not x.ndim:
            if not x.ndim:
                raise ValueError("all_gather needs an array of at least one dimension")
            ax = _axis(axis, x.ndim, "all_gather")
            masked = x.shape[:ax] + (-1,) + x.shape[ax + 1:]
            claim = _claim(x, out, ax, masked, "all_gather") if unknown else 0
            _movable(x, "all_gather")
            sizes, checked = _gathered_sizes(group, x, ax, sizes, "all_gather",
                                             ("all_gather", masked, _native(x), ax, sizes),
                                             _agreement.within(label), claim)
        key = ("all_gather", x.shape, x.dtype, axis, sizes)
        plan = group._plans.get(key)
        if plan is None:
            ax = _axis(axis, x.ndim, "all_gather")
            sizes, _ = _gathered_sizes(group, x, ax, sizes, "all_gather", (), None)
            shape = x.shape[:ax] + (sum(sizes),) + x.shape[ax + 1:]
            b = Blocks(shape, ax, sizes)
            plan = _new_plan(group, x, "all_gather", out_shape=shape,
                             recv=None if b.lead == 1 else b)
            plan.method = "Allgather" if b.even else "Allgatherv"
            plan.send_spec = (plan.mpi_type,)
            plan.recv_spec = (plan.mpi_type,) if b.even else ((b.counts, b.displs), plan.mpi_type)
            plan.key = ("all_gather", shape[:ax] + (-1,) + shape[ax + 1:], _native(x), ax, sizes)
            plan.shown = f"all_gather(shape={x.shape}, dtype={x.dtype}, axis={ax}, sizes={sizes})"
            _finish(group, plan, key, shape, b.counts + b.displs)
    except (TypeError, ValueError) as err:
        if not checked:  # after the exchange, every rank raises alike
            _refuse(group, "all_gather", err, label,
                    unknown or _checks_every_call())
        raise
    return _run(group, plan, x, out, label, checked)


def reduce_scatter(group: pympar.group.Group, x: Any, axis: int = 0, out: Any = None,
                   op: str = "sum", label: str | None = None) -> Any:
    """Body of :meth:`pympar.group.Group.reduce_scatter`; ``label`` names the caller."""
    try:
        x = _array(x, label or "reduce_scatter")
        key = ("reduce_scatter", x.shape, x.dtype, axis, op)
        plan = group._plans.get(key)
        if plan is None:
            if not x.ndim:
                raise ValueError("reduce_scatter needs an array of at least one dimension")
            ax = _axis(axis, x.ndim, "reduce_scatter")
            sizes = balanced_sizes(x.shape[ax], group.size)
            b = Blocks(x.shape, ax, sizes)
            shape = x.shape[:ax] + (sizes[group.rank],) + x.shape[ax + 1:]
            plan = _new_plan(group, x, "reduce_scatter", op, out_shape=shape,
                             send=None if b.lead == 1 else b)
            plan.method = "Reduce_scatter_block" if b.even else "Reduce_scatter"
            plan.send_spec = plan.recv_spec = (plan.mpi_type,)
            plan.tail = (plan.op,) if b.even else (b.counts, plan.op)
            plan.key = ("reduce_scatter", x.shape, _native(x), ax, op)
            plan.shown = f"reduce_scatter(shape={x.shape}, dtype={x.dtype}, axis={ax}, op={op!r})"
            if x.size > INT_MAX and not large_counts_supported() and group.size > 1:
                # Built-in reductions refuse derived datatypes: reduce it all, keep my block.
                plan.method = None
                plan.tail = (slice(None),) * ax + (block_slice(x.shape[ax], group.size,
                                                               group.rank),)
            _finish(group, plan, key, x.shape, ())
    except (TypeError, ValueError) as err:
        _refuse(group, "reduce_scatter", err, label, _checks_every_call())
        raise
    if plan.method is None:
        mine = all_reduce(group, x, op, None, label)[plan.tail]
        if out is None:
            return mine.copy()
        out[...] = mine
        return out
    return _run(group, plan, x, out, label)


def _split_concat(x: Any, split_axis: Any, concat_axis: Any) -> tuple[int, int]:
    """The all-to-all's two axes, normalized; refused when out of range or alike."""
    split = _axis(split_axis, x.ndim, "all_to_all")
    cat = _axis(concat_axis, x.ndim, "all_to_all")
    if split == cat:
        raise ValueError(f"all_to_all: split_axis and concat_axis must differ, both are {split}")
    return split, cat


def all_to_all(group: pympar.group.Group, x: Any, split_axis: int, concat_axis: int,
               out: Any = None, sizes: Sequence[int] | None = None,
               label: str | None = None) -> Any:
    """Body of :meth:`pympar.group.Group.all_to_all`; ``label`` names the caller."""
    unknown, checked = sizes is None, False
    try:
        x = _array(x, label or "all_to_all")
        if type(sizes) is not tuple:
            if not x.ndim:
                raise ValueError("all_to_all needs an array of at least one dimension")
            split, cat = _split_concat(x, split_axis, concat_axis)
            masked = x.shape[:cat] + (-1,) + x.shape[cat + 1:]
            claim = 0
            if unknown:
                mine = list(masked)
                mine[split] = balanced_sizes(x.shape[split], group.size)[group.rank]
                claim = _claim(x, out, cat, tuple(mine), "all_to_all")
            _movable(x, "all_to_all")
            sizes, checked = _gathered_sizes(
                group, x, cat, sizes, "all_to_all",
                ("all_to_all", masked, _native(x), split, cat, sizes), _agreement.within(label),
                claim)
        key = ("all_to_all", x.shape, x.dtype, split_axis, concat_axis, sizes)
        plan = group._plans.get(key)
        if plan is None:
            split, cat = _split_concat(x, split_axis, concat_axis)
            sizes, _ = _gathered_sizes(group, x, cat, sizes, "all_to_all", (), None)
            split_sizes = balanced_sizes(x.shape[split], group.size)
            shape = list(x.shape)
            shape[split], shape[cat] = split_sizes[group.rank], sum(sizes)
            sb, rb = Blocks(x.shape, split, split_sizes), Blocks(tuple(shape), cat, sizes)
            plan = _new_plan(group, x, "all_to_all", out_shape=tuple(shape),
                             send=None if sb.lead == 1 else sb, recv=None if rb.lead == 1 else rb)
            t = plan.mpi_type
            if sb.even and rb.even and sb.counts[0] == rb.counts[0]:
                plan.method, plan.send_spec, plan.recv_spec = "Alltoall", (t,), (t,)
            else:
                plan.method = "Alltoallv"
                plan.send_spec = ((sb.counts, sb.displs), t)
                plan.recv_spec = ((rb.counts, rb.displs), t)
            global_shape = list(x.shape)
            global_shape[cat] = -1
            plan.key = ("all_to_all", tuple(global_shape), _native(x), split, cat, sizes)
            plan.shown = (f"all_to_all(shape={x.shape}, dtype={x.dtype}, split_axis={split}, "
                          f"concat_axis={cat}, sizes={sizes})")
            _finish(group, plan, key,
                    tuple(global_shape[:cat]) + (sum(sizes),) + x.shape[cat + 1:],
                    sb.counts + sb.displs + rb.counts + rb.displs)
    except (TypeError, ValueError) as err:
        if not checked:  # after the exchange, every rank raises alike
            _refuse(group, "all_to_all", err, label, unknown or _checks_every_call())
        raise
    return _run(group, plan, x, out, label, checked)
