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
  (:mod:`pympar.partition`). Gathering ranks of unknown extents agree on them with one
  small Allgather, which ``sizes=`` (every rank's extent, in group-rank order) avoids.
* Agreement, always on: every call first checks that all ranks pass the same operation,
  dtype, extents (those not gathered), axis, sizes, root, op and mapping label (a
  ``PYMPAR_CHECK_BYTES`` threshold leaves out calls moving less, except under a timeout
  and gathers without ``sizes=``), started before packing and finished before the data
  call (folded into the size exchange where there is one). A group whose ranks share a
  node checks without a message: each rank writes one word (check count, 32-bit
  signature) into the group's shared-memory board and reads the others'
  (:mod:`pympar._board`); other groups run one 16-byte Iallreduce. A rank that refuses
  its ``out=`` joins the check with a signature that cannot match. A mismatch raises the
  same :class:`~pympar.debug.CollectiveMismatchError` on every rank. ``PYMPAR_DEBUG=1``
  compares every call, whatever its size, and names what each rank passed.
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

import contextlib
import math
import operator
import time
import zlib
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np
from mpi4py import MPI

from . import backend, debug, stats
from ._plans import Blocks, Plan, in_units, pack, remember, scratch, unpack
from .partition import balanced_sizes, block_slice

if TYPE_CHECKING:  # group.py imports this module
    import pympar.group

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "label",
           "agree", "balanced_sizes", "block_slice", "large_counts_supported", "INT_MAX",
           "CHECK_BYTES"]

#: The largest count or displacement an MPI-3 (``int``) interface can take.
INT_MAX = 2**31 - 1

#: Calls whose global array has at least this many bytes are checked for agreement
#: (``PYMPAR_CHECK_BYTES``, read at import; default 0: every call; every call is checked
#: under ``PYMPAR_TIMEOUT`` or ``PYMPAR_DEBUG`` whatever this says). On one node the check
#: is a write and a read of shared memory: 0.55 us alone on 2 ranks (MPICH 5.0.2, 2-core
#: VM), against 2.6 us for the 16-byte Iallreduce + Wait that groups across nodes use; a
#: median 1.1 us per 1 MiB call in ``benchmarks/bench_mappings.py`` (3.7 us with the
#: Iallreduce; about 1% of the fastest 1 MiB collectives there). Raise it to trade that for
#: unchecked small messages.
CHECK_BYTES = debug.parse_bytes("PYMPAR_CHECK_BYTES", "0")

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
_BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND}
_MOVABLE = "biufc"  # dtype kinds: bool, int, uint, float, complex
_IN_PLACE = MPI.IN_PLACE
_MOVE: Any = object()  # the op of a collective that reduces nothing

# The label of the code running collectives (see label()); mappings pass theirs.
_label: str | None = None
# Whether debug mode, a timeout or a stats recorder is on: the one branch they cost.
_hooked = False


def _refresh_hooks() -> None:
    global _hooked
    _hooked = debug.is_enabled() or debug.get_timeout() is not None or stats.is_recording()


debug._listeners.append(_refresh_hooks)
stats._listeners.append(_refresh_hooks)
_refresh_hooks()


@contextlib.contextmanager
def label(name: str) -> Iterator[None]:
    """Name the collectives called inside a ``with`` block, in statistics and errors.

    Parameters
    ----------
    name : str
        E.g. ``"Linear3D.backward"``; statistics record each collective inside as
        ``"Linear3D.backward:all_gather"`` and so on. Part of the agreement check: ranks
        running the same collective under different labels raise
        :class:`~pympar.debug.CollectiveMismatchError`.
        Mappings label their own collectives (``"gather_from_sequence.forward"``).
    """
    global _label
    saved, _label = _label, name
    try:
        yield
    finally:
        _label = saved


def _within(name: str | None) -> str | None:
    """The label the agreement check compares: a mapping's own inside any ``label`` block.

    Statistics keep the mapping's label alone; the check also compares the enclosing
    block's, so that layers naming themselves (with their sizes) in a block make ranks
    that built different layers raise even when the collective itself looks alike.
    """
    if _label is None:
        return name
    return f"{_label}/{name}" if name else _label


