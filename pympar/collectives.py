"""Array collectives of :class:`~pympar.group.Group`, for NumPy and CuPy arrays.

The functions here are the bodies of ``Group.all_reduce``, ``Group.all_gather``,
``Group.reduce_scatter``, ``Group.all_to_all`` and ``Group.broadcast`` (their
first parameter is the group, ``self``). Arrays travel through mpi4py's
uppercase buffer methods only.

Notes
-----
* Layout: MPI sees C-contiguous buffers only, never an array in memory order
  (Fortran-ordered or strided input is copied in C order first). A non-leading
  axis is handled by packing (or unpacking) rank-major blocks in a cached
  contiguous buffer -- one strided copy for even blocks, one per rank otherwise
  -- so results follow ``numpy.concatenate`` and ``numpy.array_split``.
  Measured here, MPI derived datatypes did the same rearrangement no faster.
* Sizes: uneven extents follow the balanced rule of ``numpy.array_split``.
  Gathering ranks of unknown extents agree on them with one small Allgather,
  which ``sizes=`` avoids; counts above 2**31 - 1 need MPI-4 large-count
  routines and are refused with ``ValueError`` before any MPI call otherwise.
* Hot path: everything that depends only on (shape, dtype, axis, sizes) -- the
  output shape, MPI datatype, counts and displacements, whether packing is
  needed -- is a plan in a per-group dict; internal temporaries come from a
  bounded per-group buffer cache keyed by (slot, shape, dtype). The common NumPy
  cases run inline in the public function. Callers that pass ``out=`` allocate
  nothing.
* Debug checks, timeouts and statistics share one module flag, ``_hooked``,
  so that with all three off a collective pays a single branch for them.
* CuPy: the current stream is synchronised before MPI touches a device buffer;
  device buffers go to MPI directly when :func:`pympar.backend.cuda_aware`,
  otherwise through pinned host buffers that are cached and grown, never
  reallocated per call. CuPy is only imported when a CuPy array is seen.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from . import backend, debug, stats

__all__ = [
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "balanced_sizes",
    "check_count",
    "large_counts_supported",
    "INT_MAX",
]

#: The largest count or displacement an MPI-3 (``int``) interface can take.
INT_MAX = 2**31 - 1

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
_MAX_BUFFERS = 16
_MAX_BUFFER_BYTES = 2**31  # per group; one larger message still gets its buffer
_MAX_PLANS = 512

# True while debug mode, a timeout or a stats recorder is active: the one branch
# the fast path pays for all three.
_hooked = False
# Name of the mapping (e.g. "gather_from_sequence.forward") whose collective is
# running, set by pympar.mappings only while hooked; shown in stats and errors.
_caller: str | None = None


def _refresh_hooks() -> None:
    global _hooked
    _hooked = debug.is_enabled() or debug.get_timeout() is not None or stats.is_recording()


debug._listeners.append(_refresh_hooks)
stats._listeners.append(_refresh_hooks)
_refresh_hooks()


# --------------------------------------------------------------------------- sizes


@functools.lru_cache(maxsize=4096)
def balanced_sizes(n: int, parts: int) -> tuple[int, ...]:
    """Split ``n`` items over ``parts`` ranks like ``numpy.array_split``.

    The first ``n % parts`` ranks hold one item more than the others.

    Parameters
    ----------
    n : int
        Number of items (>= 0).
    parts : int
        Number of ranks (>= 1).

    Returns
    -------
    tuple of int
        Items per rank.

    Examples
    --------
    >>> balanced_sizes(5, 3)
    (2, 2, 1)
    """
    q, r = divmod(int(n), int(parts))
    return (q + 1,) * r + (q,) * (parts - r)


def _offsets(sizes: Sequence[int]) -> tuple[int, ...]:
    out, total = [], 0
    for s in sizes:
        out.append(total)
        total += s
    return tuple(out)


def large_counts_supported(mpi_version: tuple[int, int] | None = None) -> bool:
    """Return whether counts above :data:`INT_MAX` can reach MPI.

    mpi4py 4 passes large counts through the MPI-4 ``_c`` routines, which the
    library has from MPI standard version 4.0 on.

    Parameters
    ----------
    mpi_version : tuple of int, optional
        The standard version to judge; ``MPI.Get_version()`` by default.
    """
    version = MPI.Get_version() if mpi_version is None else mpi_version
    return tuple(version) >= (4, 0)


def check_count(largest: int, operation: str,
                mpi_version: tuple[int, int] | None = None) -> None:
    """Refuse a message whose counts or displacements MPI cannot express.

    Parameters
    ----------
    largest : int
        The largest count or displacement (in elements of the MPI datatype)
        the call would pass.
    operation : str
        Name of the collective, for the message.
    mpi_version : tuple of int, optional
        The MPI standard version; the loaded library's by default.

    Raises
    ------
    ValueError
        When ``largest`` exceeds :data:`INT_MAX` and the library has no MPI-4
        large-count routines: the call would otherwise truncate the count.
    """
    if largest > INT_MAX and not large_counts_supported(mpi_version):
        version = MPI.Get_version() if mpi_version is None else mpi_version
        raise ValueError(
            f"{operation}: a count of {largest} elements exceeds {INT_MAX}, and the MPI "
            f"library (standard {version[0]}.{version[1]}) has no large-count routines; "
            f"split the array into smaller messages or use an MPI-4 library")


# --------------------------------------------------------------------------- arrays


_DTYPES: dict[np.dtype, tuple[MPI.Datatype, np.dtype | None, MPI.Datatype]] = {}


def _mpi_type(dtype: np.dtype) -> MPI.Datatype:
    """The predefined MPI datatype for ``dtype``'s wire type.

    Predefined, not a duplicate: MPICH refuses built-in reductions on
    duplicated datatypes (what ``mpi4py.util.dtlib`` returns).
    """
    try:
        return MPI.Datatype.fromcode(backend.wire_dtype(dtype).char)
    except (KeyError, ValueError):
        return backend.mpi_datatype(dtype)


def _dtype_info(dtype: np.dtype) -> tuple[MPI.Datatype, np.dtype | None, MPI.Datatype]:
    """(wire MPI type, accumulation dtype or None when it is ``dtype``, its MPI type)."""
    info = _DTYPES.get(dtype)
    if info is None:
        acc = backend.accumulation_dtype(dtype)
        info = (_mpi_type(dtype), None if acc == dtype else acc, _mpi_type(acc))
        _DTYPES[dtype] = info
    return info


def _coerce(x: Any) -> Any:
    """The array itself (NumPy or CuPy), or ``numpy.asarray`` of anything else."""
    if type(x) is np.ndarray or backend.is_cupy_array(x):
        return x
    return np.asarray(x)


def _xp(x: Any) -> Any:
    return np if type(x) is np.ndarray else backend.array_module(x)


def _cached(self: Any, key: tuple, shape: tuple[int, ...], dtype: np.dtype, xp: Any) -> Any:
    """The group's scratch array for ``key``, allocated on first use (contents undefined).

    The cache holds at most ``_MAX_BUFFERS`` arrays and ``_MAX_BUFFER_BYTES``
    bytes, evicting the oldest first.
    """
    buffers = self._buffers
    buffer = buffers.get(key)
    if buffer is None:
        nbytes = math.prod(shape) * dtype.itemsize
        while buffers and (len(buffers) >= _MAX_BUFFERS or
                           sum(b.nbytes for b in buffers.values()) + nbytes > _MAX_BUFFER_BYTES):
            del buffers[next(iter(buffers))]
        buffer = buffers[key] = xp.empty(shape, dtype)
    return buffer


def _temp(group: Any, slot: str, shape: tuple[int, ...], dtype: np.dtype, xp: Any) -> Any:
    """A cached C-contiguous scratch array shaped ``shape`` (contents undefined)."""
    return _cached(group, (slot, shape, dtype, xp is np), shape, dtype, xp)


# --------------------------------------------------------------------------- CuPy


_PINNED: dict[int, np.ndarray] = {}


def _pinned(slot: int, like: Any) -> np.ndarray:
    """A pinned host array shaped like ``like`` from a per-slot, grow-only pool."""
    nbytes = like.nbytes
    pool = _PINNED.get(slot)
    if pool is None or pool.nbytes < nbytes:
        import cupyx  # only reached with CuPy arrays
        # Grow at least 2x: a few allocations even when message sizes creep up.
        size = max(nbytes, 2 * pool.nbytes if pool is not None else 1)
        _PINNED[slot] = pool = cupyx.empty_pinned((size,), np.uint8)
    return pool[:nbytes].view(like.dtype).reshape(like.shape)


def _to_wire(send: Any, recv: Any) -> tuple[Any, Any]:
    """Device buffers as MPI should see them: themselves, or pinned host copies.

    ``send`` may be ``MPI.IN_PLACE``, in which case ``recv`` holds the input.
    """
    backend.synchronize(recv)  # kernels writing either buffer ran on this stream
    if backend.cuda_aware():
        return send, recv
    host_recv = _pinned(1, recv)
    if send is MPI.IN_PLACE:
        recv.get(out=host_recv)
        host_send = send
    else:
        host_send = _pinned(0, send)
        send.get(out=host_send)
    backend.synchronize(recv)
    return host_send, host_recv


def _from_wire(recv: Any, wire_recv: Any) -> None:
    if wire_recv is not recv:
        recv.set(wire_recv)
        # The pinned buffer is reused by the next call: the copy must be done.
        backend.synchronize(recv)


# --------------------------------------------------------------------------- hooks


def _agree_extents(group: Any, x: Any, axis: int, timeout: float | None,
                   what: str) -> tuple[int, ...]:
    """Every rank's extent along ``axis``, from one small Allgather.

    The same message carries a fingerprint of the other dimensions and the
    dtype, so ranks that disagree on them fail here (on every rank) instead of
    exchanging mismatched counts.
    """
    others = x.shape[:axis] + x.shape[axis + 1:]
    # Hashes of ints are the same in every process (those of str are salted).
    mine = np.array([x.shape[axis], hash((others, x.dtype.num, x.dtype.itemsize)) & (2**62 - 1)],
                    np.int64)
    table = np.empty((group.size, 2), np.int64)
    if timeout is None:
        group.comm.Allgather([mine, MPI.INT64_T], [table, MPI.INT64_T])
    else:
        start = time.monotonic()
        debug.wait(group.comm.Iallgather([mine, MPI.INT64_T], [table, MPI.INT64_T]),
                   f"{what} (agreeing sizes)", group, timeout, start)
    differ = [r for r in range(group.size) if table[r, 1] != table[0, 1]]
    if differ:
        raise ValueError(f"{what} on group {group.name!r}: ranks {differ} disagree with rank 0 "
                         f"on the dtype or on the dimensions other than axis {axis} (this rank: "
                         f"shape {tuple(x.shape)}, {x.dtype}); PYMPAR_DEBUG=1 shows every rank's")
    return tuple(table[:, 0].tolist())


def _describe(operation: str, x: Any, **details: Any) -> str:
    extra = "".join(f", {k}={v!r}" for k, v in details.items())
    caller = f" in {_caller}" if _caller else ""
    return f"{operation}(shape={tuple(x.shape)}, dtype={x.dtype}{extra}){caller}"


def _hooked_call(self: Any, operation: str, body: Callable[..., Any], x: Any, out: Any,
                 args: tuple, signature: Callable[[Any], tuple]) -> Any:
    """Run a collective with debug checks, timeout and statistics as switched on."""
    x = _coerce(x)
    timeout = debug.get_timeout()
    if debug.is_enabled() and self.size > 1:
        key, shown = signature(x)
        debug.check(self, key, shown, timeout)
        if out is not None and out is not x and type(out) is type(x) \
                and _xp(x).may_share_memory(out, x):
            raise ValueError(f"{operation} on group {self.name!r}: out overlaps the input "
                             f"without being the input itself")
    if not stats.is_recording():
        return body(self, x, *args, timeout)
    start = time.perf_counter()
    y = body(self, x, *args, timeout)
    stats.add(self.name, _caller or operation, x.nbytes, y.nbytes, time.perf_counter() - start)
    return y


def _wait(self: Any, request: MPI.Request, operation: str, timeout: float, start: float) -> None:
    debug.wait(request, operation, self, timeout, start)


# --------------------------------------------------------------------------- plans


class _Blocks:
    """An axis of a C-ordered shape cut into one block per rank.

    Seen as ``(lead, n, post)``, block ``q`` covers ``[:, offsets[q]:offsets[q] +
    sizes[q], :]``; rank-major, it is ``counts[q]`` elements at ``displs[q]``.
    """

    __slots__ = ("lead", "n", "post", "sizes", "offsets", "counts", "displs", "total", "even",
                 "contiguous", "by_axis", "by_rank", "scratch_shape")

    def __init__(self, shape: tuple[int, ...], axis: int, sizes: tuple[int, ...]) -> None:
        self.lead = math.prod(shape[:axis])
        self.post = math.prod(shape[axis + 1:])
        self.n = sum(sizes)
        self.sizes = sizes
        self.offsets = _offsets(sizes)
        self.counts = tuple(self.lead * s * self.post for s in sizes)
        self.displs = _offsets(self.counts)
        self.total = sum(self.counts)
        self.even = len(set(sizes)) == 1
        # Blocks already lie rank-major in memory: MPI can use the array directly.
        self.contiguous = self.lead == 1
        # Even blocks as 4-D views: the array (lead, rank, s, post) and the
        # rank-major buffer (rank, lead, s, post); one transposed copy apart.
        p, s = len(sizes), sizes[0]
        self.by_axis = (self.lead, p, s, self.post)
        self.by_rank = (p, self.lead, s, self.post)
        # Rank-major scratch is allocated in the shape its copy uses.
        self.scratch_shape = self.by_rank if self.even else (self.total,)


def _pack(flat: Any, x: Any, b: _Blocks) -> None:
    """Copy ``x``'s blocks rank-major into the scratch ``flat`` (any layout; casts)."""
    if b.even:
        # One strided copy into the (rank, lead, s, post) scratch (a reshape of a
        # non-contiguous x copies first).
        flat[...] = x.reshape(b.by_axis).transpose(1, 0, 2, 3)
        return
    x3 = x.reshape(b.lead, b.n, b.post)
    for q in range(len(b.sizes)):
        o, s, d = b.offsets[q], b.sizes[q], b.displs[q]
        flat[d:d + b.counts[q]].reshape(b.lead, s, b.post)[...] = x3[:, o:o + s]


