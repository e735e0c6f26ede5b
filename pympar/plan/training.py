"""The parts of a training step around the model: gradient sums, ZeRO, AdamW, and their memory.

Mirrors :func:`pympar.optim.allreduce_gradients` (buckets of at most 25 MiB per dtype, one
all-reduce each), :class:`pympar.zero.ZeroRedundancyOptimizer` (shares from
:func:`pympar.zero.share_rows`, one reduce-scatter and one all-gather per bucket, one check
on the update) and :class:`pympar.optim.AdamW` (two moments per element, one scratch array
per dtype as large as the largest parameter), so that
:func:`optimizer_memory` equals :func:`pympar.memory.optimizer_bytes` and
:func:`~pympar.memory.workspace_bytes` on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..zero import share_rows
from .layers import Param
from .parallel_layers import collective
from .program import Env

__all__ = ["BUCKET_BYTES", "allreduce_gradients", "ZeroPlan", "zero_plan", "zero_copies",
           "zero_step", "adamw_step", "zero_grad", "optimizer_memory"]

#: The default bucket bound of allreduce_gradients and ZeRO (25 MiB).
BUCKET_BYTES = 25 * 2**20


def _buckets(params: list[Param], bound: int) -> list[list[Param]]:
    """allreduce_gradients' buckets: per dtype, consecutive parameters up to ``bound`` bytes."""
    by_size: dict[int, list[Param]] = {}
    for p in params:
        by_size.setdefault(p.itemsize, []).append(p)
    out = []
    for group in by_size.values():
        members: list[Param] = []
        nbytes = 0
        for p in group:
            if members and nbytes + p.nbytes > bound:
                out.append(members)
                members, nbytes = [], 0
            members.append(p)
            nbytes += p.nbytes
        if members:
            out.append(members)
    return out


def allreduce_gradients(env: Env, params: list[Param], role: str, average: bool = False,
                        bound: int = BUCKET_BYTES) -> None:
    """``allreduce_gradients(params, group, average=average)``: nothing on a group of one
    rank, else per bucket: pack, one all-reduce, unpack."""
    if env.site.size(role) == 1:
        return
    for bucket in _buckets(params, bound):
        nbytes = sum(p.nbytes for p in bucket)
        for p in bucket:
            env.compute("bucket", 0, 2 * p.nbytes)
        operation = f"allreduce_gradients {'average' if average else 'sum'}:all_reduce"
        collective(env, role, operation, "all_reduce", nbytes, nbytes)


@dataclass
class ZeroPlan:
    """ZeRO's shares and buckets on one rank.

    Attributes
    ----------
    shares : list of int
        This rank's elements of every parameter.
    widths : list of int
        Per bucket, the largest rank's elements in it (the row of its ``(d, width)`` buffer).
    itemsizes : list of int
        Per bucket, its dtype's item size.
    groups : int
        The group's size ``d``.
    """

    shares: list[int]
    widths: list[int]
    itemsizes: list[int]
    groups: int


# Plans by (shapes, item sizes, d, rank, bound): every layout with the same model-parallel
# part has the same parameters. Bounded: cleared when full.
_PLANS: dict[tuple, ZeroPlan] = {}


def zero_plan(params: list[Param], d: int, me: int, bound: int = BUCKET_BYTES) -> ZeroPlan:
    """The shares and buckets :class:`pympar.zero.ZeroRedundancyOptimizer` makes (float32
    and float64 parameters: no masters)."""
    key = (tuple((p.shape, p.itemsize) for p in params), d, me, bound)
    if key not in _PLANS:
        if len(_PLANS) > 256:
            _PLANS.clear()
        _PLANS[key] = _zero_plan(params, d, me, bound)
    return _PLANS[key]