def agree(group: pympar.group.Group, key: tuple, shown: str) -> None:
    """Check that every rank of ``group`` reaches this point with an equal ``key``.

    One agreement check of the collectives' own kind (see the module notes), for
    communication they do not cover, such as a ring of point-to-point messages, or cover
    too coarsely, such as one flat buffer whose parts every rank must order alike. The
    check compares the enclosing :func:`label` too. Nothing happens on a group of one
    rank; ``PYMPAR_CHECK_BYTES`` does not apply.

    Parameters
    ----------
    group : Group
        The ranks that must agree.
    key : tuple
        What must be equal on every rank (hashable; shapes, dtypes as strings, flags).
    shown : str
        This rank's call in words, for the error message.

    Raises
    ------
    pympar.debug.CollectiveMismatchError
        On every rank, when two ranks' keys (or labels) differ.
    RuntimeError
        When ``group`` has been freed.
    """
    if group.size == 1:
        return
    if group.comm == MPI.COMM_NULL:
        raise RuntimeError(f"{shown}: group {group.name!r} has been freed (Group.free or "
                           f"manager.destroy_parallel); use the groups of the current state")
    plan = group._plans.get(("agree", key))
    if plan is None:
        plan = remember(group, ("agree", key), Plan(
            key=("agree", key), shown=shown, sig=zlib.crc32(repr(key).encode()) & 0x7FFFFFFF))
    name = _within(None)
    if debug.is_enabled():
        debug.verify(group, (plan.key, name), debug.describe(shown, name), None, None)
    else:
        _agree(group, plan, name, None)


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


def _new_plan(group: pympar.group.Group, x: Any, what: str, op: Any = _MOVE, **plan: Any) -> Plan:
    """The parts of a plan every operation shares; checks the group and the dtype."""
    if group.comm == MPI.COMM_NULL:
        raise RuntimeError(f"{what}: group {group.name!r} has been freed (Group.free or "
                           f"manager.destroy_parallel); use the groups of the current state")
    dtype = x.dtype
    if dtype.kind not in _MOVABLE and dtype != backend.bfloat16:
        raise TypeError(f"{what}: pympar collectives move bool, integer, float and complex "
                        f"arrays, not dtype {dtype}")
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


def _post(group: pympar.group.Group, plan: Plan, name: str | None) -> MPI.Request | int:
    """Start the agreement check; return the token :func:`_settle` finishes it with.

    The call's signature ``s`` is the plan's with the label's folded in, built once per
    (plan, label). A group on one node writes it (hashed to 32 bits) into its
    shared-memory board (:mod:`pympar._board`): no message; the token is the word
    written. Other groups start one 16-byte Iallreduce (MAX) of ``[s, -s]``, equal on
    every rank exactly when ``max == -min``, that is when every rank sent the same
    ``s``; the token is its request. Started before packing and finished just before the
    data call, so that another rank's lateness or the latency overlaps the local work.
    """
    mine = plan.checks.get(name)
    if mine is None:
        s = plan.sig << 31 | (_LABELS.get(name) or _label_sig(name)) if name else plan.sig << 31
        mine = plan.checks[name] = (np.array([s, -s], np.int64).tobytes() if group._board is None
                                    else zlib.crc32(s.to_bytes(8, "little")))
    board = group._board
    if board is not None:
        return board.publish(mine)
    return group.comm.Iallreduce([mine, MPI.INT64_T], [_SEEN, MPI.INT64_T], MPI.MAX)


def _settle(group: pympar.group.Group, plan: Plan, check: MPI.Request | int, name: str | None,
            x: Any) -> None:
    """Finish the check started by :func:`_post`; raise on every rank when ranks differ."""
    timeout = debug.get_timeout() if _hooked else None
    board = group._board
    if board is not None:
        agreed = board.wait(check, group, plan.shown, timeout)
    else:
        if timeout is None:
            check.Wait()
        else:
            debug.wait(check, plan.shown, group, timeout, time.monotonic())
        agreed = _SEEN == plan.checks[name]
    if not agreed:
        _mismatch(group, plan.key, name, plan.shown, x)


def _agree(group: pympar.group.Group, plan: Plan, name: str | None, x: Any) -> None:
    """The whole agreement check at once (see :func:`_post`)."""
    _settle(group, plan, _post(group, plan, name), name, x)


