"""The path every collective call takes: validate, plan, check, pack, call MPI, unpack (private).

:func:`run` is the body of every function of :mod:`pympar.collectives`; a rank refusing its
own arguments (or an ``out=`` that does not fit or overlaps the input) makes the others raise.
"""

from __future__ import annotations

import operator
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from . import _agreement, backend, debug, stats
from ._agreement import refuse
from ._comm_state import Communicator
from ._plans import Plan, pack, signature, unpack
from .errors import CollectiveMismatchError

_IN_PLACE = MPI.IN_PLACE


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


def index(value: Any, what: str, name: str) -> int:
    """``value`` as an int, else ``TypeError`` naming ``what`` and the argument ``name``."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what}: {name} must be an int, not {type(value).__name__}") from None


def unfit(x: Any, out: Any, shape: tuple[int, ...], shown: str,
          dtype: np.dtype | None = None) -> Exception:
    """The error of an ``out`` that is not an array of ``x``'s kind, dtype and ``shape``."""
    return (TypeError if type(out) is not type(x) else ValueError)(
        f"{shown}: out is a {type(out).__name__} of shape {getattr(out, 'shape', '?')} and "
        f"dtype {getattr(out, 'dtype', '?')}, which does not fit: expected a "
        f"{type(x).__name__} of shape {shape} and dtype {dtype or x.dtype}"
        + (" (-1: the gathered extent)" if -1 in shape else ""))


def check_out(x: Any, out: Any, shape: tuple[int, ...], shown: str,
              dtype: np.dtype | None = None) -> None:
    """Raise for an ``out`` that is not an array of ``x``'s kind, ``dtype`` (``x``'s by
    default) and ``shape``, or that overlaps ``x`` without being it."""
    if not (type(out) is type(x) and out.shape == shape
            and out.dtype == (x.dtype if dtype is None else dtype)):
        raise unfit(x, out, shape, shown, dtype)
    # Arrays owning their memory cannot overlap; CuPy's test compares device ranges.
    if (out.base is not None or x.base is not None) and out is not x and \
            backend.array_module(x).may_share_memory(out, x):
        raise ValueError(f"{shown}: out overlaps the input without being it; "
                         f"pass a separate array")


def destination(group: Communicator, plan: Plan, x: Any, out: Any) -> Any:
    """What MPI (or the unpacking) writes for ``out``: ``out``, or scratch when it is not
    C-contiguous; raises for an ``out`` that does not fit or overlaps ``x`` (but is not it)."""
    check_out(x, out, plan.out_shape, plan.shown)
    return out if out.flags.c_contiguous else \
        group._state.scratch("dest", out.shape, x.dtype, x)


def claim(x: Any, out: Any, axis: int, shape: tuple[int, ...], shown: str) -> int:
    """What a gather of unknown extents tells the others of its ``out``: 0 without one,
    else its extent along ``axis`` plus one, after refusing an ``out`` that cannot fit
    whatever the extents are (``shape`` is the result's, with -1 along ``axis``)."""
    if out is None:
        return 0
    native = x.dtype.newbyteorder("=")  # the result's dtype, and so out's
    if (type(out) is type(x) and out.dtype == native and out.ndim == len(shape)
            and out.shape[:axis] + (-1,) + out.shape[axis + 1:] == shape):
        if out is not x and backend.array_module(x).may_share_memory(out, x):
            raise ValueError(f"{shown}: out overlaps the input; pass a separate array")
        return out.shape[axis] + 1
    raise unfit(x, out, shape, shown, native)