def _unpack(dest: Any, flat: Any, b: _Blocks) -> None:
    """Copy the rank-major blocks of the scratch ``flat`` into the C-contiguous ``dest``."""
    if b.even:
        dest.reshape(b.by_axis)[...] = flat.transpose(1, 0, 2, 3)
        return
    d3 = dest.reshape(b.lead, b.n, b.post)
    for q in range(len(b.sizes)):
        o, s, d = b.offsets[q], b.sizes[q], b.displs[q]
        d3[:, o:o + s] = flat[d:d + b.counts[q]].reshape(b.lead, s, b.post)


class _Plan:
    """What a collective needs that depends only on metadata, computed once per key."""

    __slots__ = ("out_shape", "mpi_type", "send", "recv", "op", "fast", "send_key", "recv_key")

    def __init__(self, out_shape: tuple[int, ...], mpi_type: MPI.Datatype, dtype: np.dtype,
                 send: _Blocks | None, recv: _Blocks | None) -> None:
        self.out_shape = out_shape
        self.mpi_type = mpi_type
        self.send = send    # how the input splits into rank blocks, if it does
        self.recv = recv    # how the result joins rank blocks, if it does
        self.op: MPI.Op | None = None  # reductions only
        self.fast = False   # whether the plain (non-v) or inline NumPy path applies
        # Keys of the NumPy scratch buffers (see _scratch), built once.
        self.send_key = send and ("send", send.scratch_shape, dtype, True)
        self.recv_key = recv and ("recv", recv.scratch_shape, dtype, True)