#: The Iallreduce check's receive buffer (one check is in flight at a time).
_SEEN = bytearray(16)
_LABELS: dict[str, int] = {}


def _label_sig(name: str) -> int:
    sig = _LABELS[name] = zlib.crc32(name.encode()) & 0x7FFFFFFF or 1
    return sig


def _mismatch(group: pympar.group.Group, key: tuple, name: str | None, shown: str, x: Any) -> None:
    """Raise the same CollectiveMismatchError on every rank, naming every rank's call."""
    debug.verify(group, (key, name), debug.describe(shown, name), None, x)
    raise debug.CollectiveMismatchError(f"ranks of group {group.name!r} disagree on {shown}")


def _dest(group: pympar.group.Group, plan: Plan, x: Any, out: Any) -> Any:
    """The C-contiguous array MPI (or the unpacking) writes: None for a new result, ``out``
    itself, or scratch for a non-contiguous ``out``; raises for an ``out`` that does not fit."""
    if out is None:
        return None
    if type(out) is type(x) and out.shape == plan.out_shape and out.dtype == x.dtype:
        return out if out.flags.c_contiguous else scratch(group, "dest", out.shape, x.dtype, x)
    raise (TypeError if type(out) is not type(x) else ValueError)(
        f"{plan.shown}: out is a {type(out).__name__} of shape {getattr(out, 'shape', '?')} "
        f"and dtype {getattr(out, 'dtype', '?')}, expected a {type(x).__name__} of shape "
        f"{plan.out_shape} and dtype {x.dtype}")


def _checked_dest(group: pympar.group.Group, plan: Plan, x: Any, out: Any, name: str | None,
                  full: bool) -> Any:
    """:func:`_dest`, where a refused ``out`` makes every rank raise, not just this one.

    The refusing rank joins the check (``full``: debug mode's exchange) with a signature
    that cannot match, so that the other ranks raise instead of waiting in the data call.
    """
    try:
        return _dest(group, plan, x, out)
    except (TypeError, ValueError):
        shown = (f"{plan.shown} with out of shape {getattr(out, 'shape', '?')} and dtype "
                 f"{getattr(out, 'dtype', '?')} (does not fit)")
        bad = Plan(key=plan.key + ("out does not fit",), shown=shown, sig=0)
        if full:
            debug.verify(group, (bad.key, name), debug.describe(shown, name), None, x)
        else:
            _agree(group, bad, name, x)
        raise


def _run(group: pympar.group.Group, plan: Plan, x: Any, out: Any, name: str | None,
         checked: bool = False) -> Any:
    """Agree, then move: the common tail of every collective."""
    if plan.swap:
        x = x.astype(x.dtype.newbyteorder("="))
    if not _hooked:
        if checked or plan.nbytes < CHECK_BYTES or group.size == 1:
            return _move(group, plan, x, _dest(group, plan, x, out), out, None, None)
        name = name if _label is None else _within(name)
        dest = _checked_dest(group, plan, x, out, name, False)
        return _move(group, plan, x, dest, out, _post(group, plan, name), name)
    # Statistics keep the collective's kind under a layer's label ("Linear3D.forward:all_gather"),
    # so that bytes can still be told apart by kind; a mapping's label already says it.
    op = name or (f"{_label}:{plan.key[0]}" if _label else plan.key[0])
    name = name if _label is None else _within(name)
    check = None
    if group.size == 1:
        dest = _dest(group, plan, x, out)
    elif debug.is_enabled():
        dest = _checked_dest(group, plan, x, out, name, True)
        debug.verify(group, (plan.key, name), debug.describe(plan.shown, name), out, x)
    else:
        if checked:
            dest = _dest(group, plan, x, out)
        else:
            dest = _checked_dest(group, plan, x, out, name, False)
            check = _post(group, plan, name)
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
        wsend, wrecv = (send, recv) if numpy else backend.to_wire(send, recv)
        if check is not None:  # never start the data call before the check has passed
            _settle(group, plan, check, name, x)
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
    x = _array(x, "all_reduce")
    key = ("all_reduce", x.shape, x.dtype, op)
    plan = group._plans.get(key)
    if plan is None:
        plan = _new_plan(group, x, "all_reduce", op, out_shape=x.shape, method="Allreduce")
        plan.send_spec = plan.recv_spec = (plan.mpi_type,)
        plan.tail = (plan.op,)
        plan.key = ("all_reduce", x.shape, plan.work.str, op)
        plan.shown = f"all_reduce(shape={x.shape}, dtype={x.dtype}, op={op!r})"
        _finish(group, plan, key, x.shape, (x.size,))
    return _run(group, plan, x, out, label)


