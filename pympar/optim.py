"""Optimizers with torch semantics, and bucketed data-parallel gradient all-reduce.

Updates are in place on ``Parameter.data``; optimizer state is allocated once at construction
in the parameter's array module (NumPy or CuPy) and dtype. Parameters whose ``grad`` is
``None``, and frozen parameters (``requires_grad=False``), are skipped by ``step``.

``state_dict()`` / ``load_state_dict()`` follow torch's spirit: a plain dict with the
optimizer's type, its hyperparameters and, per parameter position, the step count and the
moment arrays (shaped like the parameter's shard). Loading checks everything before it
changes anything.
"""

from __future__ import annotations

import math
import weakref
import zlib
from collections import OrderedDict
from typing import Any, Iterable, Union

from pympar._optim_state import StateDictMixin
from pympar.backend import accumulation_dtype, array_module
from pympar.collectives import label
from pympar.modules.core import Module, as_parameter_list, check_backward_done
from pympar.modules.parameter import Parameter

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "allreduce_gradients", "flat_label"]

ParamsLike = Union[Module, Iterable[Parameter]]


class Optimizer(StateDictMixin):
    """Base class: holds a de-duplicated parameter list and per-dtype scratch buffers.

    Parameters
    ----------
    params : Module or iterable of Parameter
        What to optimize; a module contributes ``module.parameters()``.
    lr : float
        Learning rate; the attribute ``lr`` may be changed between steps (schedules).
    """

    def __init__(self, params: ParamsLike, lr: float) -> None:
        if lr < 0.0:
            raise ValueError(f"{type(self).__name__}: lr must be >= 0, got {lr}")
        self.params = as_parameter_list(params)
        self.lr = float(lr)
        # Scratch space: flat buffers per (module, dtype) sized for the largest parameter,
        # created on first use and reused by every later step.
        self._scratch_sizes: dict[tuple, int] = {}
        for p in self.params:
            key = _key(p.data)
            self._scratch_sizes[key] = max(p.size, self._scratch_sizes.get(key, 0))
        self._scratch: dict[tuple, Any] = {}

    def _scratch_for(self, p: Parameter, which: int = 0) -> Any:
        key = _key(p.data)
        flat = self._scratch.get((key, which))
        if flat is None:
            xp, dtype = key
            flat = self._scratch[(key, which)] = xp.empty(self._scratch_sizes[key], dtype=dtype)
        return flat[: p.size].reshape(p.data.shape)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Reset every parameter's gradient; see :meth:`pympar.modules.Parameter.zero_grad`."""
        for p in self.params:
            p.zero_grad(set_to_none)

    def step(self) -> None:
        """Apply one update to every parameter that has a gradient."""
        raise NotImplementedError


def _key(a: Any) -> tuple:
    return array_module(a), a.dtype


