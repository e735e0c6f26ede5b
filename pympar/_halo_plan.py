"""The plan of one halo exchange (private to :mod:`pympar.halo`): regions, faces, program.

For one array shape and dtype, :class:`Plan` holds per exchanged axis the four regions of
the padded array that travel (:class:`Axis`), how each face reaches MPI (in place as a plain
buffer, as a committed MPI subarray datatype, or packed into a reused contiguous buffer),
and the zeroed ghost slabs where a non-periodic field ends. For a NumPy padded array it
builds, once per array address, the exchange's *program*: per axis, the persistent requests
of the faces with the copies that pack and unpack them, or, along an axis this rank holds
alone (a periodic axis not split), the copies of its own opposite faces. An exchange is then
only that program: no indexing, no new arrays.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import weakref
from typing import Any

import numpy as np
from mpi4py import MPI

from . import backend
from ._halo_tuning import Tuning, tune_from

__all__ = ["UP", "DOWN", "FACES", "Axis", "Plan", "Receipt", "widths", "count"]

UP, DOWN = 41, 42  # message tags: faces travelling to the upper and the lower neighbour
FACES = ("auto", "subarray", "packed")
Index = tuple  # a tuple of slices into a padded array

#: Programs a plan keeps, one per padded array (arrays used in turn, as in double
#: buffering, each keep theirs); the oldest goes first.
_PROGRAMS = 4
#: A local wrap's region that NumPy would copy through a temporary (its cells interleave
#: with those of the opposite face) is cut into at most this many one-dimensional copies.
_MAX_PIECES = 16


def widths(width: Any, ndim: int) -> tuple[tuple[int, int], ...]:
    """``width`` (an int, or per axis an int or a ``(lo, hi)`` pair) as ``(lo, hi)`` per axis."""
    if isinstance(width, (int, np.integer)):
        width = [width] * ndim
    width = list(width)
    if len(width) != ndim:
        raise ValueError(f"HaloExchange: width has {len(width)} entries for a field of {ndim} "
                         f"dimensions (give one int, or one int or (lo, hi) pair per axis)")
    pairs = []
    for w in width:
        lo, hi = (w, w) if isinstance(w, (int, np.integer)) else tuple(w)
        lo, hi = operator.index(lo), operator.index(hi)
        if lo < 0 or hi < 0:
            raise ValueError(f"HaloExchange: widths must be >= 0, got {width}")
        pairs.append((lo, hi))
    return tuple(pairs)


#: ``faces="auto"``: a face that is not one contiguous run of the padded array is packed
#: when its runs are shorter than this many bytes, else sent as a subarray datatype. MPICH
#: 5 (2 ranks, faces of 16 KiB to 1 MiB) moved faces of runs up to 512 B 1.2-10x faster
#: packed, and of runs of 1 KiB and more 1.4-10x faster as datatypes; Open MPI 4.1 and 5
#: moved runs of 8-16 B 2-4x faster packed, and longer ones about as fast either way.
#: Runs from ``_halo_tuning.TUNE_FROM`` on are timed both ways by an exchange's first calls;
#: this rule is where the trial starts and what the adjoint (never timed) keeps.
PACK_BELOW = {"MPICH": 1024}
PACK_BELOW_OTHERS = 32

#: ``faces="auto"``, MPICH, a neighbour on another node: a face of at most this many bytes
#: goes as a datatype whatever its runs. Across two emulated nodes (the netmod, 2 ranks) a
#: column of 8 KiB moved 1.3-1.6x faster as a datatype than packed (the netmod packs a
#: message this small once, into its own buffer; packing it here adds a copy at each end),
#: and columns of 32 KiB and more 1.2-2.2x faster packed.
OFF_NODE_DATATYPE_UP_TO = {"MPICH": 16384}


def pack_below(faces: str) -> float:
    """Runs (bytes) shorter than this go packed, under ``faces`` and this MPI library."""
    if faces != "auto":
        return math.inf if faces == "packed" else 0
    return PACK_BELOW.get(MPI.get_vendor()[0], PACK_BELOW_OTHERS)


def off_node_datatype_up_to(faces: str) -> int:
    """Faces (bytes) to or from another node up to this size go as datatypes, under
    ``faces`` and this MPI library (0: the rule of :func:`pack_below` alone)."""
    return OFF_NODE_DATATYPE_UP_TO.get(MPI.get_vendor()[0], 0) if faces == "auto" else 0


class Axis:
    """The four regions of one axis's exchange in a padded array, and who sends to whom.

    ``send_up`` (the top ``lo`` interior cells) fills the upper neighbour's ``recv_lo``;
    ``send_down`` (the bottom ``hi`` interior cells) fills the lower neighbour's ``recv_hi``.
    """

    def __init__(self, axis: int, lead: int, padded: tuple[int, ...], interior: Index,
                 widths: tuple[tuple[int, int], ...], comm: MPI.Comm | None,
                 neighbours: tuple[int, int], group_name: str | None = None) -> None:
        lo, hi = widths[axis]
        n = padded[axis] - lo - hi
        self.axis, self.comm, (self.lower, self.upper) = axis, comm, neighbours
        self.group_name = None if comm is None else group_name
        around = [slice(None)] * len(padded)
        for b in range(axis + 1, len(padded)):
            around[b] = interior[b]  # later axes: interior only; earlier: the whole padding

        def region(start: int, stop: int) -> Index:
            index = list(around)
            index[axis] = slice(start, stop)
            return (slice(None),) * lead + tuple(index)

        self.recv_lo, self.send_up = region(0, lo), region(n, n + lo)
        self.recv_hi, self.send_down = region(lo + n, lo + n + hi), region(lo, lo + hi)
        self.lo, self.hi = lo, hi


class Receipt:
    """The statuses of one axis's requests, and what each receive must bring: a receive that
    brings fewer elements than its face got a neighbour's poison (:mod:`pympar._halo_check`:
    an empty message, where a face was due), which no MPI reports as an error."""

    __slots__ = ("statuses", "receives")

    def __init__(self, requests: int, receives: list[tuple[int, MPI.Datatype, int]]) -> None:
        self.statuses = [MPI.Status() for _ in range(requests)]
        # (status, the receive's datatype, the basic elements its face brings)
        self.receives = [(self.statuses[i], datatype, n) for i, datatype, n in receives]

    def short(self) -> bool:
        """Whether some receive brought fewer elements than its face (after the wait)."""
        for status, datatype, n in self.receives:
            if status.Get_elements(datatype) != n:
                return True
        return False


class _Program:
    """One padded array's exchange (see :meth:`Plan.program`): ``ops``, ``spans``,
    ``persistent``, and ``watch``, a weak reference to the array, whose death releases it."""

    __slots__ = ("ops", "spans", "persistent", "watch")

    def __init__(self) -> None:
        self.ops: list[tuple[Any, Any]] = []
        self.spans: list[tuple[Axis, int, int]] = []
        self.persistent: list[list[MPI.Prequest]] = []
        self.watch: Any = None


def _release(program: _Program) -> None:
    """Free a program's requests (not after MPI has finalized: they went with it; nor those
    an MPI made null when they failed)."""
    if not MPI.Is_finalized():
        for requests in program.persistent:
            for req in requests:
                if req:
                    try:
                        req.Free()
                    except MPI.Exception:
                        pass
    program.persistent.clear()
    program.ops.clear()
    program.spans.clear()


def _release_all(programs: dict[int, _Program]) -> None:
    kept = list(programs.values())
    programs.clear()
    for program in kept:
        _release(program)


def _forget(programs: dict[int, _Program], key: int, watch: Any) -> None:
    """The array of ``programs[key]`` went (``watch``'s callback): release its program
    before its memory can be reused."""
    program = programs.get(key)
    if program is not None and program.watch is watch:
        del programs[key]
        _release(program)


def _sizes(region: Index, shape: tuple[int, ...]) -> list[int]:
    """The extents of ``region`` (slices of step 1) in an array of ``shape``."""
    return [len(range(*s.indices(n))) for s, n in zip(region, shape)]


def _contiguous(region: Index, shape: tuple[int, ...]) -> bool:
    """Whether ``region`` is one contiguous run of a C-ordered array of ``shape``: single
    cells along the axes before one, whole axes after it."""
    sizes = _sizes(region, shape)
    first = next((a for a, n in enumerate(sizes) if n != 1), len(sizes))
    return sizes[first + 1:] == list(shape[first + 1:])


def count(region: Index, shape: tuple[int, ...]) -> int:
    """The number of cells of ``region`` in an array of ``shape``."""
    return int(np.prod(_sizes(region, shape)))


def _layout(region: Index, shape: tuple[int, ...],
            itemsize: int) -> tuple[int, list[tuple[int, int]]]:
    """Where ``region`` of a C-contiguous array of ``shape`` starts (bytes), and its axes as
    ``(extent, stride)``, unit axes dropped and adjacent ones merged."""
    strides = [itemsize * math.prod(shape[b + 1:]) for b in range(len(shape))]
    offset, dims = 0, []
    for s, n, stride in zip(region, shape, strides):
        start, stop, _ = s.indices(n)
        offset += start * stride
        if stop - start != 1:
            if dims and dims[-1][1] == (stop - start) * stride:
                dims[-1] = (dims[-1][0] * (stop - start), stride)
            else:
                dims.append((stop - start, stride))
    return offset, dims


def _split_runs(region: Index, shape: tuple[int, ...],
                itemsize: int) -> tuple[int, list[tuple[int, int]], int]:
    """:func:`_layout` of ``region`` with the contiguous run taken out: ``(offset, the axes
    of the runs, run length in bytes)``."""
    offset, dims = _layout(region, shape, itemsize)
    run = itemsize
    if dims and dims[-1][1] == itemsize:
        run = dims.pop()[0] * itemsize
    return offset, dims, run


def _runs(memory: np.ndarray, shape: tuple[int, ...], itemsize: int, region: Index,
          like: np.ndarray | None = None) -> np.ndarray:
    """``region`` of a C-contiguous array of ``shape`` whose bytes are ``memory`` (uint8) as
    an array of its contiguous runs, each one element (an unsigned int for runs of 1, 2, 4
    or 8 bytes, else of a void dtype), over the fewest axes; or, with ``like`` (a contiguous
    buffer of the region's cells), ``like`` cut the same way.

    NumPy copies such an array run by run, and copies a one-dimensional one with no check
    for overlap (an n-dimensional copy between interleaved regions of one array goes
    through a temporary)."""
    offset, dims, run = _split_runs(region, shape, itemsize)
    # Runs of one machine word copy 2-2.5x faster as unsigned ints than as void (strided).
    kind = np.dtype(f"u{run}") if run in (1, 2, 4, 8) else np.dtype((np.void, run))
    if like is not None:
        return np.ndarray(tuple(n for n, _ in dims), kind,
                          buffer=like.reshape(-1).view(np.uint8))
    return np.ndarray(tuple(n for n, _ in dims), kind, buffer=memory, offset=offset,
                      strides=tuple(s for _, s in dims))


def _pieces(dst: np.ndarray, src: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """The copy of ``src`` into ``dst`` (runs of one array, :func:`_runs`) as one copy where
    NumPy makes it without a temporary (one dimension, or regions apart); else as
    one-dimensional copies along the longest axis, one per cell of the others while they are
    few, else the one n-dimensional copy."""
    if dst.ndim <= 1 or not np.may_share_memory(dst, src):  # no temporary: one copy
        return [(dst, src)]
    longest = int(np.argmax(dst.shape))
    others = [range(n) if a != longest else [slice(None)] for a, n in enumerate(dst.shape)]
    if math.prod(dst.shape) // dst.shape[longest] > _MAX_PIECES:
        return [(dst, src)]
    return [(dst[at], src[at]) for at in itertools.product(*others)]


class Plan:
    """Everything one array shape and dtype needs: regions, faces, buffers, program, key."""

    def __init__(self, halo: Any, shape: tuple[int, ...], x: Any) -> None:
        d = halo.decomposition
        lead = len(shape) - d.ndim
        self.shape, self.dtype = shape, x.dtype
        self.interior = (slice(None),) * lead + halo.interior
        self.numpy = type(x) is np.ndarray
        self.axes = []
        for a in halo.exchanged:
            group = d.groups[a]
            comm = None if group is None or group.size == 1 else group.comm
            self.axes.append(Axis(a, lead, halo.padded_shape, halo.interior, halo.widths,
                                   comm, d.neighbours(a), group and group.name))
        # Outer ghost slabs (where a non-periodic field ends), zeroed by forward.
        self.outer: list[Index] = []
        for a in range(d.ndim):
            lower, upper = d.neighbours(a)
            lo, hi = halo.widths[a]
            full = [slice(None)] * d.ndim
            for none, width, start in ((lower, lo, 0), (upper, hi, halo.padded_shape[a] - hi)):
                if width and none == MPI.PROC_NULL:
                    full[a] = slice(start, start + width)
                    self.outer.append((slice(None),) * lead + tuple(full))
        self.mpi_type = backend.mpi_datatype(x.dtype)
        # Per face, (axis, region name): whether it travels through a reused buffer (else in
        # place: its bytes, or its subarray datatype). CuPy faces always do.
        below = pack_below(halo.faces) if self.numpy else math.inf
        up_to = off_node_datatype_up_to(halo.faces) if self.numpy else 0
        off_node = {a: set(board.remote) for a, _, board in halo._checks}

        tune = tune_from(halo.faces) if self.numpy else math.inf

        def runs(ax: Axis, name: str) -> float:
            """The face's runs (bytes); 0 where it travels in place or as a datatype
            whatever its runs (contiguous, or small and to another node)."""
            region = getattr(ax, name)
            if _contiguous(region, shape):
                return 0
            peer = ax.upper if name in ("send_up", "recv_hi") else ax.lower
            if peer in off_node.get(ax.axis, ()) \
                    and count(region, shape) * x.dtype.itemsize <= up_to:
                return 0
            return _split_runs(region, shape, x.dtype.itemsize)[2]

        faces = {(ax.axis, name): runs(ax, name) for ax in self.axes if ax.comm is not None
                 for name in ("send_up", "recv_lo", "send_down", "recv_hi")}
        self.packs = {face: 0 < run < below for face, run in faces.items()}
        # Faces of long runs: the first exchanges time both ways (see _halo_tuning).
        uncertain = [face for face, run in faces.items() if run >= tune]
        self.tuning = Tuning(uncertain) if uncertain else None
        self.tuned: bool | None = None  # the way the trial chose: packed, or datatypes
        self.types: dict[tuple[int, str], MPI.Datatype] = {}
        self.buffers: dict[Any, Any] = {}
        self.signatures: dict[str | None, int] = {}  # the agreement key's, per label
        # The programs (see program()), by padded array (its id: an array that goes takes
        # its program with it), and the current one's lists: ops, a flat list of
        # (requests, Receipt), started and waited for, and (dst, src), copied; spans, per axis
        # (axis, start, stop) in ops; persistent, the request lists, one per axis with a
        # comm. requests_on: the array of the current program.
        self.programs: dict[int, _Program] = {}
        self.ops: list[tuple[Any, Any]] = []
        self.spans: list[tuple[Axis, int, int]] = []
        self.persistent: list[list[MPI.Prequest]] = []
        self.requests_on: Any = None
        # Programs left when the plan goes (or at exit, before MPI finalizes) are freed then.
        weakref.finalize(self, _release_all, self.programs)
        self.xp = backend.array_module(x)
        self.lead_shape = shape[:lead]
        for ax in self.axes:  # bytes sent and received along the axis, for statistics
            up, down = ax.upper != MPI.PROC_NULL, ax.lower != MPI.PROC_NULL
            ax.sent = x.dtype.itemsize * (up * count(ax.send_up, shape)
                                          + down * count(ax.send_down, shape))
            ax.received = x.dtype.itemsize * (down * count(ax.recv_lo, shape)
                                              + up * count(ax.recv_hi, shape))
        # A NumPy exchange runs its program (CuPy faces go through _move: staged, synced).
        self.direct = self.numpy

    def program(self, padded: np.ndarray) -> list[tuple[Any, Any]]:
        """The exchange of ``padded`` as a flat list of operations (see ``ops``), made once
        per array and kept while the array lives (up to ``_PROGRAMS`` arrays, the oldest
        going first): a reused padded array starts its requests again without building any
        message (2-3 us less per axis than two ``Sendrecv``, on MPICH), and arrays used in
        turn keep theirs. The program holds the array's memory by address, not the array."""
        if padded is self.requests_on:  # the current program's array
            return self.ops
        program = self.programs.get(id(padded))
        if program is None or program.watch() is not padded:
            if len(self.programs) >= _PROGRAMS:
                _release(self.programs.pop(next(iter(self.programs))))
            program = self._build(padded)
            key = id(padded)
            program.watch = weakref.ref(padded, functools.partial(_forget, self.programs,
                                                                  key))
            self.programs[key] = program
        self.ops, self.spans, self.persistent = program.ops, program.spans, program.persistent
        self.requests_on = padded
        return self.ops

    def _build(self, padded: np.ndarray) -> _Program:
        """The program of ``padded``, on views of its memory from its address (so that only
        the caller's references keep it)."""
        program = _Program()
        memory = (np.frombuffer(MPI.buffer.fromaddress(padded.ctypes.data, padded.nbytes),
                                np.uint8) if padded.nbytes else np.zeros(0, np.uint8))
        for ax in self.axes:
            start = len(program.ops)
            if ax.comm is None:  # alone on a periodic axis: my own opposite faces
                for recv, send in (("recv_lo", "send_up"), ("recv_hi", "send_down")):
                    region = getattr(ax, recv)
                    if count(region, self.shape):
                        program.ops += _pieces(self._runs(memory, region),
                                               self._runs(memory, getattr(ax, send)))
            else:
                self._build_messages(ax, memory, program)
            program.spans.append((ax, start, len(program.ops)))
        return program

    def _runs(self, memory: np.ndarray, region: Index,
              like: np.ndarray | None = None) -> np.ndarray:
        return _runs(memory, self.shape, self.dtype.itemsize, region, like)

    def _build_messages(self, ax: Axis, memory: np.ndarray, program: _Program) -> None:
        """An axis's four persistent requests (both receives, then both sends; none with
        ``MPI.PROC_NULL``) and their :class:`Receipt`, after the packing copies of its send
        faces and before the unpacking copies of its receive faces."""
        receives, sends, packing, unpacking, expected = [], [], [], [], []
        for send, dest, tag, recv, source in (("send_up", ax.upper, UP, "recv_lo", ax.lower),
                                              ("send_down", ax.lower, DOWN, "recv_hi",
                                               ax.upper)):
            if source != MPI.PROC_NULL:
                message, copy = self._face(ax, recv, memory)
                expected.append((len(receives), message[-1],
                                 count(getattr(ax, recv), self.shape)))
                receives.append(ax.comm.Recv_init(message, source, tag))
                if copy is not None:
                    unpacking.append(copy)
            if dest != MPI.PROC_NULL:
                message, copy = self._face(ax, send, memory)
                sends.append(ax.comm.Send_init(message, dest, tag))
                if copy is not None:
                    packing.append(copy[::-1])
        requests = receives + sends
        program.persistent.append(requests)
        program.ops += packing + [(requests, Receipt(len(requests), expected))] + unpacking

    def _face(self, ax: Axis, name: str, memory: np.ndarray) -> tuple[Any, Any]:
        """Region ``name`` of ``ax`` as its request takes it, and the copy ``(region,
        buffer)`` that packs or unpacks it (None in place): a contiguous run as its bytes
        in ``memory`` (the padded array's), else packed into a reused buffer or as the
        region's subarray datatype."""
        region = getattr(ax, name)
        if _contiguous(region, self.shape):
            at = _layout(region, self.shape, self.dtype.itemsize)[0]
            return [memory[at:at + count(region, self.shape) * self.dtype.itemsize],
                    self.mpi_type], None
        if not self.packs[ax.axis, name] and count(region, self.shape):
            return [memory, 1, self.datatype(ax, name)], None
        buffer = self.buffer(ax, name)
        copy = ((self._runs(memory, region), self._runs(memory, region, buffer))
                if buffer.size else None)
        return [buffer, self.mpi_type], copy

    def drop(self) -> None:
        """Release the current program (after an MPI error in it: an MPI may have made its
        requests null); the array's next exchange makes a new one."""
        program = self.programs.get(id(self.requests_on))
        if program is not None and program.ops is self.ops:
            del self.programs[id(self.requests_on)]
            _release(program)
        self.ops, self.spans, self.persistent = [], [], []
        self.requests_on = None

    def free_requests(self) -> None:
        """Free every program's persistent requests."""
        _release_all(self.programs)
        self.ops, self.spans, self.persistent = [], [], []
        self.requests_on = None

    def datatype(self, ax: Axis, name: str) -> MPI.Datatype:
        """The committed subarray datatype of region ``name`` of ``ax`` (cached)."""
        t = self.types.get((ax.axis, name))
        if t is None:
            starts, sizes = [], []
            for s, n in zip(getattr(ax, name), self.shape):
                start, stop, _ = s.indices(n)
                starts.append(start)
                sizes.append(stop - start)
            t = self.types[ax.axis, name] = self.mpi_type.Create_subarray(
                list(self.shape), sizes, starts, order=MPI.ORDER_C).Commit()
        return t

    def buffer(self, ax: Axis, name: str) -> Any:
        """A reused contiguous array shaped as region ``name`` of ``ax`` (one per region)."""
        buf = self.buffers.get((ax.axis, name))
        if buf is None:
            buf = self.buffers[ax.axis, name] = self.xp.empty(
                _sizes(getattr(ax, name), self.shape), self.dtype)
        return buf

    def free(self) -> None:
        self.free_requests()
        for t in self.types.values():
            t.Free()
        self.types.clear()
        self.buffers.clear()