def _remember(self: Any, keys: tuple, plan: _Plan) -> _Plan:
    if len(self._plans) >= _MAX_PLANS:
        self._plans.clear()
    for key in keys:
        self._plans[key] = plan
    return plan


def _normalize_axis(axis: int, ndim: int, what: str) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what}: axis {axis} is out of range for an array of {ndim} "
                         f"dimension{'s' if ndim != 1 else ''}")
    return axis + ndim if axis < 0 else axis


def _resolve_sizes(self: Any, sizes: Any, x: Any, axis: int, timeout: float | None,
                   what: str) -> tuple[int, ...]:
    extent = x.shape[axis]
    if sizes is None:
        return (extent,) if self.size == 1 else _agree_extents(self, x, axis, timeout, what)
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) != self.size or sizes[self.rank] != extent:
        raise ValueError(f"{what} on group {self.name!r}: sizes {sizes} do not fit "
                         f"{self.size} ranks with this rank ({self.rank}) holding {extent}")
    return sizes


def _bad_out(out: Any, x: Any, shape: tuple[int, ...], what: str) -> None:
    if type(out) is not type(x):
        raise TypeError(f"{what}: out is a {type(out).__module__}.{type(out).__name__}, "
                        f"the input a {type(x).__module__}.{type(x).__name__}")
    raise ValueError(f"{what}: out has shape {out.shape} and dtype {out.dtype}, "
                     f"expected {shape} and {x.dtype}")


