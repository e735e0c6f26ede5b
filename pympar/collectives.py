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
* Code: this module holds the public functions with their inline NumPy fast
  paths and the hook plumbing; the private modules ``pympar._wire`` (sizes,
  counts, MPI datatypes, CuPy staging), ``pympar._plans`` (plans, scratch
  buffers, ``out=`` checks) and ``pympar._general`` (the general path of every
  operation) hold the rest.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np

from . import _wire, debug, stats
from ._general import (_all_gather, _all_reduce, _all_to_all, _broadcast, _reduce_scatter,
                       _run_all_to_all, _run_gather, _run_reduce_scatter)
from ._plans import _normalize_axis
from ._wire import (_IN_PLACE, _coerce, _ndarray, _xp, balanced_sizes, block_slice, check_count,
                    large_counts_supported)

__all__ = [
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "balanced_sizes",
    "block_slice",
    "check_count",
    "large_counts_supported",
    "INT_MAX",
]


#: The largest count or displacement an MPI-3 (``int``) interface can take.
INT_MAX = _wire.INT_MAX

# The same dict as _wire's (never rebound), bound by assignment: CPython compiles
# ``name.get(...)`` on a name bound by an import statement without its
# method-call fast path (LOAD_METHOD), which all_reduce's fast path relies on.
_FAST_REDUCE = _wire._FAST_REDUCE


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


# --------------------------------------------------------------------------- hooks


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
        # Facts only this rank can see go into the compared key, so that a rank
        # about to raise makes every rank raise instead of leaving them waiting.
        overlap = (out is not None and out is not x and type(out) is type(x)
                   and bool(_xp(x).may_share_memory(out, x)))
        debug.check(self, (key, overlap), f"{shown}, out overlaps input: {overlap}", timeout)
        if overlap:
            raise ValueError(f"{operation} on group {self.name!r}: out overlaps the input "
                             f"without being the input itself")
    if not stats.is_recording():
        return body(self, x, *args, timeout)
    start = time.perf_counter()
    y = body(self, x, *args, timeout)
    stats.add(self.name, _caller or operation, x.nbytes, y.nbytes, time.perf_counter() - start)
    return y


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
                            lambda a: _gather_signature(self, a, axis, sizes))
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


def _fits(group: Any, x: Any, axis: int, known: tuple[int, ...] | None) -> bool:
    """Whether ``sizes`` given by the caller match this rank's extent (debug mode)."""
    return known is None or (len(known) == group.size and 0 <= axis < x.ndim
                             and known[group.rank] == x.shape[axis])


def _gather_signature(group: Any, x: Any, axis: int, sizes: Sequence[int] | None) -> tuple:
    axis = _normalize_axis(axis, x.ndim, "all_gather") if x.ndim else axis
    masked = tuple("*" if i == axis else n for i, n in enumerate(x.shape))
    known = None if sizes is None else tuple(int(s) for s in sizes)
    fits = _fits(group, x, axis, known)
    return (("all_gather", masked, str(x.dtype), axis, known, fits),
            _describe("all_gather", x, axis=axis, sizes=known, sizes_fit=fits))


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
                            lambda a: _a2a_signature(self, a, split_axis, concat_axis, sizes))
    if type(x) is _ndarray and type(sizes) is tuple:
        plan = self._plans.get(("all_to_all", x.shape, x.dtype, split_axis, concat_axis, sizes))
        if plan is not None:
            return _run_all_to_all(self, plan, x, out, None)
    return _all_to_all(self, x, split_axis, concat_axis, out, sizes, None)


def _a2a_signature(group: Any, x: Any, split_axis: int, concat_axis: int, sizes: Any) -> tuple:
    concat = concat_axis + x.ndim if concat_axis < 0 else concat_axis
    split = split_axis + x.ndim if split_axis < 0 else split_axis
    masked = tuple("*" if i == concat else n for i, n in enumerate(x.shape))
    known = None if sizes is None else tuple(int(s) for s in sizes)
    fits = _fits(group, x, concat, known)
    return (("all_to_all", masked, str(x.dtype), split, concat, known, fits),
            _describe("all_to_all", x, split_axis=split, concat_axis=concat, sizes=known,
                      sizes_fit=fits))


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
