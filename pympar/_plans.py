"""Plans of the collectives: what a call needs that depends only on its metadata (private).

A :class:`Plan` is built once per call kind and cached on the group's ``CommState``;
:func:`pack` and :func:`unpack` move rank :class:`Blocks` to and from rank-major order.
"""

from __future__ import annotations

import itertools
import math
import zlib
from typing import Any

import numpy as np
from mpi4py import MPI


def signature(key: tuple, label: str | None) -> int:
    """The agreement check's 32-bit signature (odd) of the call ``key`` under ``label``."""
    return zlib.crc32(repr((key, label)).encode()) | 1


class Blocks:
    """An axis of a C-ordered shape, seen as ``(lead, n, post)``, cut into one block per rank:
    block ``q`` is ``[:, offsets[q]:offsets[q] + sizes[q], :]``, rank-major ``counts[q]``
    elements at ``displs[q]``."""

    __slots__ = ("lead", "n", "post", "sizes", "offsets", "counts", "displs", "even",
                 "by_axis", "scratch_shape")

    def __init__(self, shape: tuple[int, ...], axis: int, sizes: tuple[int, ...]) -> None:
        self.lead, self.post = math.prod(shape[:axis]), math.prod(shape[axis + 1:])
        self.n, self.sizes = sum(sizes), sizes
        self.offsets = (0, *itertools.accumulate(sizes))[:-1]
        self.counts = tuple(self.lead * s * self.post for s in sizes)
        self.displs = (0, *itertools.accumulate(self.counts))[:-1]
        self.even = len(set(sizes)) == 1
        # Even blocks: 4-D views (lead, rank, s, post) and (rank, lead, s, post), one copy apart.
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
    """What one collective call needs that depends only on metadata, computed once.

    The call is ``method([send, *send_spec], [recv, *recv_spec], *tail)`` (``Bcast``: no
    send part); ``send``/``recv``: the rank blocks to pack or unpack, or None; ``work``: the
    wire dtype (float32 for half-precision sums); ``chunk``: slices of a count MPI-3 cannot
    express; ``key``: what every rank passes alike (``signatures``: its hashes per label).
    """

    __slots__ = ("out_shape", "work", "cast", "swap", "mpi_type", "method", "send_spec",
                 "recv_spec", "tail", "send", "recv", "chunk", "key", "shown", "signatures",
                 "derived")

    def __init__(self, out_shape: tuple[int, ...], work: np.dtype, swap: bool,
                 mpi_type: MPI.Datatype, op: MPI.Op | None, key: tuple, shown: str) -> None:
        self.out_shape, self.work, self.swap = out_shape, work, swap
        self.mpi_type, self.key, self.shown = mpi_type, key, shown
        self.cast = False
        self.method: str | None = None
        self.send_spec = self.recv_spec = (mpi_type,)
        self.tail: tuple = () if op is None else (op,)
        self.send = self.recv = self.chunk = self.derived = None
        self.signatures: dict[str | None, int] = {}


def in_units(plan: Plan, numbers: tuple[int, ...], int_max: int) -> None:
    """Express the plan's counts (``numbers``: all of them and the displacements) for MPI-3
    in units of a derived datatype (``plan.derived``): their largest common divisor that
    brings them within ``int_max`` (else ``ValueError``)."""
    g, largest = math.gcd(*numbers), max(numbers)
    divisors = {d for k in range(1, math.isqrt(g) + 1) if g % k == 0 for d in (k, g // k)}
    unit = max((d for d in divisors if d <= int_max and largest // d <= int_max), default=0)
    if not unit:
        raise ValueError(f"{plan.shown}: counts up to {largest} exceed {int_max}, and no "
                         f"common unit lets an MPI-3 library express them; use MPI-4")
    derived = plan.derived = plan.mpi_type.Create_contiguous(unit).Commit()

    def convert(spec: tuple) -> tuple:
        if len(spec) == 1:  # mpi4py derives the count from the buffer's size
            return (derived,)
        (counts, displs), _ = spec
        return ((tuple(c // unit for c in counts), tuple(d // unit for d in displs)), derived)
    plan.send_spec, plan.recv_spec = convert(plan.send_spec), convert(plan.recv_spec)