def _solo(x: Any, out: Any) -> Any:
    """A group of one rank: the result is the input."""
    if out is None:
        return x.copy()
    out[...] = x
    return out


def _output(self: Any, out: Any, x: Any, shape: tuple[int, ...], what: str) -> Any:
    """Checked ``out``, or a new array, as the C-contiguous array to write."""
    if out is None:
        return (np.empty if type(x) is _ndarray else _xp(x).empty)(shape, x.dtype)
    if type(out) is not type(x) or out.shape != shape or out.dtype != x.dtype:
        _bad_out(out, x, shape, what)
    if out.flags.c_contiguous:
        return out
    return _temp(self, "dest", shape, x.dtype, _xp(x))


def _scratch(self: Any, slot: str, dtype: np.dtype, b: _Blocks, like: Any) -> Any:
    """The group's cached rank-major scratch for blocks ``b`` (module of ``like``)."""
    numpy = type(like) is _ndarray
    return _cached(self, (slot, b.scratch_shape, dtype, numpy), b.scratch_shape, dtype,
                   np if numpy else _xp(like))


def _done(out: Any, dest: Any) -> Any:
    if out is None or dest is out:
        return dest
    out[...] = dest  # a non-contiguous out, written once at the end
    return out


_ndarray = np.ndarray
_IN_PLACE = MPI.IN_PLACE
# (dtype, op) -> (MPI datatype, MPI op) for dtypes reduced in their own precision.
_FAST_REDUCE: dict[tuple[np.dtype, str], tuple[MPI.Datatype, MPI.Op]] = {}


# --------------------------------------------------------------------------- all_reduce


def all_reduce(self: Any, x: Any, op: str = "sum", out: Any = None) -> Any:
    """Reduce ``x`` element-wise over the group; every rank gets the result.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        Same shape and dtype on every rank; any memory layout.
    op : {"sum", "max", "min"}
        The reduction. float16 and bfloat16 are reduced in float32 and rounded
        once at the end.
    out : array, optional
        Where to write the result (same module, shape and dtype as ``x``). It
        may be ``x`` itself (in place); otherwise it must not overlap ``x``.

    Returns
    -------
    array
        ``out``, or a new C-contiguous array of ``x``'s module and dtype.

    Raises
    ------
    ValueError
        For an unknown ``op``, a wrong ``out``, or a count MPI cannot express.
    """
    if _hooked:
        return _hooked_call(self, "all_reduce", _all_reduce, x, out, (op, out), lambda a: (
            ("all_reduce", a.shape, str(a.dtype), op), _describe("all_reduce", a, op=op)))
    if type(x) is _ndarray:
        fast = _FAST_REDUCE.get((x.dtype, op))
        # The common case in a few attribute checks: C-contiguous NumPy data
        # reduced in its own dtype into a fresh array, out, or in place.
        if fast is not None and x.flags.c_contiguous and x.size <= INT_MAX and self.size > 1:
            if out is None:
                out = np.empty(x.shape, x.dtype)
            elif out is x:
                self.comm.Allreduce(_IN_PLACE, [x, fast[0]], fast[1])
                return x
            elif not (type(out) is _ndarray and out.shape == x.shape and out.dtype == x.dtype
                      and out.flags.c_contiguous):
                return _all_reduce(self, x, op, out, None)
            self.comm.Allreduce([x, fast[0]], [out, fast[0]], fast[1])
            return out
    return _all_reduce(self, x, op, out, None)