def _zero_plan(params: list[Param], d: int, me: int, bound: int) -> ZeroPlan:
    rows = np.array(share_rows([p.shape for p in params], d), dtype=np.int64).reshape(-1, d)
    per_row = np.array([p.size // max(p.shape[0], 1) for p in params], dtype=np.int64)
    shares = [int(rows[i, me] * per_row[i]) for i in range(len(params))]
    by_size: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        by_size.setdefault(p.itemsize, []).append(i)
    widths, sizes = [], []
    for itemsize, indices in by_size.items():
        members: list[int] = []
        for i in indices:
            width = sum(params[j].size for j in members) + params[i].size
            if members and d * width * itemsize > bound:
                widths.append(_width(members, rows, per_row, d))
                sizes.append(itemsize)
                members = []
            members.append(i)
        if members:
            widths.append(_width(members, rows, per_row, d))
            sizes.append(itemsize)
    return ZeroPlan(shares, widths, sizes, d)


def _width(members: list[int], rows: np.ndarray, per_row: np.ndarray, d: int) -> int:
    """The largest rank's elements of the bucket ``members``."""
    return int((per_row[members] @ rows[members]).max())


def zero_copies(params: list[Param], plan: ZeroPlan) -> tuple[list[int], list[int], list[int]]:
    """The bytes of each copy ZeRO's step makes on one rank, in three parts: the rows packed
    for the reduce-scatter (``d`` per parameter), each share's gradient copied out and its
    data packed for the all-gather (two per parameter), the other ranks' rows unpacked from
    it (``d - 1`` per parameter). Each is a NumPy slice assignment in a Python loop, so
    each pays a call beside its bytes (``zero`` work, calibrated on ZeRO's own step)."""
    d = plan.groups
    pack, shares, unpack = [], [], []
    for p, share in zip(params, plan.shares):
        pack += [p.nbytes // d] * d
        shares += [share * p.itemsize] * 2
        unpack += [p.nbytes // d] * (d - 1)
    return pack, shares, unpack


def zero_step(env: Env, params: list[Param], role: str) -> ZeroPlan:
    """ZeRO's step: the update's check; the rows packed, a reduce-scatter per bucket; the
    shares copied out, AdamW on them, the shares packed; an all-gather per bucket (known
    extents) and the other ranks' rows unpacked (:func:`zero_copies`)."""
    d, me = env.site.size(role), env.site.rank(role)
    plan = zero_plan(params, d, me)
    pack, shares, unpack = zero_copies(params, plan)
    env.check(role)
    for nbytes in pack:
        env.compute("zero", 0, nbytes)
    for width, itemsize in zip(plan.widths, plan.itemsizes):
        collective(env, role, "ZeroRedundancyOptimizer:reduce_scatter", "reduce_scatter",
                   d * width * itemsize, width * itemsize)
    for share, p in zip(plan.shares, params):
        env.compute("adamw", 0, share * p.itemsize)
    for nbytes in shares:
        env.compute("zero", 0, nbytes)
    for width, itemsize in zip(plan.widths, plan.itemsizes):
        collective(env, role, "ZeroRedundancyOptimizer:all_gather", "all_gather",
                   width * itemsize, d * width * itemsize)
    for nbytes in unpack:
        env.compute("zero", 0, nbytes)
    return plan


def adamw_step(env: Env, params: list[Param]) -> None:
    """AdamW's step: one pass per parameter."""
    for p in params:
        env.compute("adamw", 0, p.nbytes)


def zero_grad(env: Env, params: list[Param]) -> None:
    """``model.zero_grad()``: each gradient filled with zeros."""
    for p in params:
        env.compute("zero_grad", 0, p.nbytes)


def optimizer_memory(params: list[Param], zero: ZeroPlan | None = None) -> dict[str, int]:
    """AdamW's bytes on one rank: ``{"optimizer": moments, "workspace": scratch}``.

    Parameters
    ----------
    params : list of Param
        The parameters it steps.
    zero : ZeroPlan, optional
        Under ZeRO: the moments and scratch are the shares', and the ``(d, width)`` and
        ``width`` buffers of the largest bucket join the workspace.

    Notes
    -----
    AdamW's weight decay scales the parameter in place (decoupled): it needs no scratch.
    """
    sizes = [p.size for p in params] if zero is None else zero.shares
    moments = sum(2 * n * p.itemsize for n, p in zip(sizes, params))
    largest: dict[int, int] = {}
    for n, p in zip(sizes, params):
        largest[p.itemsize] = max(largest.get(p.itemsize, 0), n)
    scratch = sum(n * s for s, n in largest.items())
    if zero is not None:
        # One wide and one narrow buffer per dtype, each sized for the widest bucket of any.
        for itemsize in set(zero.itemsizes):
            scratch += (zero.groups + 1) * max(zero.widths) * itemsize
    return {"optimizer": moments, "workspace": scratch}


def parameter_bytes(params: list[Param]) -> int:
    """Bytes of the parameters (and as much again in their gradients)."""
    return sum(math.prod(p.shape) * p.itemsize for p in params)
