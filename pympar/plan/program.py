"""The symbolic run of one training step on one rank: arrays, caches, calls, checks and work.

The layer descriptions of :mod:`pympar.plan.layers` run their forward and backward against an
:class:`Env` instead of arrays: every array is an :class:`Array` (shape, item size and an
identity that views share), every collective a :class:`~pympar.plan.ledger.Call`, every
agreement check a :class:`Check`, every piece of local work a :class:`Work`. What the layers
cache for backward is kept per layer, so the activation memory at any point is the bytes of
the distinct arrays cached then, counted as :func:`pympar.memory.activation_bytes` counts
them (an array and its views once).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from .ledger import Call, Site

__all__ = ["Sized", "Array", "Check", "Work", "Env", "transposed"]

_ids = itertools.count(1)


class Sized:
    """Elements and bytes of something with a ``shape`` and an ``itemsize``."""

    shape: tuple[int, ...]
    itemsize: int

    @property
    def size(self) -> int:
        """Elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes."""
        return self.size * self.itemsize


@dataclass(frozen=True)
class Array(Sized):
    """A symbolic array: its shape, item size and identity (a view keeps its base's).

    Attributes
    ----------
    shape : tuple of int
    itemsize : int
        Bytes per element.
    ident : int
        Equal for an array and its views of the same size.
    """

    shape: tuple[int, ...]
    itemsize: int
    ident: int = 0

    @staticmethod
    def new(shape: tuple[int, ...], itemsize: int) -> "Array":
        """A fresh array (a new identity)."""
        return Array(tuple(int(n) for n in shape), int(itemsize), next(_ids))

    def view(self, shape: tuple[int, ...]) -> "Array":
        """A reshape of this array (same memory, same identity)."""
        return Array(tuple(int(n) for n in shape), self.itemsize, self.ident)

    def like(self, shape: tuple[int, ...] | None = None, itemsize: int | None = None) -> "Array":
        """A fresh array shaped like this one, or like ``shape``."""
        return Array.new(self.shape if shape is None else shape,
                         self.itemsize if itemsize is None else itemsize)


def transposed(a: Array, perm: tuple[int, ...]) -> Array:
    """``ascontiguousarray(a.transpose(perm))``: ``a`` itself where the transpose keeps the
    memory order (its axes longer than one stay in order, or it is empty), else a copy."""
    shape = tuple(a.shape[p] for p in perm)
    moved = [p for p in perm if a.shape[p] > 1]
    if a.size == 0 or moved == sorted(moved):
        return a.view(shape)
    return Array.new(shape, a.itemsize)


@dataclass(frozen=True)
class Check:
    """One agreement check on one rank.

    Attributes
    ----------
    role : str
        The group's role (:class:`~pympar.plan.ledger.Site`).
    kind : str
        ``"board"`` (one word per rank, compared), ``"extents"`` (the same, then one
        small all-gather of every rank's extent) or ``"neighbours"`` (a halo's words to its
        neighbours only).
    """

    role: str
    kind: str = "board"


@dataclass(frozen=True)
class Work:
    """One piece of local computation.

    Attributes
    ----------
    kind : str
        What runs (``"linear.forward"``, ``"attention.backward"``, ...): the calibration
        fits one time model per kind (:mod:`pympar.plan.compute`).
    flops : float
        Floating-point operations.
    bytes : float
        Bytes read and written.
    """

    kind: str
    flops: float
    bytes: float


@dataclass
class Env:
    """What one rank's step did, as the layers run against it.

    Parameters
    ----------
    site : Site
        The rank and its groups.
    itemsize : int
        Bytes per element of the activations and parameters.

    Attributes
    ----------
    timeline : list
        The calls, checks and pieces of work, in the order they happen (what waits for
        what); :attr:`calls`, :attr:`checks` and :attr:`work` are its parts.
    caches : dict
        Per layer (``id``), the arrays it holds for backward.
    peak : int
        The most activation bytes seen by :meth:`probe`.
    """

    site: Site
    itemsize: int
    timeline: list[Call | Check | Work] = field(default_factory=list)
    caches: dict[int, tuple[Array, ...]] = field(default_factory=dict)
    peak: int = 0

    @property
    def calls(self) -> list[Call]:
        """The collective calls, in order."""
        return [e for e in self.timeline if type(e) is Call]

    @property
    def checks(self) -> list[Check]:
        """The agreement checks, in order."""
        return [e for e in self.timeline if type(e) is Check]

    @property
    def work(self) -> list[Work]:
        """The pieces of local work, in order."""
        return [e for e in self.timeline if type(e) is Work]

    # -- arrays and caches
    def array(self, shape: tuple[int, ...], itemsize: int | None = None) -> Array:
        """A fresh array of the activations' item size (or ``itemsize``)."""
        return Array.new(shape, self.itemsize if itemsize is None else itemsize)

    def save(self, owner: Any, *arrays: Array) -> None:
        """``owner.save_for_backward(*arrays)``."""
        self.caches[id(owner)] = arrays

    def release(self, owner: Any) -> tuple[Array, ...]:
        """``owner.saved_tensors()``: its cache, dropped."""
        return self.caches.pop(id(owner), ())

    def cached_bytes(self) -> int:
        """Bytes of the distinct arrays cached now (an identity and size once)."""
        seen = {(a.ident, a.nbytes) for arrays in self.caches.values() for a in arrays}
        return sum(nbytes for _, nbytes in seen)

    def probe(self) -> int:
        """Note the activation bytes now (the examples' peak probe); return them."""
        now = self.cached_bytes()
        self.peak = max(self.peak, now)
        return now

    # -- what happens
    def call(self, role: str, operation: str, primitive: str, bytes_in: int,
             bytes_out: int, recorded_alone: bool = False) -> None:
        """One collective on the group of ``role``. A call on a group of one rank is kept
        only when ``recorded_alone`` (a direct collective records itself; a mapping returns
        its input untouched, and a ring of one rank sends nothing)."""
        group = self.site.groups[role]
        if group.size == 1 and not recorded_alone:
            return
        self.timeline.append(Call(role, operation, primitive, int(bytes_in), int(bytes_out)))

    def check(self, role: str, kind: str = "board") -> None:
        """One agreement check on the group of ``role`` (none on a group of one rank)."""
        if self.site.groups[role].size > 1:
            self.timeline.append(Check(role, kind))

    def compute(self, kind: str, flops: float, nbytes: float) -> None:
        """One piece of local work."""
        self.timeline.append(Work(kind, float(flops), float(nbytes)))