def _all_reduce(self: Any, x: Any, op: str, out: Any, timeout: float | None) -> Any:
    mpi_op = _OPS.get(op)
    if mpi_op is None:
        raise ValueError(f"all_reduce: op must be one of {sorted(_OPS)}, not {op!r}")
    x = _coerce(x)
    dtype = x.dtype
    mpi_type, acc, acc_type = _DTYPES.get(dtype) or _dtype_info(dtype)
    dest = _output(self, out, x, x.shape, "all_reduce")
    if self.size == 1:
        return _solo(x, out)
    if x.size > INT_MAX:
        check_count(x.size, "all_reduce")
    xp = _xp(x)
    if acc is None:
        _FAST_REDUCE[(dtype, op)] = (mpi_type, mpi_op)
        recv, wire_type = dest, mpi_type
        if dest is x:
            send = _IN_PLACE
        elif x.flags.c_contiguous:
            send = x
        else:
            send = _temp(self, "send", x.shape, dtype, xp)
            send[...] = x  # C order, never memory order
    else:
        # Half precision: reduce in float32, round once.
        recv, wire_type, send = _temp(self, "acc", x.shape, acc, xp), acc_type, _IN_PLACE
        recv[...] = x
    wsend, wrecv = (send, recv) if xp is np else _to_wire(send, recv)
    args = (wsend if wsend is _IN_PLACE else [wsend, wire_type], [wrecv, wire_type], mpi_op)
    if timeout is None:
        self.comm.Allreduce(*args)
    else:
        _wait(self, self.comm.Iallreduce(*args), "all_reduce", timeout, time.monotonic())
    if xp is not np:
        _from_wire(recv, wrecv)
    if acc is not None:
        if out is None:
            return recv.astype(dtype)
        dest[...] = recv
    return _done(out, dest)


# --------------------------------------------------------------------------- all_gather


def all_gather(self: Any, x: Any, axis: int = 0, out: Any = None,
               sizes: Sequence[int] | None = None) -> Any:
    """Concatenate every rank's ``x`` along ``axis``, in rank order, on every rank.

    The result equals ``numpy.concatenate([x_0, ..., x_{p-1}], axis)``.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        This rank's block; all dimensions but ``axis`` must agree across ranks
        (checked in debug mode), the extent along ``axis`` may differ.
    axis : int, default 0
        The axis to concatenate along.
    out : array, optional
        Where to write the result; must not overlap ``x``.
    sizes : sequence of int, optional
        Every rank's extent along ``axis``, in rank order, when the caller knows
        them (e.g. ``balanced_sizes(n, group.size)``). Without it the ranks
        agree on them with one extra small Allgather.

    Returns
    -------
    array
        ``out``, or a new C-contiguous array of ``x``'s module and dtype.

    Raises
    ------
    ValueError
        For a bad ``axis``, ``sizes`` inconsistent with ``x``, a wrong ``out``,
        or a count MPI cannot express.
    """
    if _hooked:
        return _hooked_call(self, "all_gather", _all_gather, x, out, (axis, out, sizes),
                            lambda a: _gather_signature(a, axis, sizes))
    if type(x) is _ndarray and type(sizes) is tuple:
        plan = self._plans.get(("all_gather", x.shape, x.dtype, axis, sizes))
        if plan is not None:
            b = plan.recv
            # Inline common case: C-contiguous NumPy blocks that MPI writes
            # straight into a fresh array or a C-contiguous out.
            if b.contiguous and x.flags.c_contiguous:
                if out is None:
                    out = np.empty(plan.out_shape, x.dtype)
                elif not (type(out) is _ndarray and out.shape == plan.out_shape
                          and out.dtype == x.dtype and out.flags.c_contiguous):
                    return _run_gather(self, plan, x, out, None)
                t = plan.mpi_type
                if b.even:
                    self.comm.Allgather([x, t], [out, t])
                else:
                    self.comm.Allgatherv([x, t], [out, (b.counts, b.displs), t])
                return out
            return _run_gather(self, plan, x, out, None)
    return _all_gather(self, x, axis, out, sizes, None)


def _gather_signature(x: Any, axis: int, sizes: Sequence[int] | None) -> tuple:
    axis = _normalize_axis(axis, x.ndim, "all_gather") if x.ndim else axis
    masked = tuple("*" if i == axis else n for i, n in enumerate(x.shape))
    known = None if sizes is None else tuple(int(s) for s in sizes)
    return (("all_gather", masked, str(x.dtype), axis, known),
            _describe("all_gather", x, axis=axis, sizes=known))


