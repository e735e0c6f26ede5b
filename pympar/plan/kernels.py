"""This machine's local work, measured on one rank: the layers' own code, in whole models.

A layer timed alone runs with its arrays in cache and its memory reused, faster than inside a
model's step (30 % here). So the layers are timed where they work: a transformer (layer norm,
attention, a Column -> GELU -> Row MLP) and an FNO (spectral blocks) of sizes around the
examples' on 1 to 8 ranks run whole forward and backward passes, and every layer's own
seconds (its sub-layers' taken out) are summed per kind, beside the
:class:`~pympar.plan.program.Work` their descriptions (:mod:`pympar.plan.layers`) emit for
the same sizes. The few NumPy lines of a step (residual adds, the loss, AdamW, the gradient
buckets) are timed alone, as the median of repeats. Per kind of work, :func:`fit` finds
``seconds = a * pieces + b * FLOPs + c * bytes`` with ``a, b, c >= 0`` by least squares; a
sample that also holds work of kinds fitted before is fitted on what remains of its time.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from typing import Any, Callable

import numpy as np

from .layers import GELU as GELUPlan, LayerNorm as LayerNormPlan, Linear as LinearPlan
from .layers import Sequential as Chain
from .models import Layout
from .parallel_layers import ContextAttention as AttentionPlan, SpectralBlock
from .presets import BurgersModel, FNOModel
from .program import Env, Work

__all__ = ["Sample", "chain_samples", "numpy_samples", "fit", "measure"]

Sample = tuple[list[Work], float]


def _median_seconds(run: Callable[[], Any], setup: Callable[[], Any] | None = None,
                    repeats: int = 9) -> float:
    """Median seconds of ``run()`` (``setup()`` untimed before each)."""
    times = []
    for _ in range(repeats + 1):
        if setup is not None:
            setup()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def numpy_samples(repeats: int = 9) -> list[Sample]:
    """The step's own NumPy lines, timed alone: residual adds, the loss, copies, AdamW,
    zero_grad, the gradient buckets' packing, ZeRO's copies (last: they free arrays of
    megabytes)."""
    from ..modules import Linear
    from ..optim import AdamW
    out: list[Sample] = []
    for n in (4096, 65536, 262144, 1048576):
        a, b = np.ones(n, np.float32), np.ones(n, np.float32)
        out.append(([Work("add", 0, 4 * n)], _median_seconds(lambda: a + b, repeats=repeats)))
        out.append(([Work("copy", 0, 4 * n)], _median_seconds(a.copy, repeats=repeats)))

        def loss() -> None:
            err = a - b
            np.dot(err, err)
            err *= np.float32(0.5)
        out.append(([Work("elementwise", 0, 12 * n)], _median_seconds(loss, repeats=repeats)))
    for count, size in ((4, 64), (16, 4096), (8, 65536), (32, 1024)):
        params = [p for _ in range(count) for p in Linear(size, 1).parameters()[:1]]
        for p in params:
            p.grad = np.ones_like(p.data)
        opt = AdamW(params, lr=1e-3, weight_decay=0.0)
        nbytes = [p.data.nbytes for p in params]
        out.append(([Work("adamw", 0, n) for n in nbytes], _median_seconds(opt.step,
                                                                         repeats=repeats)))
        out.append(([Work("zero_grad", 0, n) for n in nbytes], _median_seconds(
            lambda: [p.zero_grad() for p in params], repeats=repeats)))
        flat = np.empty(sum(p.size for p in params), np.float32)

        def pack() -> None:
            offset = 0
            for p in params:
                flat[offset:offset + p.size] = p.grad.reshape(-1)
                p.grad[...] = flat[offset:offset + p.size].reshape(p.grad.shape)
                offset += p.size
        out.append(([Work("bucket", 0, 2 * n) for n in nbytes], _median_seconds(
            pack, repeats=repeats)))
        out.append(_zero_sample(params, repeats))
    return out


def _zero_sample(params: list[Any], repeats: int) -> Sample:
    """ZeRO's step on a group of one rank, its inner AdamW step taken out: its copies
    (:func:`~pympar.plan.training.zero_copies`), with the Python and the size-one
    collectives around them."""
    from ..group import self_group
    from ..optim import AdamW
    from ..zero import ZeroRedundancyOptimizer
    from .layers import Param
    from .training import zero_copies, zero_plan
    zero = ZeroRedundancyOptimizer(params, AdamW, group=self_group(), lr=1e-3, weight_decay=0.0)
    inner, spent = zero.optimizer.step, [0.0]

    def timed_inner() -> None:
        start = time.perf_counter()
        inner()
        spent[0] += time.perf_counter() - start
    zero.optimizer.step = timed_inner

    def copies() -> float:
        spent[0] = 0.0
        start = time.perf_counter()
        zero.step()
        return time.perf_counter() - start - spent[0]
    seconds = statistics.median([copies() for _ in range(repeats + 1)][1:])
    described = [Param(p.name or "", tuple(p.shape), p.data.itemsize) for p in params]
    parts = zero_copies(described, zero_plan(described, 1, 0))
    return [Work("zero", 0, n) for part in parts for n in part], seconds


@contextlib.contextmanager
def _timed_layers(totals: dict[str, float]):
    """Inside: every forward and backward of pympar's layers adds its own seconds (its
    sub-layers' taken out) to ``totals[kind + "." + direction]``."""
    from ..modules import (GELU, ColumnParallelLinear, ContextAttention, LayerNorm, Linear,
                           RowParallelLinear)
    from ..modules.fno import SpectralBlock as Block
    from ..modules.spectral import SpectralConv
    kinds = {Linear: "linear", ColumnParallelLinear: "linear", RowParallelLinear: "linear",
             LayerNorm: "layernorm", GELU: "gelu", ContextAttention: "attention",
             SpectralConv: "spectral", Block: "add"}
    inner: list[float] = []
    saved = []
    for cls, kind in kinds.items():
        for direction in ("forward", "backward"):
            original = cls.__dict__[direction]

            def timed(self, *args, _run=original, _key=f"{kind}.{direction}", **kw):
                start = time.perf_counter()
                inner.append(0.0)
                try:
                    return _run(self, *args, **kw)
                finally:
                    took, nested = time.perf_counter() - start, inner.pop()
                    totals[_key] = totals.get(_key, 0.0) + took - nested
                    if inner:
                        inner[-1] += took
            saved.append((cls, direction, original))
            setattr(cls, direction, timed)
    try:
        yield
    finally:
        for cls, direction, original in saved:
            setattr(cls, direction, original)


