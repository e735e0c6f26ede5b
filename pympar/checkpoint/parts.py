"""Models whose parts live on different ranks (pipeline stages): the union of the tensors.

A pipeline stage holds only its own layers' parameters (and its optimizer only their
moments), named as in the whole model. :func:`complete` makes every rank's list of tensors
the union of all ranks' lists, in one order: a tensor this rank does not hold is *absent*
here (:class:`Absent`: no block to write or read), and the ranks holding it write and read
it as any other. So a save writes the serial checkpoint whatever the cut, and a load reads
it under any other cut, or into the whole model.

A model marks itself as a part with a true ``holds_part_of_model`` attribute
(:class:`pympar.pipeline.PipelineStage`); a rank whose model does not must hold every
tensor, as before.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from mpi4py import MPI

from ._shared import Tensor, agree
from .format import logical_dtype, logical_name, stored_dtype

__all__ = ["Absent", "complete"]


class Absent:
    """Where a tensor sits on a rank that holds none of it: no piece of it.

    Attributes
    ----------
    shape : tuple of int
        The full tensor's shape.
    local_shape : tuple of int
        All zeros: nothing here.
    """

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = tuple(int(n) for n in shape)
        self.local_shape = tuple(0 for _ in self.shape)

    def pieces(self) -> list:
        """No ``(global box, local box)`` pair: this rank writes and reads nothing."""
        return []


def complete(comm: MPI.Intracomm, model: Any, tensors: list[Tensor],
             meta: dict | None) -> tuple[list[Tensor], dict | None]:
    """Every rank's tensors as the union of all ranks' (collective over ``comm``).

    Without a rank whose model holds part of a model, ``tensors`` and ``meta`` come back as
    they are (one small all-reduce). Otherwise every rank gets the same list: the model's
    tensors in the order the ranks name them (lower ranks first), then the optimizer's, the
    ones it does not hold :class:`Absent`; and ``meta``'s step counts become the union of
    every rank's.

    Raises
    ------
    pympar.checkpoint.CheckpointError
        On every rank, when ranks give one tensor different full shapes or dtypes, or a rank
        whose model is whole lacks a tensor another holds.
    """
    part = bool(getattr(model, "holds_part_of_model", False))
    flag = np.array([part], dtype=np.int32)
    comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
    if not flag[0]:
        return tensors, meta
    mine = {"part": part, "steps": None if meta is None else meta["steps"],
            "tensors": [[t.name, list(t.placement.shape), logical_name(t.logical)]
                        for t in tensors]}
    every = _allgather_json(comm, mine)
    union, error = _union(every)
    agree(comm, error)
    held = {t.name: t for t in tensors}
    out = []
    for name, (shape, dtype) in union.items():
        if name in held:
            out.append(held[name])
        else:
            logical = logical_dtype(dtype, name)
            stored = stored_dtype(logical)
            out.append(Tensor(name, Absent(shape), np.empty(Absent(shape).local_shape, stored),
                              logical, stored))
    if meta is not None:
        steps = {}
        for rank in every:
            steps.update(rank["steps"] or {})
        meta = {**meta, "steps": steps}
    return out, meta


def _union(every: list[dict]) -> tuple[dict[str, tuple], str | None]:
    """The tensors of all ranks by name, model tensors first (lower ranks' first), then the
    optimizer's; and the first disagreement, in words (None when they agree)."""
    found: dict[str, tuple] = {}
    where: dict[str, int] = {}
    for optimizer in (False, True):
        for rank, listing in enumerate(every):
            for name, shape, dtype in listing["tensors"]:
                if name.startswith("optimizer/") != optimizer:
                    continue
                seen = found.setdefault(name, (tuple(shape), dtype))
                where.setdefault(name, rank)
                if seen != (tuple(shape), dtype):
                    return found, (f"tensor {name!r} is {seen[0]} {seen[1]} on rank "
                                   f"{where[name]} but {tuple(shape)} {dtype} on rank {rank}: "
                                   f"the ranks disagree on the model's tensors")
    for rank, listing in enumerate(every):
        if not listing["part"]:
            names = {entry[0] for entry in listing["tensors"]}
            lacking = [name for name in found if name not in names]
            if lacking:
                return found, (f"rank {rank} holds a whole model without {lacking[:4]}, which "
                               f"other ranks hold: the ranks disagree on the model's tensors "
                               f"(a model split over ranks sets holds_part_of_model)")
    return found, None


def _allgather_json(comm: MPI.Intracomm, value: Any) -> list[Any]:
    """Every rank's ``value`` (JSON, as bytes: nothing is pickled)."""
    raw = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
    sizes = np.empty(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([raw.size], dtype=np.int64), sizes)
    table = np.empty(int(sizes.sum()), dtype=np.uint8)
    counts = sizes.tolist()
    displs = [sum(counts[:q]) for q in range(len(counts))]
    comm.Allgatherv([raw, MPI.UINT8_T], [table, (counts, displs), MPI.UINT8_T])
    out, at = [], 0
    for n in sizes.tolist():
        out.append(json.loads(table[at:at + n].tobytes()))
        at += n
    return out