def _all_gather(self: Any, x: Any, axis: int, out: Any, sizes: Any,
                timeout: float | None) -> Any:
    x = _coerce(x)
    if not x.ndim:
        raise ValueError("all_gather needs an array of at least one dimension")
    shape, dtype = x.shape, x.dtype
    ax = _normalize_axis(axis, x.ndim, "all_gather")
    sizes = _resolve_sizes(self, sizes, x, ax, timeout, "all_gather")
    plan = self._plans.get(("all_gather", shape, dtype, ax, sizes))
    if plan is None:
        out_shape = shape[:ax] + (sum(sizes),) + shape[ax + 1:]
        recv = _Blocks(out_shape, ax, sizes)
        check_count(recv.total, "all_gather")
        plan = _Plan(out_shape, (_DTYPES.get(dtype) or _dtype_info(dtype))[0], dtype, None, recv)
        # Also under the caller's spelling of the axis, for the fast lookup.
        _remember(self, {("all_gather", shape, dtype, a, sizes) for a in (ax, axis)}, plan)
    return _run_gather(self, plan, x, out, timeout)


def _run_gather(self: Any, plan: _Plan, x: Any, out: Any, timeout: float | None) -> Any:
    numpy = type(x) is _ndarray
    if numpy and type(out) is _ndarray and out.shape == plan.out_shape \
            and out.dtype == x.dtype and out.flags.c_contiguous:
        dest = out
    else:
        dest = _output(self, out, x, plan.out_shape, "all_gather")
        if self.size == 1:
            return _solo(x, out)
    b, t = plan.recv, plan.mpi_type
    if x.flags.c_contiguous:
        send = x
    else:
        send = _temp(self, "send", x.shape, x.dtype, np if numpy else _xp(x))
        send[...] = x
    if b.contiguous:
        recv = dest
    else:
        recv = self._buffers.get(plan.recv_key) if numpy else None
        if recv is None:
            recv = _scratch(self, "recv", x.dtype, b, x)
    wsend, wrecv = (send, recv) if numpy else _to_wire(send, recv)
    if b.even:
        args: tuple = ([wsend, t], [wrecv, t])
        if timeout is None:
            self.comm.Allgather(*args)
        else:
            _wait(self, self.comm.Iallgather(*args), "all_gather", timeout, time.monotonic())
    else:
        args = ([wsend, t], [wrecv, (b.counts, b.displs), t])
        if timeout is None:
            self.comm.Allgatherv(*args)
        else:
            _wait(self, self.comm.Iallgatherv(*args), "all_gather", timeout, time.monotonic())
    if not numpy:
        _from_wire(recv, wrecv)
    if b.contiguous:
        pass
    elif b.even:
        dest.reshape(b.by_axis)[...] = recv.transpose(1, 0, 2, 3)
    else:
        _unpack(dest, recv, b)
    return dest if out is None or dest is out else _done(out, dest)


# --------------------------------------------------------------------------- reduce_scatter


def reduce_scatter(self: Any, x: Any, axis: int = 0, out: Any = None, op: str = "sum") -> Any:
    """Reduce ``x`` over the group and give each rank its block along ``axis``.

    ``axis`` is split with the balanced rule of ``numpy.array_split``: rank
    ``r`` receives block ``r`` of the element-wise reduction.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        Same shape and dtype on every rank; any memory layout.
    axis : int, default 0
        The axis to split.
    out : array, optional
        Where to write this rank's block; must not overlap ``x``.
    op : {"sum", "max", "min"}
        The reduction; float16 and bfloat16 reduce in float32.

    Returns
    -------
    array
        ``out``, or a new C-contiguous array of ``x``'s module and dtype.
    """
    if _hooked:
        return _hooked_call(self, "reduce_scatter", _reduce_scatter, x, out, (axis, out, op),
                            lambda a: (("reduce_scatter", a.shape, str(a.dtype), axis, op),
                                       _describe("reduce_scatter", a, axis=axis, op=op)))
    if type(x) is _ndarray:
        plan = self._plans.get(("reduce_scatter", x.shape, x.dtype, axis, op))
        if plan is not None:
            b = plan.send
            if plan.fast and x.flags.c_contiguous:
                # Inline common case: C-contiguous NumPy blocks reduced in their
                # own dtype straight into a fresh array or a C-contiguous out.
                if out is None:
                    out = np.empty(plan.out_shape, x.dtype)
                elif not (type(out) is _ndarray and out.shape == plan.out_shape
                          and out.dtype == x.dtype and out.flags.c_contiguous):
                    return _run_reduce_scatter(self, plan, x, out, op, None)
                t = plan.mpi_type
                if b.even:
                    self.comm.Reduce_scatter_block([x, t], [out, t], plan.op)
                else:
                    self.comm.Reduce_scatter([x, t], [out, t], b.counts, plan.op)
                return out
            return _run_reduce_scatter(self, plan, x, out, op, None)
    return _reduce_scatter(self, x, axis, out, op, None)


