"""Plans and scratch buffers of the collectives (private to :mod:`pympar.collectives`).

* A :class:`Plan` is everything a call needs that depends only on metadata (operation,
  shape, dtype, axis, sizes): the output shape, the MPI method and its count arguments,
  how the input and the result are cut into rank blocks, and the call's signature for the
  agreement check. Each group keeps its plans in ``group._plans``.
* :class:`Blocks` cuts an axis into one block per rank; :func:`pack` and :func:`unpack`
  move a non-leading axis between its array and rank-major order (casting on the way).
* Scratch: each group keeps a bounded cache of temporaries (``group._buffers``, at most
  ``MAX_BUFFERS`` arrays and ``MAX_BUFFER_BYTES`` bytes, oldest evicted first).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from . import backend

MAX_BUFFERS = 16
MAX_BUFFER_BYTES = 2**31  # per group; one larger message still gets its buffer
MAX_PLANS = 512
HUGE_PAGE = 2 << 20
#: Scratch arrays of this many bytes or more start on a HUGE_PAGE boundary (see _aligned).
ALIGNED_FROM = 8 << 20


class Blocks:
    """An axis of a C-ordered shape cut into one block per rank.

    Seen as ``(lead, n, post)``, block ``q`` covers ``[:, offsets[q]:offsets[q] + sizes[q],
    :]``; rank-major, it is ``counts[q]`` elements at ``displs[q]``.
    """

    __slots__ = ("lead", "n", "post", "sizes", "offsets", "counts", "displs", "even",
                 "by_axis", "scratch_shape")

    def __init__(self, shape: tuple[int, ...], axis: int, sizes: tuple[int, ...]) -> None:
        self.lead, self.post = math.prod(shape[:axis]), math.prod(shape[axis + 1:])
        self.n, self.sizes = sum(sizes), sizes
        self.offsets = (0, *itertools.accumulate(sizes))[:-1]
        self.counts = tuple(self.lead * s * self.post for s in sizes)
        self.displs = (0, *itertools.accumulate(self.counts))[:-1]
        self.even = len(set(sizes)) == 1
        # Even blocks as 4-D views, one transposed copy apart: the array (lead, rank, s,
        # post) and the rank-major scratch (rank, lead, s, post).
        p, s = len(sizes), sizes[0]
        self.by_axis = (self.lead, p, s, self.post)
        self.scratch_shape = (p, self.lead, s, self.post) if self.even else (sum(self.counts),)


def pack(flat: Any, x: Any, b: Blocks) -> None:
    """Copy ``x``'s blocks rank-major into the scratch ``flat`` (any layout; casts)."""
    if b.even:
        flat[...] = x.reshape(b.by_axis).transpose(1, 0, 2, 3)
        return
    x3 = x.reshape(b.lead, b.n, b.post)
    for o, s, d, c in zip(b.offsets, b.sizes, b.displs, b.counts):
        flat[d:d + c].reshape(b.lead, s, b.post)[...] = x3[:, o:o + s]


def unpack(dest: Any, flat: Any, b: Blocks) -> None:
    """Copy the rank-major blocks of the scratch ``flat`` into the C-contiguous ``dest``."""
    if b.even:
        dest.reshape(b.by_axis)[...] = flat.transpose(1, 0, 2, 3)
        return
    d3 = dest.reshape(b.lead, b.n, b.post)
    for o, s, d, c in zip(b.offsets, b.sizes, b.displs, b.counts):
        d3[:, o:o + s] = flat[d:d + c].reshape(b.lead, s, b.post)