def _zeros_like(a: Any) -> Any:
    return array_module(a).zeros_like(a)


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum and L2 weight decay (torch semantics).

    ``g = grad + weight_decay * p``; with momentum, ``buf = g`` on a parameter's first step and
    ``buf = momentum * buf + g`` afterwards, then ``p -= lr * buf``; without, ``p -= lr * g``.

    Parameters
    ----------
    params : Module or iterable of Parameter
    lr : float
    momentum : float, default 0.0
    weight_decay : float, default 0.0
    """

    def __init__(self, params: ParamsLike, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, lr)
        if momentum < 0.0 or weight_decay < 0.0:
            raise ValueError("SGD: momentum and weight_decay must be >= 0")
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.momentum_buffers = [_zeros_like(p.data) if momentum else None for p in self.params]
        self.steps = [0] * len(self.params)

    hyperparameter_names = ("lr", "momentum", "weight_decay")

    @property
    def state_keys(self) -> tuple[str, ...]:  # type: ignore[override]
        """tuple of str: ``("momentum_buffer",)`` with momentum, else empty."""
        return ("momentum_buffer",) if self.momentum else ()

    def _moments(self, key: str) -> list[Any]:
        return self.momentum_buffers

    def _check_hyperparameters(self, hyper: dict[str, Any]) -> dict[str, Any]:
        out = super()._check_hyperparameters(hyper)
        for name in ("momentum", "weight_decay"):
            value = hyper[name]
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"SGD.load_state_dict: {name} must be a number >= 0, got "
                                 f"{value!r}")
            out[name] = float(value)
        if bool(out["momentum"]) != bool(self.momentum):
            raise ValueError(f"SGD.load_state_dict: momentum {out['momentum']} cannot replace "
                             f"{self.momentum} (momentum buffers exist only with momentum > 0)")
        return out

    def step(self) -> None:
        """Apply one SGD update."""
        for i, p in enumerate(self.params):
            if p.grad is None or not p.requires_grad:
                continue
            xp = array_module(p.data)
            g = p.grad
            if self.weight_decay:
                g = self._scratch_for(p, 1)
                xp.multiply(p.data, self.weight_decay, out=g)
                g += p.grad
            if self.momentum:
                buf = self.momentum_buffers[i]
                if self.steps[i] == 0:
                    buf[...] = g
                else:
                    buf *= self.momentum
                    buf += g
                g = buf
            update = self._scratch_for(p, 0)
            xp.multiply(g, self.lr, out=update)
            p.data -= update
            self.steps[i] += 1


class Adam(Optimizer):
    """Adam with L2 weight decay added to the gradient (torch ``Adam`` semantics).

    With ``g = grad + weight_decay * p``: ``m = b1 m + (1 - b1) g``,
    ``v = b2 v + (1 - b2) g^2``, and with ``t`` the parameter's step count,
    ``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``.

    Parameters
    ----------
    params : Module or iterable of Parameter
    lr : float, default 1e-3
    betas : (float, float), default (0.9, 0.999)
    eps : float, default 1e-8
    weight_decay : float, default 0.0
    """

    decoupled = False

    def __init__(self, params: ParamsLike, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, lr)
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"{type(self).__name__}: betas must lie in [0, 1), got {betas}")
        if eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"{type(self).__name__}: eps and weight_decay must be >= 0")
        self.betas = (float(b1), float(b2))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.exp_avg = [_zeros_like(p.data) for p in self.params]
        self.exp_avg_sq = [_zeros_like(p.data) for p in self.params]
        self.steps = [0] * len(self.params)

    state_keys = ("exp_avg", "exp_avg_sq")
    hyperparameter_names = ("lr", "betas", "eps", "weight_decay")

    def _check_hyperparameters(self, hyper: dict[str, Any]) -> dict[str, Any]:
        out = super()._check_hyperparameters(hyper)
        where = f"{type(self).__name__}.load_state_dict"
        betas = hyper["betas"]
        if (not isinstance(betas, tuple) or len(betas) != 2
                or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"{where}: betas must be two numbers in [0, 1), got {betas!r}")
        out["betas"] = (float(betas[0]), float(betas[1]))
        for name in ("eps", "weight_decay"):
            value = hyper[name]
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{where}: {name} must be a number >= 0, got {value!r}")
            out[name] = float(value)
        return out

    def step(self) -> None:
        """Apply one Adam (or AdamW) update."""
        b1, b2 = self.betas
        for i, p in enumerate(self.params):
            if p.grad is None or not p.requires_grad:
                continue
            xp = array_module(p.data)
            self.steps[i] += 1
            t = self.steps[i]
            g = p.grad
            if self.weight_decay and self.decoupled:
                p.data *= 1.0 - self.lr * self.weight_decay
            elif self.weight_decay:
                g = self._scratch_for(p, 1)
                xp.multiply(p.data, self.weight_decay, out=g)
                g += p.grad
            m, v, s = self.exp_avg[i], self.exp_avg_sq[i], self._scratch_for(p, 0)
            m *= b1
            xp.multiply(g, 1.0 - b1, out=s)
            m += s
            v *= b2
            xp.multiply(g, g, out=s)
            s *= 1.0 - b2
            v += s
            # s = sqrt(v) / sqrt(1 - b2^t) + eps, then the step m / s scaled by lr / (1 - b1^t).
            xp.sqrt(v, out=s)
            s /= math.sqrt(1.0 - b2**t)
            s += self.eps
            xp.divide(m, s, out=s)
            s *= self.lr / (1.0 - b1**t)
            p.data -= s


class AdamW(Adam):
    """Adam with decoupled weight decay (torch ``AdamW`` semantics).

    Before the Adam step, ``p *= 1 - lr * weight_decay``; the gradient is not modified.
    Parameters are those of :class:`Adam`, with ``weight_decay`` 0.01 by default.
    """

    decoupled = True

    def __init__(self, params: ParamsLike, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        super().__init__(params, lr, betas, eps, weight_decay)


class _Buckets:
    """Flat communication buffers for one parameter list, grouped by (array module, dtype).

    Half-precision gradients are packed into float32 buffers: the all-reduce sums them in
    float32 anyway, and the average must be taken before the one rounding back (a sum
    past 65504 whose mean fits would round to inf first).
    """

    def __init__(self, params: list[Parameter], bucket_bytes: int) -> None:
        self.refs = [weakref.ref(p) for p in params]
        self.shapes = [p.shape for p in params]
        # Each bucket: (flat buffer, [(param index, offset, size), ...], its labels when
        # summing and when averaging: ``average`` changes the result, so it is compared too).
        self.buckets: list[tuple[Any, list[tuple[int, int, int]], tuple[str, str]]] = []
        by_key: "OrderedDict[tuple, list[int]]" = OrderedDict()
        for i, p in enumerate(params):
            by_key.setdefault(_key(p.data), []).append(i)
        for (xp, dtype), indices in by_key.items():
            members: list[int] = []
            nbytes = 0
            for i in indices:
                size = params[i].size * dtype.itemsize
                if members and nbytes + size > bucket_bytes:
                    self._add(xp, dtype, params, members)
                    members, nbytes = [], 0
                members.append(i)
                nbytes += size
            if members:
                self._add(xp, dtype, params, members)

    def _add(self, xp: Any, dtype: Any, params: list[Parameter], members: list[int]) -> None:
        layout, offset = [], 0
        for i in members:
            layout.append((i, offset, params[i].size))
            offset += params[i].size
        flat = xp.empty(offset, dtype=accumulation_dtype(dtype))
        name = flat_label("allreduce_gradients", [params[i] for i in members])
        self.buckets.append((flat, layout, (f"{name} sum", f"{name} average")))

    def matches(self, params: list[Parameter]) -> bool:
        return len(params) == len(self.refs) and all(
            r() is p and p.shape == s for r, p, s in zip(self.refs, params, self.shapes)
        )


# Small cache: one entry per distinct parameter list (typically one per model).
_BUCKET_CACHE: "OrderedDict[tuple, _Buckets]" = OrderedDict()
_BUCKET_CACHE_SIZE = 8


def _buckets_for(params: list[Parameter], bucket_bytes: int) -> _Buckets:
    key = (tuple(id(p) for p in params), int(bucket_bytes))
    cached = _BUCKET_CACHE.get(key)
    if cached is None or not cached.matches(params):
        cached = _Buckets(params, bucket_bytes)
        _BUCKET_CACHE[key] = cached
    _BUCKET_CACHE.move_to_end(key)
    while len(_BUCKET_CACHE) > _BUCKET_CACHE_SIZE:
        _BUCKET_CACHE.popitem(last=False)
    return cached


def allreduce_gradients(module_or_params: ParamsLike, group: Any,
                        bucket_bytes: int = 25 * 2**20, average: bool = True) -> None:
    """Sum (or average) every parameter gradient over ``group``, in a few large messages.

    Gradients are packed into contiguous buckets of at most ``bucket_bytes`` (one parameter
    larger than that gets a bucket of its own), one set per (array module, dtype), reduced with
    ``group.all_reduce(bucket, op="sum", out=bucket)`` and copied back. Buckets are cached per
    parameter list and reused across calls.

    Parameters
    ----------
    module_or_params : Module or iterable of Parameter
        Every rank of ``group`` must pass the same parameters in the same order.
    group : Group or None
        The data-parallel group. ``None`` or a group of size 1 returns at once.
    bucket_bytes : int, default 25 MiB
        Upper bound on a bucket's gradients, in their own dtype's bytes (a bucket of
        half-precision gradients is reduced in float32: twice that).
    average : bool, default True
        Divide the sum by ``group.size`` (in float32 for half-precision gradients, before
        they are rounded back).

    Notes
    -----
    A parameter whose ``grad`` is ``None`` contributes zeros, and receives the reduced gradient,
    so that every rank sends identically shaped buckets even when a parameter went unused
    on some rank. Frozen parameters (``requires_grad=False``) are left out entirely.
    Each bucket's all-reduce runs under a label with a checksum of its members' layout
    (:func:`flat_label`) and ``average``: ranks passing other parameters, or another order,
    or another ``average``, raise :class:`~pympar.debug.CollectiveMismatchError` instead of
    mixing gradients.
    """
    check_backward_done(module_or_params, group, "allreduce_gradients")  # debug mode only
    if group is None or group.size == 1:
        return
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    params = [p for p in as_parameter_list(module_or_params) if p.requires_grad]
    state = _buckets_for(params, bucket_bytes)
    for flat, layout, names in state.buckets:
        _pack(flat, [params[i] for i, _, _ in layout])
        # Ranks whose buckets hold other parameters, or that average where others sum,
        # raise here.
        with label(names[bool(average)]):
            reduced = group.all_reduce(flat, op="sum", out=flat)
        if reduced is not flat:
            flat[...] = reduced
        if average:
            flat /= group.size
        for i, offset, size in layout:
            p = params[i]
            chunk = flat[offset: offset + size].reshape(p.data.shape)
            if p.grad is None:
                p.grad = chunk.astype(p.data.dtype)  # a copy
            else:
                p.grad[...] = chunk


def flat_label(what: str, params: Iterable[Parameter]) -> str:
    """A label for a flat buffer of ``params``: ``what`` and a checksum of their layout.

    The checksum (CRC-32) covers every parameter's global shape (from its placement),
    local shape, dtype and name, in order, so two ranks packing different parameters, or
    the same ones in another order, into buffers of equal size raise in the collective's
    agreement check instead of mixing gradients. Built once per buffer. Two parameters
    alike in all four (say the weights of two equal layers, both named ``"weight"``)
    cannot be told apart: their order is the caller's to keep.

    Parameters
    ----------
    what : str
        The operation, e.g. ``"allreduce_gradients"``.
    params : iterable of Parameter
        The buffer's members, in packing order.

    Returns
    -------
    str
        E.g. ``"allreduce_gradients[3 params, layout 1c2f9e0a]"``.
    """
    layout = [(p.placement.shape, p.shape, p.dtype.str, p.name) for p in params]
    return f"{what}[{len(layout)} params, layout {zlib.crc32(repr(layout).encode()):08x}]"


def _pack(flat: Any, params: list[Parameter]) -> None:
    xp = array_module(flat)
    if all(p.grad is not None for p in params):
        # One call fills the bucket without per-parameter Python slicing.
        xp.concatenate([p.grad.reshape(-1) for p in params], out=flat)
        return
    offset = 0
    for p in params:
        if p.grad is None:
            flat[offset: offset + p.size] = 0
        else:
            flat[offset: offset + p.size] = p.grad.reshape(-1)
        offset += p.size
