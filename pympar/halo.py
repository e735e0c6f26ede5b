"""Halo exchange on a Cartesian decomposition, and its exact adjoint.

A rank's *padded* block is its block of the field (:class:`~pympar.decomposition.Decomposition`)
with ``lo`` ghost cells before and ``hi`` after it along each axis. :meth:`HaloExchange.exchange`
fills the ghosts with the neighbours' cells, axis after axis: along axis ``a`` a rank sends
its ``lo`` top interior cells up and its ``hi`` bottom interior cells down (one
``Sendrecv`` each way), over the whole padded extent of the axes already exchanged and the
interior of the others. The ghosts of earlier axes travel along later ones, so edges and
corners are filled too, as stencils and convolutions need. Along a periodic axis the field
wraps around (a rank alone on it copies its own opposite face); where a non-periodic field
ends, the ghosts are left as they are (:meth:`HaloExchange.forward` sets them to zero).

As a linear map, ``forward`` takes each rank's block to its padded block: zero padding,
then the exchange. :meth:`HaloExchange.backward` is its exact adjoint (the mappings'
contract, ``<H x, y> == <x, H* y>`` summed over ranks): the axes in reverse order, each
rank sends its ghosts' gradients back to where the forward took them from, and the owner
adds them to its boundary cells; the gradients of the outer (zero) ghosts are dropped.

Faces travel through persistent requests made once per plan and padded array (a reused array
starts its requests, ``Startall`` + ``Waitall`` per axis, instead of two ``Sendrecv`` that
rebuild their messages; up to four arrays used in turn keep theirs, made on the array's
memory by address and released when the array goes). A NumPy face that is one contiguous run
of the padded array travels in place as a plain buffer; any other (a split later axis,
leading axes) as an MPI subarray datatype of the padded array (``faces="subarray"``) or
packed into a reused contiguous buffer (``faces="packed"``). The default, ``faces="auto"``,
packs a face whose contiguous runs are short (under MPICH shorter than 512 B, which its
datatype engine moved up to 10x slower than a copy and a plain send; under other MPIs
shorter than 32 B) and times both ways for the others: the first 14 exchanges of a plan go
all datatypes and all packed in turn, and it keeps the faster (``pympar._halo_tuning``:
under MPICH runs of 1 KiB went 1.4x faster as datatypes in one job and 1.8x faster packed
in another, on one machine). Under MPICH a face of at most 16 KiB to or from a neighbour on
another node always goes as a datatype (its network module packs so small a message once,
into its own buffer: ``_halo_plan.OFF_NODE_DATATYPE_UP_TO``). CuPy
faces are always packed, and go to MPI as :mod:`pympar.collectives` sends device buffers:
directly when
:func:`pympar.backend.cuda_aware`, else through pinned host buffers. Along an axis a rank
holds alone (periodic, not split) its ghosts are copies of its own opposite faces, through
views planned with the requests: each region's contiguous runs as the elements of one dtype
(an unsigned int, or void), so that NumPy copies them run by run, without the temporary it
makes when two regions of one array interleave.

Every call first checks with the neighbours it exchanges with, along each exchanged axis
(:mod:`pympar._halo_check`: global shape, widths, leading shape, dtype, direction, label),
and with them only: its cost and its waiting do not grow with the group, and a late rank
holds up only its neighbours. Neighbours that call differently, or a rank whose array does
not fit, raise :class:`~pympar.debug.CollectiveMismatchError` (the refusing rank its own
error) instead of exchanging faces of another size; the ranks beyond learn of it from the
neighbours that raised, which tell those about to exchange with them, so that nobody waits
for a face (they raise :class:`~pympar.errors.PeerEndedError`, or return with every face
right when theirs came before). A repeated call (a known shape) costs one dictionary lookup
and the check of a signature hashed once per plan and label (about 1.5 us, against 5-6 us
when the key was hashed on every call); the padded array of the previous call again,
unchanged, under the same label, skips even the lookup. On the same NumPy padded array
object the exchange is then only its program (``_halo_plan.Plan.program``): per axis
``Startall`` + ``Waitall``, or the copies of its wrap, and the copies of packed faces (no
``ndarray.ctypes``, ~2 us, to learn the array's address, and nothing else in Python while
statistics are off).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
from mpi4py import MPI

from . import _agreement, _halo_check, backend, debug, stats
from ._board import REFUSED
from ._halo_check import Poison
from ._halo_plan import DOWN, FACES, UP, Axis, Plan, Receipt, widths
from ._neighbours import NeighbourBoard
from ._plans import signature
from .decomposition import Decomposition, agree_all

__all__ = ["HaloExchange"]

_startall, _waitall, _copyto = MPI.Prequest.Startall, MPI.Request.Waitall, np.copyto

def _account(ax: Axis, operation: str, start: float) -> None:
    """Record one axis's messages with the statistics recorders (a local copy sends none)."""
    if ax.comm is not None:
        sent, received = ((ax.sent, ax.received) if operation == "halo.exchange"
                          else (ax.received, ax.sent))
        stats.add(ax.group_name, operation, sent, received, time.perf_counter() - start)