def _reduce_scatter(self: Any, x: Any, axis: int, out: Any, op: str,
                    timeout: float | None) -> Any:
    x = _coerce(x)
    if not x.ndim:
        raise ValueError("reduce_scatter needs an array of at least one dimension")
    shape, dtype = x.shape, x.dtype
    ax = _normalize_axis(axis, x.ndim, "reduce_scatter")
    mpi_op = _OPS.get(op)
    if mpi_op is None:
        raise ValueError(f"reduce_scatter: op must be one of {sorted(_OPS)}, not {op!r}")
    plan = self._plans.get(("reduce_scatter", shape, dtype, ax, op))
    if plan is None:
        sizes = balanced_sizes(shape[ax], self.size)
        send = _Blocks(shape, ax, sizes)
        check_count(send.total, "reduce_scatter")
        out_shape = shape[:ax] + (sizes[self.rank],) + shape[ax + 1:]
        mpi_type, acc, acc_type = _DTYPES.get(dtype) or _dtype_info(dtype)
        plan = _Plan(out_shape, mpi_type if acc is None else acc_type, dtype, send, None)
        plan.op = mpi_op
        plan.fast = acc is None and send.contiguous and self.size > 1
        _remember(self, {("reduce_scatter", shape, dtype, a, op) for a in (ax, axis)}, plan)
    return _run_reduce_scatter(self, plan, x, out, op, timeout)


def _run_reduce_scatter(self: Any, plan: _Plan, x: Any, out: Any, op: str,
                        timeout: float | None) -> Any:
    mpi_op = plan.op
    dest = _output(self, out, x, plan.out_shape, "reduce_scatter")
    if self.size == 1:
        return _solo(x, out)
    numpy = type(x) is _ndarray
    xp = np if numpy else _xp(x)
    b, t = plan.send, plan.mpi_type
    acc = (_DTYPES.get(x.dtype) or _dtype_info(x.dtype))[1]
    work = x.dtype if acc is None else acc
    if acc is None and b.contiguous and x.flags.c_contiguous:
        send = x
    elif b.contiguous:
        send = _temp(self, "send", x.shape, work, xp)
        send[...] = x  # C order, and float32 for half precision
    else:
        send = _scratch(self, "send", work, b, x)  # work: float32 for half precision
        _pack(send, x, b)
    recv = dest if acc is None else _temp(self, "acc", plan.out_shape, acc, xp)
    wsend, wrecv = (send, recv) if numpy else _to_wire(send, recv)
    if b.even:
        args: tuple = ([wsend, t], [wrecv, t], mpi_op)
        if timeout is None:
            self.comm.Reduce_scatter_block(*args)
        else:
            _wait(self, self.comm.Ireduce_scatter_block(*args), "reduce_scatter", timeout,
                  time.monotonic())
    else:
        args = ([wsend, t], [wrecv, t], b.counts, mpi_op)
        if timeout is None:
            self.comm.Reduce_scatter(*args)
        else:
            _wait(self, self.comm.Ireduce_scatter(*args), "reduce_scatter", timeout,
                  time.monotonic())
    if not numpy:
        _from_wire(recv, wrecv)
    if acc is not None:
        dest[...] = recv
    return _done(out, dest)


# --------------------------------------------------------------------------- all_to_all


def all_to_all(self: Any, x: Any, split_axis: int, concat_axis: int, out: Any = None,
               sizes: Sequence[int] | None = None) -> Any:
    """Split ``x`` along ``split_axis``, send block ``q`` to rank ``q``, concatenate along ``concat_axis``.

    ``split_axis`` is split with the balanced rule. Rank ``r`` receives block
    ``r`` of every rank's ``x`` and concatenates them in rank order along
    ``concat_axis``: the result equals ``numpy.concatenate([array_split(x_q,
    p, split_axis)[r] for q in range(p)], concat_axis)``.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        All dimensions but ``concat_axis`` must agree across ranks.
    split_axis, concat_axis : int
        Different axes.
    out : array, optional
        Where to write the result; must not overlap ``x``.
    sizes : sequence of int, optional
        Every rank's extent along ``concat_axis`` when the caller knows them;
        otherwise one extra small Allgather agrees on them.

    Returns
    -------
    array
        ``out``, or a new C-contiguous array of ``x``'s module and dtype.
    """
    if _hooked:
        return _hooked_call(self, "all_to_all", _all_to_all, x, out,
                            (split_axis, concat_axis, out, sizes),
                            lambda a: _a2a_signature(a, split_axis, concat_axis, sizes))
    if type(x) is _ndarray and type(sizes) is tuple:
        plan = self._plans.get(("all_to_all", x.shape, x.dtype, split_axis, concat_axis, sizes))
        if plan is not None:
            return _run_all_to_all(self, plan, x, out, None)
    return _all_to_all(self, x, split_axis, concat_axis, out, sizes, None)


def _a2a_signature(x: Any, split_axis: int, concat_axis: int, sizes: Any) -> tuple:
    concat = concat_axis + x.ndim if concat_axis < 0 else concat_axis
    split = split_axis + x.ndim if split_axis < 0 else split_axis
    masked = tuple("*" if i == concat else n for i, n in enumerate(x.shape))
    known = None if sizes is None else tuple(int(s) for s in sizes)
    return (("all_to_all", masked, str(x.dtype), split, concat, known),
            _describe("all_to_all", x, split_axis=split, concat_axis=concat, sizes=known))


