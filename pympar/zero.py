"""Sharded optimizer state (ZeRO stage 1): ``ZeroRedundancyOptimizer``.

Each rank of a data-parallel group of size ``d`` owns a *share* of every parameter: a
contiguous block of rows (of its first axis), possibly empty. The blocks are balanced over the
whole flat state rather than parameter by parameter (:func:`share_rows`): every rank holds
within one row of ``1/d`` of all the elements, a row being that of the widest parameter
(``size / shape[0]``). The wrapped optimizer (e.g. :class:`pympar.optim.AdamW`) runs on the
shares only, so its state costs ``1/d`` of the unsharded one, plus at most that row. A step
reduce-scatters the gradients (instead of all-reducing them), updates the share, and
all-gathers the parameters.

Half-precision parameters (float16, bfloat16) get float32 master weights for their share;
their gradients are reduced in float32 and the update is done on the masters, then rounded
once into the parameters.

The state keeps the plain optimizers' format (``"type"`` is the wrapped class, so ZeRO over
AdamW and AdamW load each other's state): ``state_dict()`` gathers it (collective),
``local_state_dict()`` is this rank's share at ``state_placements()``, which is what
:mod:`pympar.checkpoint` writes and reads, never gathering. A checkpoint holds every array
whole, in the serial layout, so it does not depend on how the shares are cut: checkpoints
written under the earlier row-by-row split load unchanged.

Communication is bucketed: per bucket, a ``(d, width)`` buffer whose row ``k`` holds rank
``k``'s share of every member parameter, so that a single ``reduce_scatter`` / ``all_gather``
along axis 0 (even blocks) moves a whole bucket. ``width`` is the largest rank's total in the
bucket; the shorter rows are zero-padded.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np

from . import manager
from ._optim_state import ShardedStateMixin
from .backend import accumulation_dtype, array_module
from .modules.core import Module, as_parameter_list, check_backward_done
from .modules.parameter import Parameter
from .collectives import agree, label
from .optim import AdamW, Optimizer, flat_label
from .partition import Split

__all__ = ["ZeroRedundancyOptimizer", "default_group", "per_param_state", "share_rows"]


def default_group() -> Any:
    """The group ZeRO shards over: data x context when context parallelism is on, else data.

    Raises
    ------
    RuntimeError
        Before :func:`pympar.manager.initialize_parallel`.
    """
    if manager.get_context_parallel_world_size() > 1:
        return manager.get_data_context_parallel_group()
    return manager.get_data_parallel_group()


def per_param_state(optimizer: Optimizer) -> dict[str, list]:
    """The per-parameter state lists of an optimizer of :mod:`pympar.optim`.

    Every attribute that is a list with one entry per parameter (``exp_avg``, ``exp_avg_sq``,
    ``momentum_buffers``, ``steps``, ...) is state; entries are arrays shaped like the
    parameter, ``None`` or Python scalars.
    """
    n = len(optimizer.params)
    return {name: value for name, value in vars(optimizer).items()
            if name != "params" and isinstance(value, list) and len(value) == n}


def share_rows(shapes: Iterable[tuple[int, ...]], parts: int) -> list[tuple[int, ...]]:
    """How many rows of each parameter every rank's share holds, balanced over all of them.

    Each parameter's rows are dealt as :func:`pympar.partition.balanced_sizes` would, except
    that its ``n % parts`` remainder rows go to the ranks holding the fewest elements so far
    (ties to the lower rank), not always to the first ranks. Rank ``k`` then holds rows
    ``sum(sizes[:k]) .. sum(sizes[:k + 1])`` of the parameter.

    Parameters
    ----------
    shapes : iterable of tuple of int
        The parameters' shapes, in order (each at least 1-d).
    parts : int
        The number of ranks (>= 1).

    Returns
    -------
    list of tuple of int
        Per parameter, the rows of every rank (``parts`` entries adding up to ``shape[0]``).

    Notes
    -----
    Every remainder row goes to a rank with the fewest elements, so the largest and smallest
    totals never differ by more than the widest row (list scheduling): every rank holds
    within one row of ``1/parts`` of the elements. Shapes ``[(9, 8), (7, 8), (5, 8), (3, 8)]``
    over 8 ranks give every rank 3 rows (24 elements), where splitting each parameter by
    itself gives rank 0 five rows of them (21% of the elements, not 12.5%).

    Examples
    --------
    >>> share_rows([(9, 8), (7, 8)], 4)
    [(3, 2, 2, 2), (1, 2, 2, 2)]
    """
    loads = np.zeros(int(parts), dtype=np.int64)
    out = []
    for shape in shapes:
        rows = int(shape[0])
        width = math.prod(shape[1:])
        q, r = divmod(rows, int(parts))
        sizes = np.full(int(parts), q, dtype=np.int64)
        # The r least-loaded ranks (a stable sort: ties to the lower rank) take one row more.
        sizes[np.argsort(loads, kind="stable")[:r]] += 1
        loads += sizes * width
        out.append(tuple(int(n) for n in sizes))
    return out


class _Bucket:
    """Members of one communication bucket and, per rank, where their shares sit in a row."""

    def __init__(self, members: list[int], rows: list[list[tuple[int, int, int]]],
                 width: int, xp: Any, dtype: Any, reduce_dtype: Any, name: str) -> None:
        self.members = members    # parameter indices
        self.rows = rows          # rows[k] = [(param index, flat start in param, size), ...]
        self.width = width        # elements per row (the largest rank's total)
        self.xp, self.dtype, self.reduce_dtype = xp, dtype, reduce_dtype
        # The label of its collectives: ranks whose buckets differ raise instead of mixing.
        self.name = name


class ZeroRedundancyOptimizer(ShardedStateMixin):
    """Shard an optimizer's state over a data-parallel group (ZeRO-1, torch's name and order).

    Use it in place of ``allreduce_gradients`` + optimizer: after backward, :meth:`step`
    reduce-scatters (and averages) the gradients, updates this rank's share of every
    parameter with ``optimizer_class`` and all-gathers the parameters.

    Parameters
    ----------
    params : Module or iterable of Parameter
        The local parameters (tensor-parallel shards included); every rank of ``group`` passes
        the same shapes in the same order. Frozen ones (``requires_grad=False``) are skipped.
    optimizer_class : type, default :class:`pympar.optim.AdamW`
        An optimizer of :mod:`pympar.optim`; it is built on the share-parameters with ``**kw``.
    group : Group, optional
        The group to shard over; default :func:`default_group`.
    bucket_bytes : int, default 25 MiB
        Upper bound on a bucket's ``(d, width)`` buffer (one parameter larger than that gets a
        bucket of its own).
    **kw
        Passed to ``optimizer_class`` (``lr``, ``betas``, ``weight_decay``, ...).

    Attributes
    ----------
    params : list of Parameter
        The model parameters stepped (those frozen at construction left out; one frozen
        later, ``requires_grad = False``, is skipped by :meth:`step`, its state kept).
    shares : list of Parameter
        This rank's share of each parameter, with ``placement`` =
        ``param.placement.then(Split(0, d, rank, sizes=...))``, its rows given by
        :func:`share_rows`. Its ``data`` is a view of the parameter's
        rows, or the float32 master for a half-precision parameter.
    masters : list of bool
        Per parameter, whether its share has a float32 master (half-precision parameters).
    optimizer : Optimizer
        The wrapped optimizer, built on ``shares``; its state is share-sized.
    group : Group
    takes_grad_scale : bool
        True: :meth:`step` accepts ``grad_scale`` (used by :class:`pympar.amp.GradScaler`
        to unscale in float32).

    Raises
    ------
    ValueError
        For a 0-d parameter (it has no first axis to share), ``bucket_bytes < 1``, or ranks
        of ``group`` passing different shapes or dtypes (raised on every rank).

    Notes
    -----
    Float32 masters are copied from the parameters at construction and by
    :meth:`load_state_dict` (from its ``"master"`` entries, else from the parameters): load
    model weights before building the optimizer, or reload its state afterwards.
    """

    takes_grad_scale = True

    def __init__(self, params: Module | Iterable[Parameter], optimizer_class: type = AdamW,
                 group: Any = None, *, bucket_bytes: int = 25 * 2**20, **kw: Any) -> None:
        self.group = default_group() if group is None else group
        self.params = [p for p in as_parameter_list(params) if p.requires_grad]
        refusal = None
        if bucket_bytes < 1:
            refusal = f"bucket_bytes must be >= 1, got {bucket_bytes}"
        for p in self.params:
            if p.data.ndim == 0 and refusal is None:
                refusal = (f"parameter {p.name or ''} is 0-d; it has no first axis to share "
                           "(make it shape (1,))")
        # Shares and buckets are planned from the shapes: ranks that disagree would pair
        # mismatched collectives, so they all raise here instead, as for one rank's refusal.
        mine = [(p.shape, str(p.dtype)) for p in self.params]
        gathered = self.group.comm.allgather((refusal, mine))
        refused = [(k, text) for k, (text, _) in enumerate(gathered) if text is not None]
        if refused:
            k, text = refused[0]
            whose = "" if k == self.group.rank else f"rank {k} of group {self.group.name}: "
            raise ValueError(f"ZeroRedundancyOptimizer: {whose}{text}")
        others = [shapes for _, shapes in gathered]
        if any(o != mine for o in others):
            bad = [k for k, o in enumerate(others) if o != others[0]]
            raise ValueError(f"ZeroRedundancyOptimizer: the ranks of group {self.group.name} "
                             f"pass different parameters (shapes or dtypes differ from rank 0's "
                             f"on ranks {bad})")
        d = self.group.size
        # Every rank's share of every parameter: its rows, as a slice of the first axis.
        self._sizes = share_rows([p.shape for p in self.params], d)
        self._rows = [_slices(sizes) for sizes in self._sizes]
        self.masters = [accumulation_dtype(p.dtype) != p.dtype for p in self.params]
        self.shares = [self._make_share(i, p) for i, p in enumerate(self.params)]
        self._buckets = self._plan(int(bucket_bytes))
        # Float32 gradient shares of half-precision parameters: the reduce-scatter writes them
        # here directly (one flat array per bucket), the share-parameters' grads are views.
        self._grad_flats: dict[int, Any] = {
            b: bucket.xp.zeros(bucket.width, dtype=bucket.reduce_dtype)
            for b, bucket in enumerate(self._buckets) if self.masters[bucket.members[0]]}
        self._bind_master_grads()
        self._scratch: dict[tuple, Any] = {}
        self._ones = (1,) * d
        self.optimizer = optimizer_class(self.shares, **kw)

    # -- construction ------------------------------------------------------------------
    def _make_share(self, i: int, p: Parameter) -> Parameter:
        d, me = self.group.size, self.group.rank
        rows = self._rows[i][me]
        placement = p.placement.then(Split(0, d, me, sizes=self._sizes[i]))
        if self.masters[i]:
            data = p.data[rows].astype(accumulation_dtype(p.dtype))
        else:
            data = p.data[rows]
        return Parameter(data, name=p.name, placement=placement)

    def _plan(self, bucket_bytes: int) -> list[_Bucket]:
        d = self.group.size
        by_key: dict[tuple, list[int]] = {}
        for i, p in enumerate(self.params):
            by_key.setdefault((array_module(p.data), p.dtype), []).append(i)
        buckets = []
        for (xp, dtype), indices in by_key.items():
            reduce_dtype = accumulation_dtype(dtype)
            members: list[int] = []
            for i in indices:
                width = sum(self.params[j].size for j in members) + self.params[i].size
                if members and d * width * reduce_dtype.itemsize > bucket_bytes:
                    buckets.append(self._bucket(members, xp, dtype, reduce_dtype))
                    members = []
                members.append(i)
            if members:
                buckets.append(self._bucket(members, xp, dtype, reduce_dtype))
        return buckets

    def _bucket(self, members: list[int], xp: Any, dtype: Any, reduce_dtype: Any) -> _Bucket:
        rows = []
        for k in range(self.group.size):
            layout, offset = [], 0
            for i in members:
                p, mine = self.params[i], self._rows[i][k]
                size = (mine.stop - mine.start) * (p.size // max(p.shape[0], 1))
                layout.append((i, offset, size))
                offset += size
            rows.append(layout)
        width = max(sum(size for _, _, size in row) for row in rows)
        return _Bucket(members, rows, width, xp, dtype, reduce_dtype,
                       flat_label("ZeroRedundancyOptimizer", [self.params[i] for i in members]))

    def _bind_master_grads(self) -> None:
        me = self.group.rank
        for b, flat in self._grad_flats.items():
            for i, offset, size in self._buckets[b].rows[me]:
                self.shares[i].grad = flat[offset: offset + size].reshape(self.shares[i].shape)

    def _buffer(self, role: str, xp: Any, dtype: Any, shape: tuple[int, ...]) -> Any:
        # One flat scratch array per (role, module, dtype), grown to the largest bucket.
        n = 1
        for s in shape:
            n *= s
        key = (role, xp, dtype)
        flat = self._scratch.get(key)
        if flat is None or flat.size < n:
            largest = max(self.group.size * b.width if role == "wide" else b.width
                          for b in self._buckets if b.xp is xp)
            flat = self._scratch[key] = xp.empty(max(n, largest), dtype=dtype)
        return flat[:n].reshape(shape)

    # -- optimizer interface -----------------------------------------------------------
    @property
    def lr(self) -> float:
        """float: The wrapped optimizer's learning rate (settable, for schedules)."""
        return self.optimizer.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.optimizer.lr = float(value)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Reset the model parameters' gradients; see :meth:`pympar.modules.Parameter.zero_grad`."""
        for p in self.params:
            p.zero_grad(set_to_none)

    def step(self, grad_scale: float = 1.0) -> None:
        """Reduce-scatter and average the gradients, update this rank's shares, all-gather.

        Parameters
        ----------
        grad_scale : float, default 1.0
            Factor applied to the averaged gradients (in float32 for half-precision
            parameters) before the update, e.g. ``1 / loss_scale``.
        """
        grad_scale = float(grad_scale)
        check_backward_done(self.params, self.group, "ZeroRedundancyOptimizer.step")  # debug
        self._agree_on_update(grad_scale)
        for b, bucket in enumerate(self._buckets):
            self._reduce_scatter(b, bucket, grad_scale)
        # A parameter frozen since construction is skipped, as the plain optimizers skip it:
        # its share keeps its data and its optimizer state stops moving.
        for p, share in zip(self.params, self.shares):
            share.requires_grad = p.requires_grad
        self.optimizer.step()
        for bucket in self._buckets:
            self._all_gather(bucket)

    def _agree_on_update(self, grad_scale: float) -> None:
        """One agreement check per step on what the update uses besides the gradients.

        Each rank updates its own share: a learning rate (or betas, eps, weight decay,
        gradient scale, the set of parameters frozen since construction) that differs on one
        rank would silently give its rows another
        update, which no collective's shape shows. A check rather than a label: under a
        schedule the values change every step, and every label ever used is kept.
        """
        opt = self.optimizer
        frozen = tuple(i for i, p in enumerate(self.params) if not p.requires_grad)
        names = ("grad_scale", *opt.hyperparameter_names, "frozen")
        values = (grad_scale, *(getattr(opt, name) for name in opt.hyperparameter_names),
                  frozen)
        shown = ", ".join(f"{n}={v!r}" for n, v in zip(names, values))
        agree(self.group, ("ZeroRedundancyOptimizer.step", type(opt).__name__, values),
              f"ZeroRedundancyOptimizer.step({type(opt).__name__}: {shown})")

    def _reduce_scatter(self, b: int, bucket: _Bucket, grad_scale: float) -> None:
        d, me = self.group.size, self.group.rank
        send = self._buffer("wide", bucket.xp, bucket.reduce_dtype, (d, bucket.width))
        for k in range(d):
            row = send[k]
            end = 0
            for i, offset, size in bucket.rows[k]:
                g = self.params[i].grad
                if g is None:
                    row[offset: offset + size] = 0
                else:
                    row[offset: offset + size] = g[self._rows[i][k]].reshape(-1)
                end = offset + size
            row[end:] = 0
        if b in self._grad_flats:
            out = self._grad_flats[b].reshape(1, bucket.width)
            self._reduce(bucket, send, out, grad_scale)
            return
        out = self._buffer("narrow", bucket.xp, bucket.reduce_dtype, (1, bucket.width))
        self._reduce(bucket, send, out, grad_scale)
        flat = out[0]
        for i, offset, size in bucket.rows[me]:
            p, share = self.params[i], self.shares[i]
            if p.grad is None:
                p.grad = bucket.xp.zeros_like(p.data)
            # Rebinding each step follows a gradient that zero_grad(set_to_none=True) replaced.
            rows = self._rows[i][me]
            share.grad = p.grad[rows]
            share.data = p.data[rows]
            share.grad[...] = flat[offset: offset + size].reshape(share.grad.shape)

    def _reduce(self, bucket: _Bucket, send: Any, out: Any, grad_scale: float) -> None:
        with label(bucket.name):
            self.group.reduce_scatter(send, axis=0, out=out)
        if grad_scale != 1.0:
            out *= grad_scale
        # Divide (not multiply by 1/d) to round as allreduce_gradients(average=True) does.
        if self.group.size > 1:
            out /= self.group.size

    def _all_gather(self, bucket: _Bucket) -> None:
        d, me = self.group.size, self.group.rank
        send = self._buffer("narrow", bucket.xp, bucket.dtype, (1, bucket.width))
        row = send[0]
        for i, offset, size in bucket.rows[me]:
            row[offset: offset + size] = self.shares[i].data.reshape(-1)
        row[sum(size for _, _, size in bucket.rows[me]):] = 0
        recv = self._buffer("wide", bucket.xp, bucket.dtype, (d, bucket.width))
        # Known extents (one row per rank) spare the collective its size exchange.
        with label(bucket.name):
            self.group.all_gather(send, axis=0, out=recv, sizes=self._ones)
        own_rows_updated = not self.masters[bucket.members[0]]
        for k in range(d):
            if k == me and own_rows_updated:
                continue
            for i, offset, size in bucket.rows[k]:
                target = self.params[i].data[self._rows[i][k]]
                target[...] = recv[k, offset: offset + size].reshape(target.shape)


def _slices(sizes: tuple[int, ...]) -> list[slice]:
    """Consecutive slices of the given extents."""
    ends = np.cumsum((0, *sizes))
    return [slice(int(a), int(b)) for a, b in zip(ends[:-1], ends[1:])]