def run(group: Communicator, x: Any, out: Any, name: str | None, what: str,
        build: Callable[..., Plan], params: tuple, checked: bool = False) -> Any:
    """The body of the collective ``what``: its plan (``build(group, x, *params)`` once per
    key), the check (``checked``: already made), then :func:`move`."""
    try:
        if type(x) is not np.ndarray:
            x = as_array(x, name or what)
        key = (what, x.shape, x.dtype) + params
        plan = group._state.plans.get(key)
        if plan is None:
            plan = group._state.remember(key, build(group, x, *params))
        if plan.swap:
            x = x.astype(x.dtype.newbyteorder("="))
        dest = None if out is None else destination(group, plan, x, out)
    except (TypeError, ValueError) as err:
        if not checked:  # after an exchange of extents every rank raises alike
            refuse(group, what, err)
        raise
    own = name
    if _agreement._label is not None:
        name = f"{_agreement._label}/{name}" if name else _agreement._label
    if not checked and group.size > 1:
        sig = plan.signatures.get(name)
        if sig is None:
            sig = plan.signatures[name] = signature(plan.key, name)
        if not group._state.board.agree(sig, group, plan.shown, debug._timeout):
            debug.report(group, f"{plan.shown} in {name}" if name else plan.shown)
    if not stats._active:
        return move(group, plan, x, dest, out)
    start = time.perf_counter()
    y = move(group, plan, x, dest, out)
    # A layer's collectives keep their kind ("Linear3D.forward:all_gather"); a mapping's
    # own label names its call.
    kind = own or (f"{name}:{what}" if name else what)
    stats.add(group.name, kind, x.nbytes, y.nbytes, time.perf_counter() - start)
    return y


def move(group: Communicator, plan: Plan, x: Any, dest: Any, out: Any) -> Any:
    """Pack, call MPI, unpack."""
    numpy = type(x) is np.ndarray
    if dest is None:
        dest = (np.empty if numpy else backend.array_module(x).empty)(plan.out_shape, x.dtype)
    if group.size == 1:
        dest[...] = x
    else:
        sb, rb, method, state = plan.send, plan.recv, plan.method, group._state
        if method == "Bcast":
            send = None
            if group.rank == plan.tail[0] and dest is not x:
                dest[...] = x
        elif sb is not None:
            send = state.scratch("send", sb.scratch_shape, plan.work, x)
            pack(send, x, sb)
        elif dest is x and not plan.cast:
            send = _IN_PLACE  # an in-place all_reduce
        elif x.flags.c_contiguous and not plan.cast:
            send = x
        else:
            send = state.scratch("send", x.shape, plan.work, x)
            send[...] = x  # C order (never memory order), float32 for half precision
        if rb is not None:
            recv = state.scratch("recv", rb.scratch_shape, plan.work, x)
        elif plan.cast:
            recv = state.scratch("acc", plan.out_shape, plan.work, x)
        else:
            recv = dest
        wsend, wrecv = (send, recv) if numpy else backend.to_wire(send, recv)
        call = getattr(group.comm, method)
        try:  # blocking, watchdog or not: every rank passed this very call's check
            if plan.chunk is None:
                receive = [wrecv, *plan.recv_spec]
                call(receive, *plan.tail) if wsend is None else call(
                    wsend if wsend is _IN_PLACE else [wsend, *plan.send_spec], receive,
                    *plan.tail)
            else:
                _call_in_parts(group, plan, wsend, wrecv)
        except MPI.Exception as err:
            if err.Get_error_class() != MPI.ERR_TRUNCATE:
                raise
            raise CollectiveMismatchError(
                f"{plan.shown} on group {group.name!r}: MPI received more data than this "
                f"rank expects (message truncated): the ranks passed arrays of different "
                f"shapes or sizes") from err
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


def _call_in_parts(group: Communicator, plan: Plan, send: Any, recv: Any) -> None:
    """The data call, for MPI-3 and a count above INT_MAX, as a few calls on slices."""
    call, chunk, flat = getattr(group.comm, plan.method), plan.chunk, recv.reshape(-1)
    for lo in range(0, flat.size, chunk):
        receive = [flat[lo:lo + chunk], *plan.recv_spec]
        if send is None or send is _IN_PLACE:  # a broadcast, an in-place all_reduce
            call(*(() if send is None else (send,)), receive, *plan.tail)
        else:
            call([send.reshape(-1)[lo:lo + chunk], *plan.send_spec], receive, *plan.tail)