def _all_to_all(self: Any, x: Any, split_axis: int, concat_axis: int, out: Any, sizes: Any,
                timeout: float | None) -> Any:
    x = _coerce(x)
    if not x.ndim:
        raise ValueError("all_to_all needs an array of at least one dimension")
    split = _normalize_axis(split_axis, x.ndim, "all_to_all")
    concat = _normalize_axis(concat_axis, x.ndim, "all_to_all")
    if split == concat:
        raise ValueError(f"all_to_all: split_axis and concat_axis must differ, both are {split}")
    shape, dtype = x.shape, x.dtype
    sizes = _resolve_sizes(self, sizes, x, concat, timeout, "all_to_all")
    plan = self._plans.get(("all_to_all", shape, dtype, split, concat, sizes))
    if plan is None:
        split_sizes = balanced_sizes(shape[split], self.size)
        out_shape = list(shape)
        out_shape[split] = split_sizes[self.rank]
        out_shape[concat] = sum(sizes)
        send = _Blocks(shape, split, split_sizes)
        recv = _Blocks(tuple(out_shape), concat, sizes)
        check_count(max(send.total, recv.total), "all_to_all")
        plan = _Plan(tuple(out_shape), (_DTYPES.get(dtype) or _dtype_info(dtype))[0], dtype,
                     send, recv)
        plan.fast = send.even and recv.even and send.counts[0] == recv.counts[0]  # Alltoall
        _remember(self, {("all_to_all", shape, dtype, a, c, sizes)
                         for a in (split, split_axis) for c in (concat, concat_axis)}, plan)
    return _run_all_to_all(self, plan, x, out, timeout)


def _run_all_to_all(self: Any, plan: _Plan, x: Any, out: Any, timeout: float | None) -> Any:
    numpy = type(x) is _ndarray
    if numpy and type(out) is _ndarray and out.shape == plan.out_shape \
            and out.dtype == x.dtype and out.flags.c_contiguous:
        dest = out
    else:
        dest = _output(self, out, x, plan.out_shape, "all_to_all")
        if self.size == 1:
            return _solo(x, out)
    sb, rb, t = plan.send, plan.recv, plan.mpi_type
    if sb.contiguous and x.flags.c_contiguous:
        send = x
    else:
        send = self._buffers.get(plan.send_key) if numpy else None
        if send is None:
            send = _scratch(self, "send", x.dtype, sb, x)
        if sb.even:
            send[...] = x.reshape(sb.by_axis).transpose(1, 0, 2, 3)
        else:
            _pack(send, x, sb)
    if rb.contiguous:
        recv = dest
    else:
        recv = self._buffers.get(plan.recv_key) if numpy else None
        if recv is None:
            recv = _scratch(self, "recv", x.dtype, rb, x)
    wsend, wrecv = (send, recv) if numpy else _to_wire(send, recv)
    if plan.fast:
        args: tuple = ([wsend, t], [wrecv, t])
        if timeout is None:
            self.comm.Alltoall(*args)
        else:
            _wait(self, self.comm.Ialltoall(*args), "all_to_all", timeout, time.monotonic())
    else:
        args = ([wsend, (sb.counts, sb.displs), t], [wrecv, (rb.counts, rb.displs), t])
        if timeout is None:
            self.comm.Alltoallv(*args)
        else:
            _wait(self, self.comm.Ialltoallv(*args), "all_to_all", timeout, time.monotonic())
    if not numpy:
        _from_wire(recv, wrecv)
    if rb.contiguous:
        pass
    elif rb.even:
        dest.reshape(rb.by_axis)[...] = recv.transpose(1, 0, 2, 3)
    else:
        _unpack(dest, recv, rb)
    return dest if out is None or dest is out else _done(out, dest)


# --------------------------------------------------------------------------- broadcast


def broadcast(self: Any, x: Any, root: int = 0, out: Any = None) -> Any:
    """Return the root's ``x`` on every rank.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        On the root, the data; on the other ranks an array of the same shape
        and dtype whose values are ignored.
    root : int, default 0
        The sending rank's position in the group.
    out : array, optional
        Where to write the result; may be ``x`` (in place).

    Returns
    -------
    array
        ``out``, or a new C-contiguous array of ``x``'s module and dtype.
    """
    if _hooked:
        return _hooked_call(self, "broadcast", _broadcast, x, out, (root, out), lambda a: (
            ("broadcast", a.shape, str(a.dtype), root), _describe("broadcast", a, root=root)))
    return _broadcast(self, x, root, out, None)


def _broadcast(self: Any, x: Any, root: int, out: Any, timeout: float | None) -> Any:
    x = _coerce(x)
    if not 0 <= root < self.size:
        raise ValueError(f"broadcast: root {root} is not a rank of group {self.name!r} "
                         f"of size {self.size}")
    dest = _output(self, out, x, x.shape, "broadcast")
    if self.size == 1:
        return _solo(x, out)
    if x.size > INT_MAX:
        check_count(x.size, "broadcast")
    numpy = type(x) is _ndarray
    t = (_DTYPES.get(x.dtype) or _dtype_info(x.dtype))[0]
    if self.rank == root and dest is not x:
        dest[...] = x
    wire = dest if numpy else _to_wire(_IN_PLACE, dest)[1]
    if timeout is None:
        self.comm.Bcast([wire, t], root)
    else:
        _wait(self, self.comm.Ibcast([wire, t], root), "broadcast", timeout, time.monotonic())
    if not numpy:
        _from_wire(dest, wire)
    return _done(out, dest)