def _run(plan: Plan, ops: list[tuple[Any, Any]]) -> None:
    """Run (part of) an exchange's program (:meth:`Plan.program`): start and wait for each
    axis's requests, make each copy. A face that came short is a neighbour's poison (an MPI
    error is taken as one too): complete the requests, poison the later messages, raise
    :class:`~pympar.errors.PeerEndedError`."""
    first = None
    try:
        for first, second in ops:
            if type(second) is Receipt:
                _startall(first)
                _waitall(first, second.statuses)
                if second.short():
                    raise Poison("a neighbour sent no face")
            else:
                _copyto(first, second)
    except (MPI.Exception, Poison) as err:
        _poisoned(plan, first, err)


def _poisoned(plan: Plan, requests: list[MPI.Prequest], error: Exception) -> None:
    """:func:`_run`'s error in ``requests``, the requests of one axis of the program, which
    goes (the next exchange makes another)."""
    axis = next(i for i, r in enumerate(plan.persistent) if r is requests)
    try:
        _halo_check.poisoned(plan, "exchange", 2 * axis + 2, error, requests)
    finally:
        plan.drop()


def _settled(requests: list[MPI.Request], receipt: Receipt) -> None:
    """Wait for ``requests`` (statuses into ``receipt``); raise
    :class:`~pympar._halo_check.Poison` when a receive came short (a neighbour's poison).
    On an MPI error complete every one of them before raising it (an MPI may return from
    the wait at the first error)."""
    try:
        _waitall(requests, receipt.statuses)
    except MPI.Exception:
        _halo_check.settle(requests)
        raise
    if receipt.short():
        raise Poison("a neighbour sent no face")


def _writable(a: Any) -> bool:
    """Whether a call may write ``a`` (CuPy's flags have no ``writeable``: its arrays
    always are)."""
    return getattr(a.flags, "writeable", True)