def _in_context(net: Any, x: np.ndarray, plan: Any, env: Env, steps: int) -> list[Sample]:
    """The layers of ``net`` timed inside whole forward and backward passes of it on ``x``
    (per kind, the median over ``steps`` passes), beside the work its description ``plan``
    emits for one."""
    y = net.forward(x)
    dy = np.ones_like(y)
    net.backward(dy)
    passes: list[dict[str, float]] = []
    for _ in range(steps):
        totals: dict[str, float] = {}
        with _timed_layers(totals):
            net.forward(x)
            net.backward(dy)
        passes.append(totals)
    plan.backward(env, plan.forward(env, env.array(x.shape)))
    out, done = [], env.work
    for kind in passes[0]:
        work = [w for w in done if w.kind == kind]
        if work:
            out.append((work, statistics.median(p[kind] for p in passes)))
    return out


def chain_samples(steps: int = 15) -> list[Sample]:
    """The layers of a transformer and of an FNO at sizes around the examples' on 1-8 ranks,
    timed inside whole forward and backward passes (where the examples are not at hand:
    :mod:`pympar.plan.in_examples` times them inside the examples themselves)."""
    from ..group import self_group
    from ..modules import (GELU, ColumnParallelLinear, ContextAttention, LayerNorm, Linear,
                           RowParallelLinear, Sequential)
    from ..modules.fno import SpectralBlock as Block
    # The layers first: the NumPy samples free arrays of megabytes, after which glibc serves
    # such arrays from its heap instead of fresh pages (a step 25 % faster than the
    # examples', whose arrays are not that large).
    out: list[Sample] = []
    alone, hidden = self_group(), 64
    for n, b, heads, ffn in ((64, 16, 4, 256), (64, 8, 4, 256), (32, 16, 4, 256),
                             (64, 16, 2, 256), (64, 16, 4, 128), (64, 4, 4, 256),
                             (16, 16, 4, 256), (32, 8, 2, 128)):
        layers, plans = [Linear(3, hidden, input_grad=False)], [LinearPlan(3, hidden, True,
                                                                          False)]
        for _ in range(2):
            layers += [LayerNorm(hidden), ContextAttention(hidden, heads, "ring", group=alone),
                       LayerNorm(hidden), ColumnParallelLinear(hidden, ffn, gather_output=False,
                                                               group=alone), GELU(),
                       RowParallelLinear(ffn, hidden, input_is_parallel=True, group=alone)]
            plans += [LayerNormPlan(hidden), AttentionPlan(hidden, heads, n),
                      LayerNormPlan(hidden), LinearPlan(hidden, ffn), GELUPlan(),
                      LinearPlan(ffn, hidden)]
        layers += [LayerNorm(hidden), Linear(hidden, 1)]
        plans += [LayerNormPlan(hidden), LinearPlan(hidden, 1)]
        x = np.random.default_rng(0).standard_normal((n, b, 3)).astype(np.float32)
        out += _in_context(Sequential(*layers), x, Chain(*plans),
                           Env(BurgersModel().site(Layout(), 0), 4), steps)
    for b, n1, width, modes in ((8, 32, 16, 8), (4, 32, 16, 8), (2, 32, 16, 8),
                                (8, 16, 16, 8), (8, 32, 16, 4), (4, 16, 16, 4)):
        layers = [Linear(3, width, input_grad=False),
                  *(Block(width, modes, activation=i < 2, seed=i) for i in range(3)),
                  Linear(width, 4 * width), GELU(), Linear(4 * width, 1)]
        plans = [LinearPlan(3, width, True, False),
                 *(SpectralBlock(width, (modes, modes), (n1, 32), i < 2) for i in range(3)),
                 LinearPlan(width, 4 * width), GELUPlan(), LinearPlan(4 * width, 1)]
        x = np.random.default_rng(0).standard_normal((b, n1, 32, 3)).astype(np.float32)
        out += _in_context(Sequential(*layers), x, Chain(*plans),
                           Env(FNOModel().site(Layout(), 0), 4), steps)
    return out


