"""Per-communicator state of the collectives (plans, scratch, the agreement board) and the
protocol they see a group through, so that they need not import :mod:`pympar.group`."""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from . import _board, backend
from ._plans import Plan

MAX_PLANS = 512
MAX_BUFFERS = 16
MAX_BUFFER_BYTES = 2**31  # per communicator; one larger message still gets its buffer


class Communicator(Protocol):
    """What a collective needs of its group (:class:`pympar.group.Group` is one)."""

    comm: MPI.Intracomm
    name: str
    ranks: tuple[int, ...]
    rank: int
    size: int
    _state: CommState


def freed_error(what: str, group: Communicator) -> RuntimeError:
    """The error of ``what`` called on ``group`` after :meth:`pympar.group.Group.free`."""
    return RuntimeError(f"{what}: group {group.name!r} has been freed (Group.free or "
                        f"manager.destroy_parallel); use the groups of the current state")


class CommState:
    """The collectives' plans, scratch buffers and agreement board for the communicator
    ``comm`` (creating it is collective over ``comm``: :func:`pympar._board.create`)."""

    __slots__ = ("plans", "buffers", "board")

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.plans: dict[tuple, Plan] = {}
        self.buffers: dict[tuple, Any] = {}
        self.board = _board.create(comm)

    def remember(self, key: tuple, plan: Plan) -> Plan:
        """Cache ``plan`` under ``key`` (everything is released when the cache is full)."""
        if len(self.plans) >= MAX_PLANS:
            self.release()
        self.plans[key] = plan
        return plan

    def scratch(self, slot: str, shape: tuple[int, ...], dtype: np.dtype, like: Any) -> Any:
        """The C-contiguous scratch array of ``slot`` (contents undefined) in ``like``'s array
        module; the oldest go beyond :data:`MAX_BUFFERS` arrays or :data:`MAX_BUFFER_BYTES`."""
        numpy = type(like) is np.ndarray
        key = (slot, shape, dtype, numpy)
        buffers = self.buffers
        buffer = buffers.get(key)
        if buffer is None:
            nbytes = math.prod(shape) * dtype.itemsize
            while buffers and (len(buffers) >= MAX_BUFFERS or
                               sum(b.nbytes for b in buffers.values()) + nbytes > MAX_BUFFER_BYTES):
                del buffers[next(iter(buffers))]
            xp = np if numpy else backend.array_module(like)
            buffer = buffers[key] = xp.empty(shape, dtype)
        return buffer

    def release(self) -> None:
        """Drop the plans (freeing their derived datatypes) and the scratch buffers."""
        plans, self.plans, self.buffers = self.plans, {}, {}
        for plan in plans.values():
            if plan.derived is not None:
                plan.derived.Free()

    def free(self) -> None:
        """:meth:`release`, and unmap the board."""
        self.release()
        if self.board is not None:
            self.board.free()
            self.board = None
