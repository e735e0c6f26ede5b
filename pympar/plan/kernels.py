"""This machine's local work, measured on one rank: the layers' own code at a few sizes.

Every sample runs a real pympar layer (or the few NumPy lines of a training step) at one
size, timed as the median of repeats, beside the :class:`~pympar.plan.program.Work` that its
description (:mod:`pympar.plan.layers`) emits for the same size. Per kind of work,
:func:`fit` finds ``seconds = a * pieces + b * FLOPs + c * bytes`` with ``a, b, c >= 0`` by
least squares; a sample that also holds work of kinds fitted before (a
:class:`~pympar.modules.ContextAttention` holds two :class:`~pympar.modules.Linear`) is
fitted on what remains of its time once those are taken away.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any, Callable

import numpy as np

from .layers import GELU as GELUPlan, LayerNorm as LayerNormPlan, Linear as LinearPlan
from .models import Layout
from .parallel_layers import ContextAttention as AttentionPlan, SpectralBlock
from .presets import BurgersModel, FNOModel
from .program import Env, Work

__all__ = ["Sample", "samples", "fit", "measure"]

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


def _env(model: Any = None) -> Env:
    model = model or BurgersModel()
    return Env(model.site(Layout(), 0), 4)


def _symbolic(layer: Any, shape: tuple[int, ...], direction: str, env: Env) -> list[Work]:
    """The work ``layer``'s description emits for one forward, or one backward."""
    x = env.array(shape)
    y = layer.forward(env, x)
    if direction == "forward":
        return list(env.work)
    env.work.clear()
    layer.backward(env, y)
    return list(env.work)


def _layer_samples(make: Callable[[], Any], plan: Any, shape: tuple[int, ...],
                   model: Any = None, repeats: int = 9) -> list[Sample]:
    """A real layer's forward and backward timed at ``shape``, beside its description's work."""
    rng = np.random.default_rng(0)
    layer = make()
    x = rng.standard_normal(shape).astype(np.float32)
    y = layer.forward(x)
    dy = np.ones_like(y)
    layer.backward(dy)
    forward = _median_seconds(lambda: layer.forward(x), repeats=repeats)
    backward = _median_seconds(lambda: layer.backward(dy), lambda: layer.forward(x), repeats)
    return [(_symbolic(plan, shape, "forward", _env(model)), forward),
            (_symbolic(plan, shape, "backward", _env(model)), backward)]


def _numpy_samples(repeats: int = 9) -> list[Sample]:
    """The step's own NumPy lines: residual adds, the loss, copies, AdamW, zero_grad, the
    gradient buckets' packing."""
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
    return out


def samples(repeats: int = 9) -> list[Sample]:
    """Every calibration sample: the examples' layers at sizes around theirs on 1-8 ranks."""
    from ..modules import GELU, ContextAttention, LayerNorm, Linear
    from ..modules.spectral import SpectralConv2d
    from ..group import self_group
    out = _numpy_samples(repeats)
    for rows, fin, fout in ((64, 64, 192), (512, 64, 192), (1024, 64, 192), (2048, 64, 64),
                            (1024, 64, 256), (1024, 256, 64), (256, 64, 32), (1024, 3, 64),
                            (8192, 3, 16), (8192, 16, 16), (8192, 16, 64), (8192, 64, 1),
                            (2048, 16, 64), (1024, 64, 1), (128, 256, 64), (4096, 64, 128)):
        out += _layer_samples(lambda: Linear(fin, fout), LinearPlan(fin, fout), (rows, fin),
                              repeats=repeats)
    for rows, h in ((64, 64), (512, 64), (1024, 64), (4096, 64), (1024, 16)):
        out += _layer_samples(lambda: LayerNorm(h), LayerNormPlan(h), (rows, h),
                              repeats=repeats)
    for rows, f in ((1024, 256), (1024, 64), (256, 256), (8192, 16), (8192, 64), (4096, 128)):
        out += _layer_samples(GELU, GELUPlan(), (rows, f), repeats=repeats)
    group = self_group()
    for n, b, h, heads in ((64, 16, 64, 4), (32, 16, 64, 4), (64, 8, 64, 4), (16, 16, 64, 4),
                           (64, 4, 64, 2), (128, 8, 64, 4), (64, 16, 64, 1)):
        out += _layer_samples(lambda: ContextAttention(h, heads, "ring", group=group),
                              AttentionPlan(h, heads, n), (n, b, h), repeats=repeats)
    fno = FNOModel()
    for b, n1, n2, w, m in ((8, 32, 32, 16, 8), (4, 32, 32, 16, 8), (8, 16, 32, 16, 8),
                            (8, 32, 32, 16, 4), (2, 32, 32, 16, 8), (8, 32, 32, 8, 8)):
        plan = SpectralBlock(w, (m, m), (n1, n2))
        work = []
        for direction in ("forward", "backward"):
            env = _env(fno)
            x = env.array((b, n1, n2, w))
            plan.forward(env, x)
            if direction == "backward":
                env.work.clear()
                plan.backward(env, x)
            work.append([w_ for w_ in env.work if w_.kind.startswith("spectral")])
        conv = SpectralConv2d(w, w, m)
        x = np.random.default_rng(0).standard_normal((b, n1, n2, w)).astype(np.float32)
        dy = np.ones_like(conv.forward(x))
        conv.backward(dy)
        out.append((work[0], _median_seconds(lambda: conv.forward(x), repeats=repeats)))
        out.append((work[1], _median_seconds(lambda: conv.backward(dy), lambda: conv.forward(x),
                                             repeats)))
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


def measure(repeats: int = 9) -> dict[str, list[float]]:
    """Measure and fit this machine's kernels (a few seconds on one core)."""
    return fit(samples(repeats))