class Plan:
    """What one collective call needs that depends only on metadata, computed once per key.

    ``method`` is the blocking mpi4py method (``Iallgather`` is ``Allgather``'s twin);
    the call is ``method([send, *send_spec], [recv, *recv_spec], *tail)``, without the send
    part for ``Bcast``. ``send``/``recv`` are the rank blocks to pack/unpack when they do not
    lie rank-major in memory, else None. ``work`` is the dtype on the wire (float32 for
    half-precision sums); ``chunk`` splits a single-buffer call whose count MPI-3 cannot
    express. ``key`` is what every rank must pass alike; ``sig`` its checksum, ``checks`` the
    agreement check's signature per label (built once); ``nbytes`` the size of the global
    array, the same on every rank of a correct call.
    """

    __slots__ = ("out_shape", "work", "cast", "swap", "mpi_type", "op", "method", "send_spec",
                 "recv_spec", "tail", "send", "recv", "chunk", "key", "sig", "nbytes", "shown",
                 "checks")

    def __init__(self, **fields: Any) -> None:
        self.send = self.recv = self.chunk = None
        # label -> the agreement check's 32-bit signature of this call under that label
        self.checks: dict[str | None, bytes | int] = {}
        self.tail: tuple = ()
        for name, value in fields.items():
            setattr(self, name, value)


def remember(group: Any, key: tuple, plan: Plan) -> Plan:
    if len(group._plans) >= MAX_PLANS:
        group._plans.clear()
    group._plans[key] = plan
    return plan


def scratch(group: Any, slot: str, shape: tuple[int, ...], dtype: np.dtype, like: Any) -> Any:
    """The group's C-contiguous scratch array for ``slot`` (contents undefined).

    Allocated on first use with the array module of ``like``; the cache holds at most
    ``MAX_BUFFERS`` arrays and ``MAX_BUFFER_BYTES`` bytes, evicting the oldest first.
    """
    numpy = type(like) is np.ndarray
    key = (slot, shape, dtype, numpy)
    buffers = group._buffers
    buffer = buffers.get(key)
    if buffer is None:
        nbytes = math.prod(shape) * dtype.itemsize
        while buffers and (len(buffers) >= MAX_BUFFERS or
                           sum(b.nbytes for b in buffers.values()) + nbytes > MAX_BUFFER_BYTES):
            del buffers[next(iter(buffers))]
        if numpy and nbytes >= ALIGNED_FROM:
            buffer = buffers[key] = _aligned(shape, dtype, nbytes)
        else:
            xp = np if numpy else backend.array_module(like)
            buffer = buffers[key] = xp.empty(shape, dtype)
    return buffer


def _aligned(shape: tuple[int, ...], dtype: np.dtype, nbytes: int) -> np.ndarray:
    """An empty array starting on a :data:`HUGE_PAGE` boundary (one page more is allocated).

    Linux backs large NumPy allocations with transparent huge pages only on whole,
    aligned 2 MiB pages; where a buffer starts inside one decides how much of it gets
    them. On the 2-core test VM (``bench_mappings.py``, same-job A/B, several runs), the
    rows through scratch of 8 MiB or more ran 5-20% faster aligned (16 MiB packs of a
    hidden-axis block, the 8 MiB receive buffers of 4 MiB gathers); rows through 4 MiB
    scratch scattered from 0.77x to 1.24x raw from run to run, aligned or not, so
    :data:`ALIGNED_FROM` leaves them as NumPy allocates them.
    """
    raw = np.empty(nbytes + HUGE_PAGE, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def in_units(plan: Plan, numbers: tuple[int, ...], int_max: int) -> None:
    """Express the plan's counts in a contiguous derived datatype, for MPI-3 libraries.

    ``numbers`` are every count and displacement of the call, in elements. The unit is
    the largest divisor of all of them that brings them within ``int_max``; ``ValueError``
    when there is none (uneven blocks of unrelated sizes).
    """
    g, largest = math.gcd(*numbers), max(numbers)
    divisors = {d for k in range(1, math.isqrt(g) + 1) if g % k == 0 for d in (k, g // k)}
    unit = max((d for d in divisors if d <= int_max and largest // d <= int_max), default=0)
    if not unit:
        raise ValueError(f"{plan.shown}: counts up to {largest} exceed {int_max}, and no "
                         f"common unit lets an MPI-3 library express them; use MPI-4")
    derived = plan.mpi_type.Create_contiguous(unit).Commit()

    def convert(spec: tuple) -> tuple:
        if len(spec) == 1:  # mpi4py derives the count from the buffer's size
            return (derived,)
        (counts, displs), _ = spec
        return ((tuple(c // unit for c in counts), tuple(d // unit for d in displs)), derived)
    plan.send_spec, plan.recv_spec = convert(plan.send_spec), convert(plan.recv_spec)