class HaloExchange:
    """Ghost cells of a decomposed field: the exchange, and its exact adjoint.

    Parameters
    ----------
    decomposition : Decomposition
        The field's split over the ranks.
    width : int or sequence
        Ghost cells per side: one int for every axis, or per axis an int or a
        ``(lo, hi)`` pair. A halo comes from the nearest neighbour only, so along an
        exchanged axis it may be at most the smallest block's extent.
    faces : {"auto", "subarray", "packed"}, default "auto"
        How NumPy faces that are not one contiguous run of the padded array reach MPI: as
        subarray datatypes of the padded array, or copied through reused contiguous
        buffers; ``"auto"``: packed where their contiguous runs are short (under 512 B with
        MPICH, 32 B with other MPIs), else the faster way of the two, timed on the first
        exchanges of each array shape (each rank decides for its own faces; the ghosts are
        right either way), and as datatypes under MPICH when they are at most 16 KiB and
        cross a node (see the module docstring).
        Contiguous faces always travel in place; CuPy faces are always packed.

    Attributes
    ----------
    decomposition : Decomposition
    widths : tuple of (int, int)
        ``(lo, hi)`` ghost cells per axis.
    padded_shape : tuple of int
        This rank's padded block (the trailing axes of the arrays exchanged).
    interior : tuple of slice
        Where the block sits in the padded block.
    exchanged : tuple of int
        The axes whose ghosts are exchanged: split or periodic, with a nonzero width.

    Raises
    ------
    ValueError
        On every rank, for a width wider than some block along an exchanged axis, or
        widths of the wrong form.
    pympar.debug.CollectiveMismatchError
        On every rank, when ranks pass different widths.

    Notes
    -----
    Creating one is collective over the decomposition's groups (one agreement check over
    each); every call of :meth:`exchange`, :meth:`adjoint`, :meth:`forward` and
    :meth:`backward` checks with the neighbours only (see the module docstring). Arrays are
    ``(*leading, *padded_shape)`` (or the block's shape for the input of ``forward`` and the
    result of ``backward``), with any leading axes (batch, channels) alike on every rank;
    padded arrays must be C-contiguous.
    """

    def __init__(self, decomposition: Decomposition, width: int | Sequence[Any] = 1,
                 faces: str = "auto") -> None:
        if not isinstance(decomposition, Decomposition):
            raise TypeError(f"HaloExchange: decomposition must be a pympar Decomposition, "
                            f"not {type(decomposition).__name__}")
        d = decomposition
        self.decomposition, self.faces = d, faces
        self._groups = d.split_groups()
        error = None if faces in FACES else ValueError(
            f"HaloExchange: faces must be 'auto', 'subarray' or 'packed', not {faces!r}")
        try:
            self.widths = widths(width, d.ndim)
        except (TypeError, ValueError) as err:
            error = error or err
        if error is not None:  # the others agree next: refuse there
            agree_all(self._groups, (), "HaloExchange", error)
        self.padded_shape = tuple(n + lo + hi for n, (lo, hi) in zip(d.local_shape, self.widths))
        self.interior = tuple(slice(lo, lo + n) for n, (lo, _) in zip(d.local_shape, self.widths))
        self.exchanged = tuple(a for a in range(d.ndim) if max(self.widths[a]) > 0
                               and (d.parts[a] > 1 or d.periodic[a]))
        error = None
        for a in self.exchanged:
            smallest = min(d.sizes[a])
            if max(self.widths[a]) > smallest:
                block = d.sizes[a].index(smallest)
                error = ValueError(
                    f"HaloExchange: a halo of {max(self.widths[a])} cells along axis {a} is "
                    f"wider than block {block}'s {smallest} cells (extent "
                    f"{d.global_shape[a]} over {d.parts[a]} ranks): ghosts come from the "
                    f"nearest neighbour only; use a narrower halo or fewer ranks along "
                    f"axis {a}")
                break
        agree_all(self._groups, ("HaloExchange", d.global_shape, self.widths, faces),
                  f"HaloExchange(global_shape={d.global_shape}, widths={self.widths})", error)
        # The calls' checks: with the neighbours along each exchanged axis split over ranks.
        self._checks = [(a, d.groups[a], NeighbourBoard(d.groups[a].comm, d.neighbours(a)))
                        for a in self.exchanged if d.groups[a] is not None
                        and d.groups[a].size > 1]
        self._one_check = self._checks[0] if len(self._checks) == 1 else None
        self._plans: dict[tuple, Plan] = {}
        # (padded array, direction, label, plan, signature) of the last fitting call.
        self._last: tuple | None = None
        # The exchange's own hot path: (padded, label, shape, dtype, signature, plan,
        # program) of the previous exchange while nothing else has run since.
        self._ready: tuple | None = None

    def __repr__(self) -> str:
        return f"HaloExchange({self.decomposition!r}, widths={self.widths})"

    # ------------------------------------------------------------------ arrays

    def empty(self, leading: Sequence[int] = (), dtype: Any = np.float64, xp: Any = np) -> Any:
        """A zero-filled padded array ``(*leading, *padded_shape)`` of ``xp`` (NumPy or CuPy)."""
        return xp.zeros((*leading, *self.padded_shape), dtype)

    def inner(self, padded: Any) -> Any:
        """The view of ``padded``'s block (its interior cells)."""
        return padded[(Ellipsis, *self.interior)]

    # ------------------------------------------------------------------ the pair

    def forward(self, x: Any, out: Any = None) -> Any:
        """Pad this rank's block with zeros and exchange: ``H x``.

        Parameters
        ----------
        x : numpy.ndarray or cupy.ndarray
            ``(*leading, *local_shape)``.
        out : array, optional
            A C-contiguous ``(*leading, *padded_shape)`` array of ``x``'s kind and dtype to
            write (reuse one across calls to spare the allocation).

        Returns
        -------
        array
            ``out`` or a new padded array; the ghosts where a non-periodic field ends are 0.
        """
        ndim = self.decomposition.ndim
        if out is None and (isinstance(x, np.ndarray) or backend.is_cupy_array(x)) \
                and x.ndim >= ndim:
            out = backend.array_module(x).empty((*x.shape[:x.ndim - ndim], *self.padded_shape),
                                                x.dtype)
        plan = self._plan(x if out is None else out, "forward", x)
        out[plan.interior] = x
        for region in plan.outer:
            out[region] = 0
        self._exchange(plan, out)
        return out

    def backward(self, dy: Any, out: Any = None) -> Any:
        """The adjoint of :meth:`forward`: the gradient of the block from that of the padding.

        Parameters
        ----------
        dy : numpy.ndarray or cupy.ndarray
            ``(*leading, *padded_shape)``; not modified.
        out : array, optional
            Where to write the result, ``(*leading, *local_shape)``.

        Returns
        -------
        array
            ``out`` or a new C-contiguous array: ``dy``'s interior plus the gradients of the
            neighbours' ghosts that came from this block.
        """
        plan = self._plan(dy, "backward", out)
        work = plan.buffers.get("work")
        if work is None:
            work = plan.buffers["work"] = plan.xp.empty(plan.shape, plan.dtype)
        work[...] = dy
        self._adjoint(plan, work)
        if out is None:
            return plan.xp.ascontiguousarray(work[plan.interior])
        out[...] = work[plan.interior]
        return out

    def exchange(self, padded: Any) -> Any:
        """Fill ``padded``'s ghosts from the neighbours, in place; return ``padded``.

        The ghosts where a non-periodic field ends are not touched (boundary values are
        the caller's).
        """
        ready = self._ready
        if ready is not None and ready[0] is padded:
            # The array of the previous exchange again, as it was (see _plan): its check,
            # then its program, and no other Python. (Each 100 ns of Python here cost about
            # 0.4 us, 1.5 %, of an exchange of small faces: 2 ranks on the 2-core VM.)
            # _agreement._label is within(None), and stats._active is_recording().
            _, name, shape, dtype, sig, plan, program = ready
            if (name == _agreement._label and not stats._active and padded.shape == shape
                    and padded.dtype is dtype):
                one = self._one_check
                if one is None or one[1]._state.board is None:
                    _halo_check.check(self._checks, sig, plan.shown, name, plan, "exchange")
                else:  # the one axis's check without check()'s frame while all agree
                    differ = one[2].agree(sig, one[1], plan.shown, debug._timeout)
                    if differ:
                        _halo_check.check(self._checks, sig, plan.shown, name, plan,
                                          "exchange", first=differ)
                try:
                    _run(plan, program)
                except BaseException:
                    self._ready = None  # its program went, or is half run
                    raise
                return padded
        plan = self._plan(padded, "exchange")
        self._exchange(plan, padded)
        if plan.direct and plan.requests_on is padded and plan.tuning is None:
            _, _, name, _, sig = self._last
            self._ready = (padded, name, plan.shape, plan.dtype, sig, plan, plan.ops)
        return padded

    def adjoint(self, padded: Any) -> Any:
        """Add the ghosts' values back into the cells they came from, in place.

        The adjoint of :meth:`exchange` followed by taking the interior: returns the view
        of ``padded``'s interior, which now holds the accumulated gradient. The ghosts are
        left with meaningless values.
        """
        plan = self._plan(padded, "adjoint")
        self._adjoint(plan, padded)
        return padded[plan.interior]

    # ------------------------------------------------------------------ internals

    def _plan(self, padded: Any, direction: str, block: Any = None) -> Plan:
        """The plan of ``padded``'s shape, after the call's agreement check.

        ``block`` is the input of :meth:`forward`. A rank whose arrays do not fit refuses
        in the check, so that its neighbours raise too.
        """
        self._ready = None  # another call may rebuild the requests that exchange reuses
        last = self._last
        name = _agreement.within(None)
        # The hottest path: the array of the previous call again, as it was, under the
        # same label and for the same direction (its plan, and the signature of its check).
        if (last is not None and last[0] is padded and last[1] == direction
                and last[2] == name and block is None):
            plan = last[3]
            if padded.shape == plan.shape and padded.dtype is plan.dtype:
                _halo_check.check(self._checks, last[4], plan.shown, name, plan, direction)
                return plan
        plan = key = None
        if type(padded) is np.ndarray or backend.is_cupy_array(padded):
            key = (padded.shape, padded.dtype, type(padded), direction)
            plan = self._plans.get(key)
        # The hot path (a known shape, C-contiguous, exchange/adjoint): one dict lookup and
        # the check of the plan's signature, hashed once per label.
        # A known shape is a fitting shape: then only the layout and the block can be wrong.
        if plan is None or block is not None or not (
                padded.flags.c_contiguous and _writable(padded)):
            error = self._refusal(padded, direction, block)
            if error is not None:
                self.refuse(direction, error)
        if plan is None:
            d = self.decomposition
            key = key or (padded.shape, padded.dtype, type(padded), direction)
            plan = self._plans[key] = Plan(self, tuple(padded.shape), padded)
            # dtype.str, byte order included: the bytes move as they are.
            plan.key = ("HaloExchange", direction, d.global_shape, self.widths,
                        plan.lead_shape, padded.dtype.str)
            plan.shown = (f"HaloExchange.{direction}(global_shape={d.global_shape}, "
                          f"widths={self.widths}, leading={plan.lead_shape}, "
                          f"dtype={padded.dtype})")
        sig = plan.signatures.get(name)
        if sig is None:
            sig = plan.signatures[name] = signature(plan.key, name)
        _halo_check.check(self._checks, sig, plan.shown, name, plan, direction)
        self._last = (padded, direction, name, plan, sig)  # it fits: else the check raised
        return plan

    def refuse(self, what: str, error: Exception) -> None:
        """Raise ``error``, this rank's refusal of its input to ``what``, in the check that
        the neighbours make next (an exchange's, or a stencil layer's before its exchange),
        so that they raise too instead of waiting; every rank raises its own error when all
        refused alike."""
        shown = what if what.startswith("HaloExchange") or "." in what else \
            f"HaloExchange.{what}"
        _halo_check.check(self._checks, REFUSED, shown, _agreement.within(None), None,
                          "exchange", error)

    def _refusal(self, padded: Any, direction: str, block: Any) -> Exception | None:
        """Why this rank cannot make the call, or None. ``block``: forward's input, or
        backward's ``out`` (block-shaped, both)."""
        d, where = self.decomposition, f"HaloExchange.{direction}"
        role = "out" if direction == "backward" else "block"
        for x, what in ((block, role), (padded, "padded array")):
            if x is not None and not (isinstance(x, np.ndarray) or backend.is_cupy_array(x)):
                return TypeError(f"{where}: the {what} must be a numpy.ndarray or "
                                 f"cupy.ndarray, not {type(x).__name__}")
        if block is not None and (block.ndim < d.ndim
                                  or tuple(block.shape[block.ndim - d.ndim:]) != d.local_shape):
            return ValueError(f"{where}: the {role} has shape {tuple(block.shape)}; expected "
                              f"(*leading, *{d.local_shape}), this rank's block of "
                              f"{d.global_shape} split {d.parts} ways")
        if direction == "backward" and block is not None and not _writable(block):
            return ValueError(f"{where}: out is read-only")
        shape = tuple(padded.shape)
        lead = shape[:max(0, len(shape) - d.ndim)]
        if shape != (*lead, *self.padded_shape) or not padded.flags.c_contiguous:
            return ValueError(
                f"{where}: the padded array has shape {shape}"
                f"{'' if padded.flags.c_contiguous else ' and is not C-contiguous'}; expected "
                f"a C-contiguous (*leading, *{self.padded_shape}): this rank's block "
                f"{d.local_shape} with widths {self.widths}")
        if direction != "backward" and not _writable(padded):
            return ValueError(f"{where}: the padded array is read-only; the call writes it")
        if block is not None and (type(block) is not type(padded) or block.dtype != padded.dtype
                                  or tuple(block.shape[:block.ndim - d.ndim]) != lead):
            out, other = (block, padded) if direction == "backward" else (padded, block)
            return ValueError(f"{where}: out ({type(out).__name__} {tuple(out.shape)} "
                              f"{out.dtype}) does not fit "
                              f"{'dy' if direction == 'backward' else 'the block'} "
                              f"({type(other).__name__} {tuple(other.shape)} {other.dtype})")
        if padded.dtype.kind not in "biufc" and padded.dtype != backend.bfloat16:
            return TypeError(f"{where}: cannot exchange dtype {padded.dtype}")
        return None

    def _exchange(self, plan: Plan, padded: Any) -> None:
        recording = stats.is_recording()
        if plan.direct:  # NumPy: the program, axis after axis while recording
            tuning = plan.tuning
            if tuning is not None:  # a trial exchange (see _halo_tuning), timed
                tuning.begin(plan)
            ops = plan.program(padded)
            trial = time.perf_counter() if tuning is not None else 0.0
            if not recording:
                _run(plan, ops)
            else:
                for ax, start, stop in plan.spans:
                    began = time.perf_counter()
                    _run(plan, ops[start:stop])
                    _account(ax, "halo.exchange", began)
            if tuning is not None:
                tuning.record(plan, time.perf_counter() - trial)
            return
        done = 0  # message units made (see _halo_check.units): two per axis with a comm
        try:
            for ax in plan.axes:
                start = time.perf_counter() if recording else 0.0
                done += ax.comm is not None
                self._move(plan, ax, padded, "send_up", "recv_lo", ax.upper, ax.lower, UP,
                           False)
                done += ax.comm is not None
                self._move(plan, ax, padded, "send_down", "recv_hi", ax.lower, ax.upper,
                           DOWN, False)
                if recording:
                    _account(ax, "halo.exchange", start)
        except (MPI.Exception, Poison) as err:  # a neighbour's poison: it failed
            _halo_check.poisoned(plan, "exchange", done, err, [])

    def _adjoint(self, plan: Plan, padded: Any) -> None:
        recording = stats.is_recording()
        done = 0  # message units made (see _halo_check.units)
        try:
            for ax in reversed(plan.axes):
                start = time.perf_counter() if recording else 0.0
                # Each ghost goes back to whoever filled it and is added there.
                done += ax.comm is not None
                self._move(plan, ax, padded, "recv_lo", "send_up", ax.lower, ax.upper, DOWN,
                           True)
                done += ax.comm is not None
                self._move(plan, ax, padded, "recv_hi", "send_down", ax.upper, ax.lower, UP,
                           True)
                if recording:
                    _account(ax, "halo.adjoint", start)
        except (MPI.Exception, Poison) as err:  # a neighbour's poison: it failed
            _halo_check.poisoned(plan, "adjoint", done, err, [])

    def _move(self, plan: Plan, ax: Axis, padded: Any, sending: str, receiving: str,
              dest: int, source: int, tag: int, add: bool) -> None:
        """Send region ``sending`` of ``ax`` to ``dest`` and receive ``source``'s into region
        ``receiving`` (added to it when ``add``)."""
        send, recv = getattr(ax, sending), getattr(ax, receiving)
        if ax.comm is None:  # alone on a periodic axis: my own opposite face
            if add:
                padded[recv] += padded[send]
            else:
                padded[recv] = padded[send]
            return
        incoming = plan.buffer(ax, receiving)
        comm = ax.comm
        # The receive (first of the two requests) must bring the whole face, if any is due.
        receipt = Receipt(2, [] if source == MPI.PROC_NULL else
                          [(0, plan.mpi_type, incoming.size)])
        if plan.numpy and not plan.packs[ax.axis, sending]:
            # (the adjoint) send in place, receive whole to add
            _settled([comm.Irecv([incoming, plan.mpi_type], source, tag),
                      comm.Isend([padded, 1, plan.datatype(ax, sending)], dest, tag)],
                     receipt)
        else:
            outgoing = plan.buffer(ax, sending)
            outgoing[...] = padded[send]
            wire_send, wire_recv = ((outgoing, incoming) if plan.numpy
                                    else backend.to_wire(outgoing, incoming))
            _settled([comm.Irecv([wire_recv, plan.mpi_type], source, tag),
                      comm.Isend([wire_send, plan.mpi_type], dest, tag)],
                     receipt)
            if not plan.numpy:
                backend.from_wire(incoming, wire_recv)
        if source == MPI.PROC_NULL:
            return
        if add:
            padded[recv] += incoming
        else:
            padded[recv] = incoming

    def free(self) -> None:
        """Free the cached MPI datatypes and buffers (rebuilt on the next call)."""
        for plan in self._plans.values():
            plan.free()
        self._plans.clear()
        self._last = self._ready = None