def broadcast(group: pympar.group.Group, x: Any, root: int = 0, out: Any = None,
              label: str | None = None) -> Any:
    """Body of :meth:`pympar.group.Group.broadcast`; ``label`` names the caller."""
    x = _array(x, "broadcast")
    key = ("broadcast", x.shape, x.dtype, root)
    plan = group._plans.get(key)
    if plan is None:
        root = _index(root, "broadcast", "root")
        if not 0 <= root < group.size:
            raise ValueError(f"broadcast: root {root} is not a rank of group {group.name!r} "
                             f"of size {group.size} (root is a rank in the group)")
        plan = _new_plan(group, x, "broadcast", out_shape=x.shape, method="Bcast", tail=(root,))
        plan.recv_spec = (plan.mpi_type,)
        plan.key = ("broadcast", x.shape, plan.work.str, root)
        plan.shown = f"broadcast(shape={x.shape}, dtype={x.dtype}, root={root})"
        _finish(group, plan, key, x.shape, (x.size,))
    return _run(group, plan, x, out, label)


def _gathered_sizes(group: pympar.group.Group, x: Any, axis: int, sizes: Any, what: str, key: tuple,
                    name: str | None) -> tuple[tuple[int, ...], bool]:
    """Every rank's extent along ``axis`` and whether the ranks already agreed on the call.

    Without ``sizes`` one small Allgather carries each rank's extent and the checksum of
    the rest of its call, so it also serves as the agreement check.
    """
    extent = x.shape[axis]
    if sizes is not None:
        sizes = tuple(_index(s, what, "sizes[i]") for s in sizes)
        if len(sizes) == group.size and sizes[group.rank] == extent:
            return sizes, False
        shown = f"{what}(shape={x.shape}, axis={axis}, sizes={sizes}, sizes fit: False)"
        # Join the check the other ranks are about to make, with a key that cannot match,
        # so that they raise too instead of waiting for this rank.
        bad = Plan(key=key + ("sizes do not fit",), shown=shown, sig=0)
        nbytes = sum(sizes) * math.prod(x.shape[:axis] + x.shape[axis + 1:]) * x.itemsize
        if group.size > 1 and debug.is_enabled():
            debug.verify(group, (bad.key, name), debug.describe(shown, name), None, x)
        elif group.size > 1 and (debug.get_timeout() is not None or nbytes >= CHECK_BYTES):
            _agree(group, bad, name, x)
        raise ValueError(f"{shown} on group {group.name!r}: sizes (every rank's extent along "
                         f"the axis, in group-rank order) do not fit {group.size} ranks with "
                         f"this rank ({group.rank}) holding {extent}")
    if group.size == 1:
        return (extent,), True
    if group.comm == MPI.COMM_NULL:
        _new_plan(group, x, what)  # raises: the group is freed
    s = zlib.crc32(repr((key, name)).encode())
    table = np.empty((group.size, 2), np.int64)
    _mpi(group, "Allgather", ([np.array([extent, s], np.int64), MPI.INT64_T],
                              [table, MPI.INT64_T]), f"{what} (agreeing sizes)")
    if (table[:, 1] != s).any():
        _mismatch(group, key, name, f"{what}(shape={x.shape}, dtype={x.dtype}, axis={axis})", x)
    return tuple(table[:, 0].tolist()), True


