"""The general path of each collective: any layout, dtype, array module and timeout.

Private to :mod:`pympar.collectives`, whose public functions run the common
NumPy cases inline and call these otherwise (``_all_reduce``, ``_all_gather``,
``_reduce_scatter``, ``_all_to_all``, ``_broadcast``: coerce and validate the
input, build or look up the plan), or straight with a cached plan
(``_run_gather``, ``_run_reduce_scatter``, ``_run_all_to_all``: pack, stage,
call MPI, unpack). The last parameter, ``timeout``, is ``None`` for the
blocking MPI call, or the seconds after which a non-blocking one raises
:class:`pympar.debug.CollectiveTimeoutError`.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from . import _wire, debug
from ._plans import (_Blocks, _done, _normalize_axis, _output, _pack, _Plan, _remember,
                     _resolve_sizes, _scratch, _solo, _temp, _unpack)
from ._wire import (_IN_PLACE, INT_MAX, _coerce, _dtype_info, _from_wire, _ndarray, _to_wire,
                    _xp, balanced_sizes, check_count)

# The shared tables of _wire (the same objects, never rebound), bound by
# assignment: CPython compiles ``name.get(...)`` on a name bound by an import
# statement without its method-call fast path (LOAD_METHOD).
_DTYPES, _FAST_REDUCE, _OPS = _wire._DTYPES, _wire._FAST_REDUCE, _wire._OPS


def _call(self: Any, blocking: Callable[..., Any], nonblocking: Callable[..., MPI.Request],
          args: tuple, operation: str, timeout: float | None) -> None:
    """Run the blocking MPI call, or with a timeout its non-blocking twin polled until done."""
    if timeout is None:
        blocking(*args)
    else:
        debug.wait(nonblocking(*args), operation, self, timeout, time.monotonic())


def _receive_buffer(self: Any, plan: Any, blocks: Any, dest: Any, x: Any, numpy: bool) -> Any:
    """Where MPI writes: ``dest`` itself when blocks land in place, else a reused scratch."""
    if blocks.contiguous:
        return dest
    recv = self._buffers.get(plan.recv_key) if numpy else None
    return _scratch(self, "recv", x.dtype, blocks, x) if recv is None else recv


# --------------------------------------------------------------------------- all_reduce


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
    _call(self, self.comm.Allreduce, self.comm.Iallreduce, args, "all_reduce", timeout)
    if xp is not np:
        _from_wire(recv, wrecv)
    if acc is not None:
        if out is None:
            return recv.astype(dtype)
        dest[...] = recv
    return _done(out, dest)


# --------------------------------------------------------------------------- all_gather


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
    recv = _receive_buffer(self, plan, b, dest, x, numpy)
    wsend, wrecv = (send, recv) if numpy else _to_wire(send, recv)
    if b.even:
        args: tuple = ([wsend, t], [wrecv, t])
        _call(self, self.comm.Allgather, self.comm.Iallgather, args, "all_gather", timeout)
    else:
        args = ([wsend, t], [wrecv, (b.counts, b.displs), t])
        _call(self, self.comm.Allgatherv, self.comm.Iallgatherv, args, "all_gather", timeout)
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
        _call(self, self.comm.Reduce_scatter_block, self.comm.Ireduce_scatter_block, args,
              "reduce_scatter", timeout)
    else:
        args = ([wsend, t], [wrecv, t], b.counts, mpi_op)
        _call(self, self.comm.Reduce_scatter, self.comm.Ireduce_scatter, args,
              "reduce_scatter", timeout)
    if not numpy:
        _from_wire(recv, wrecv)
    if acc is not None:
        dest[...] = recv
    return _done(out, dest)


# --------------------------------------------------------------------------- all_to_all


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
    recv = _receive_buffer(self, plan, rb, dest, x, numpy)
    wsend, wrecv = (send, recv) if numpy else _to_wire(send, recv)
    if plan.fast:
        args: tuple = ([wsend, t], [wrecv, t])
        _call(self, self.comm.Alltoall, self.comm.Ialltoall, args, "all_to_all", timeout)
    else:
        args = ([wsend, (sb.counts, sb.displs), t], [wrecv, (rb.counts, rb.displs), t])
        _call(self, self.comm.Alltoallv, self.comm.Ialltoallv, args, "all_to_all", timeout)
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
    _call(self, self.comm.Bcast, self.comm.Ibcast, ([wire, t], root), "broadcast", timeout)
    if not numpy:
        _from_wire(dest, wire)
    return _done(out, dest)