def _nnls3(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients, over the subsets of the columns."""
    best, best_error = np.zeros(features.shape[1]), float(np.sum(target ** 2))
    for k in range(1, features.shape[1] + 1):
        for cols in itertools.combinations(range(features.shape[1]), k):
            sub = features[:, cols]
            scale = np.maximum(np.abs(sub).max(axis=0), 1e-300)
            coef = np.linalg.lstsq(sub / scale, target, rcond=None)[0] / scale
            if np.all(coef >= 0):
                error = float(np.sum(((sub @ coef - target) / np.maximum(target, 1e-6)) ** 2))
                full = np.zeros(features.shape[1])
                full[list(cols)] = coef
                if error < best_error or not best.any():
                    best, best_error = full, error
    return best


def fit(data: list[Sample]) -> dict[str, list[float]]:
    """Per kind, ``[a, b, c]`` of ``seconds = a * pieces + b * FLOPs + c * bytes``: kinds that
    stand alone in samples first, then the rest on what their samples' fitted kinds leave."""
    fitted: dict[str, list[float]] = {}
    pending = list(data)
    while pending:
        alone = {}
        for work, seconds in pending:
            unknown = {w.kind for w in work} - set(fitted)
            if len(unknown) == 1:
                alone.setdefault(unknown.pop(), []).append((work, seconds))
        if not alone:
            break
        for kind, chosen in alone.items():
            rows, target = [], []
            for work, seconds in chosen:
                mine = [w for w in work if w.kind == kind]
                known = sum(_predict(w, fitted) for w in work if w.kind != kind)
                rows.append([len(mine), sum(w.flops for w in mine), sum(w.bytes for w in mine)])
                target.append(max(seconds - known, 0.0))
            fitted[kind] = [float(v) for v in _nnls3(np.array(rows), np.array(target))]
        pending = [s for s in pending if {w.kind for w in s[0]} - set(fitted)]
    return fitted


def _predict(work: Work, fitted: dict[str, list[float]]) -> float:
    a, b, c = fitted[work.kind]
    return a + b * work.flops + c * work.bytes


def measure(steps: int = 15) -> dict[str, list[float]]:
    """Measure and fit this machine's kernels from :func:`chain_samples` and
    :func:`numpy_samples` (a few seconds on one core)."""
    return fit(chain_samples(steps) + numpy_samples())