def all_gather(group: pympar.group.Group, x: Any, axis: int = 0, out: Any = None,
               sizes: Sequence[int] | None = None, label: str | None = None) -> Any:
    """Body of :meth:`pympar.group.Group.all_gather`; ``label`` names the caller."""
    x = _array(x, "all_gather")
    checked = False
    if type(sizes) is not tuple or not x.ndim:
        if not x.ndim:
            raise ValueError("all_gather needs an array of at least one dimension")
        ax = _axis(axis, x.ndim, "all_gather")
        masked = x.shape[:ax] + (-1,) + x.shape[ax + 1:]
        sizes, checked = _gathered_sizes(group, x, ax, sizes, "all_gather",
                                         ("all_gather", masked, x.dtype.str, ax, sizes),
                                         _within(label))
    key = ("all_gather", x.shape, x.dtype, axis, sizes)
    plan = group._plans.get(key)
    if plan is None:
        ax = _axis(axis, x.ndim, "all_gather")
        sizes, _ = _gathered_sizes(group, x, ax, sizes, "all_gather", (), _within(label))
        shape = x.shape[:ax] + (sum(sizes),) + x.shape[ax + 1:]
        b = Blocks(shape, ax, sizes)
        plan = _new_plan(group, x, "all_gather", out_shape=shape, recv=None if b.lead == 1 else b)
        plan.method = "Allgather" if b.even else "Allgatherv"
        plan.send_spec = (plan.mpi_type,)
        plan.recv_spec = (plan.mpi_type,) if b.even else ((b.counts, b.displs), plan.mpi_type)
        plan.key = ("all_gather", shape[:ax] + (-1,) + shape[ax + 1:], plan.work.str, ax, sizes)
        plan.shown = f"all_gather(shape={x.shape}, dtype={x.dtype}, axis={ax}, sizes={sizes})"
        _finish(group, plan, key, shape, b.counts + b.displs)
    return _run(group, plan, x, out, label, checked)


def reduce_scatter(group: pympar.group.Group, x: Any, axis: int = 0, out: Any = None,
                   op: str = "sum", label: str | None = None) -> Any:
    """Body of :meth:`pympar.group.Group.reduce_scatter`; ``label`` names the caller."""
    x = _array(x, "reduce_scatter")
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
        plan.key = ("reduce_scatter", x.shape, plan.work.str, ax, op)
        plan.shown = f"reduce_scatter(shape={x.shape}, dtype={x.dtype}, axis={ax}, op={op!r})"
        if x.size > INT_MAX and not large_counts_supported() and group.size > 1:
            # Built-in reductions refuse derived datatypes: reduce it all, keep my block.
            plan.method = None
            plan.tail = (slice(None),) * ax + (block_slice(x.shape[ax], group.size, group.rank),)
        _finish(group, plan, key, x.shape, ())
    if plan.method is None:
        mine = all_reduce(group, x, op, None, label)[plan.tail]
        if out is None:
            return mine.copy()
        out[...] = mine
        return out
    return _run(group, plan, x, out, label)


def all_to_all(group: pympar.group.Group, x: Any, split_axis: int, concat_axis: int,
               out: Any = None, sizes: Sequence[int] | None = None,
               label: str | None = None) -> Any:
    """Body of :meth:`pympar.group.Group.all_to_all`; ``label`` names the caller."""
    x = _array(x, "all_to_all")
    checked = False
    if type(sizes) is not tuple:
        if not x.ndim:
            raise ValueError("all_to_all needs an array of at least one dimension")
        cat = _axis(concat_axis, x.ndim, "all_to_all")
        masked = x.shape[:cat] + (-1,) + x.shape[cat + 1:]
        sizes, checked = _gathered_sizes(
            group, x, cat, sizes, "all_to_all",
            ("all_to_all", masked, x.dtype.str, split_axis, cat, sizes), _within(label))
    key = ("all_to_all", x.shape, x.dtype, split_axis, concat_axis, sizes)
    plan = group._plans.get(key)
    if plan is None:
        split = _axis(split_axis, x.ndim, "all_to_all")
        cat = _axis(concat_axis, x.ndim, "all_to_all")
        if split == cat:
            raise ValueError(f"all_to_all: split_axis and concat_axis must differ, both are "
                             f"{split}")
        sizes, _ = _gathered_sizes(group, x, cat, sizes, "all_to_all", (), _within(label))
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
        plan.key = ("all_to_all", tuple(global_shape), plan.work.str, split, cat, sizes)
        plan.shown = (f"all_to_all(shape={x.shape}, dtype={x.dtype}, split_axis={split}, "
                      f"concat_axis={cat}, sizes={sizes})")
        _finish(group, plan, key, tuple(global_shape[:cat]) + (sum(sizes),) + x.shape[cat + 1:],
                sb.counts + sb.displs + rb.counts + rb.displs)
    return _run(group, plan, x, out, label, checked)
