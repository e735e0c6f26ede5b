"""The layers' cases of tests/test_agreement_mismatch.py (see agreement_cases.py).

A layer is described once (:class:`Spec`: how to build it on a fresh group, its base
arguments, another value for each argument, an input fitting the layer each rank built);
every case builds it with one argument different on the last rank, or passes it an input
or output gradient of another dtype, and runs a forward and a backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest
from mpi4py import MPI

from agreement_cases import CASES, WORLD, Context
from pympar import manager
from pympar.decomposition import Decomposition
from pympar.halo import HaloExchange
from pympar.modules import (ColumnParallelLinear, ContextAttention, DistributedAttention,
                            HaloConv, Laplacian, LayerNorm3D, Linear3D, ParallelAttention,
                            RowParallelLinear, SpectralBlock, SpectralConv, SpectralConv2d,
                            VocabParallelCrossEntropy, VocabParallelEmbedding,
                            split_context_group)


@dataclass
class Spec:
    """One layer: ``make(ctx, **kwargs)``, its ``base`` arguments, ``other`` values, and
    ``x(layer)``, an input that fits the layer this rank built."""

    make: Callable[..., Any]
    base: dict[str, Any]
    other: dict[str, Any]
    x: Callable[[Any], Any]
    forward: Callable[..., Any] = field(default=lambda layer, x, **kw: layer.forward(x, **kw))
    #: Its forward's check is a halo exchange's, with the neighbours only: the ranks beyond
    #: may return from a forward whose neighbours raised, so the case ends there.
    neighbours: bool = False


def _first(y: Any) -> Any:
    return y[0] if isinstance(y, tuple) else y


def _halo(ctx: Context, width: int = 1) -> HaloExchange:
    g = ctx.group()
    return HaloExchange(Decomposition((4 * g.size, 6), {0: g}), width)


def _cube(ctx: Context) -> None:
    if WORLD.size % 8:
        pytest.skip("a 3D layer needs a cube of 8 ranks")
    manager.destroy_parallel()
    manager.initialize_parallel(8, tensor_parallel_mode="3d")
    ctx.cleanups.append(manager.destroy_parallel)


def _p() -> int:
    return WORLD.size


_ALT_INIT = {"init_method": "xavier_uniform", "seed": 1, "dtype": np.float32,
             "input_grad": False, "bias": False}
SPECS: dict[str, Spec] = {
    "ColumnParallelLinear": Spec(
        lambda ctx, **kw: ColumnParallelLinear(group=ctx.group(), **kw),
        {"in_features": 8, "out_features": 6 * _p(), "gather_output": False,
         "dtype": np.float64},
        {**_ALT_INIT, "in_features": 9, "out_features": 6 * _p() + 3, "skip_bias_add": True,
         "use_sequence_parallel": True, "bias_init": "zeros", "gather_output": True,
         "stride": 3},
        lambda layer: np.ones((4, 2, layer.in_features), layer.dtype)),
    "RowParallelLinear": Spec(
        lambda ctx, **kw: RowParallelLinear(group=ctx.group(), **kw),
        {"in_features": 8, "out_features": 6, "dtype": np.float64},
        {**_ALT_INIT, "in_features": 9, "out_features": 7, "skip_bias_add": True,
         "use_sequence_parallel": True, "bias_init": "zeros", "input_is_parallel": True},
        lambda layer: np.ones((2 * _p(), 2, layer.weight.data.shape[1] if
                               layer.input_is_parallel else layer.in_features), layer.dtype)),
    "ParallelAttention": Spec(
        lambda ctx, **kw: ParallelAttention(group=ctx.group(), **kw),
        {"hidden": 4 * _p(), "num_heads": 2 * _p(), "dtype": np.float64},
        {**_ALT_INIT, "hidden": 8 * _p(), "num_heads": _p(), "use_sequence_parallel": True,
         "causal": True},
        lambda layer: np.ones((4, 1, layer.hidden), layer.qkv.dtype)),
    "ContextAttention": Spec(
        lambda ctx, **kw: ContextAttention(group=ctx.group(), **kw),
        {"hidden": 8, "num_heads": 2, "dtype": np.float64},
        {**_ALT_INIT, "hidden": 16, "num_heads": 4, "scheme": "ulysses", "causal": True,
         "layout": "zigzag"},
        lambda layer: np.ones((2, 1, layer.hidden), layer.qkv.dtype)),
    "DistributedAttention": Spec(
        lambda ctx, **kw: DistributedAttention(group=ctx.group(), **kw),
        {"hidden": 8, "num_heads": 2, "dtype": np.float64},
        {**_ALT_INIT, "hidden": 16, "num_heads": 4, "causal": True},
        lambda layer: np.ones((2, 1, layer.hidden), layer.qkv.dtype)),
    "Laplacian": Spec(
        lambda ctx, halo=1, **kw: Laplacian(_halo(ctx, halo), **kw), {},
        {"spacing": 2.0, "halo": 2},
        lambda layer: np.ones(layer.halo.decomposition.local_shape), neighbours=True),
    "HaloConv": Spec(
        lambda ctx, halo=1, **kw: HaloConv(_halo(ctx, halo), **kw),
        {"in_channels": 2, "out_channels": 3, "kernel_size": 3, "dtype": np.float64},
        {**_ALT_INIT, "halo": 2, "in_channels": 1, "out_channels": 4, "kernel_size": 1},
        lambda layer: np.ones((1, layer.in_channels, *layer.halo.decomposition.local_shape),
                              layer.dtype), neighbours=True),
    "SpectralConv": Spec(  # one spatial axis: the reduce-scatter and all-gather path
        lambda ctx, **kw: SpectralConv(group=ctx.group(), **kw),
        {"in_channels": 2, "out_channels": 3, "modes": (2,), "dtype": np.float64},
        {**_ALT_INIT, "in_channels": 1, "out_channels": 4, "modes": (1,)},
        lambda layer: np.ones((1, 4, layer.in_channels), layer.dtype)),
    "SpectralConv2d": Spec(  # modes[0] is cut after the exchange: only the label tells
        lambda ctx, **kw: SpectralConv2d(group=ctx.group(), **kw),
        {"in_channels": 2, "out_channels": 3, "modes": (2, 2), "dtype": np.float64},
        {**_ALT_INIT, "in_channels": 1, "out_channels": 4, "modes": (1, 2)},
        lambda layer: np.ones((1, 4, 8, layer.in_channels), layer.dtype)),
    "SpectralBlock": Spec(
        lambda ctx, **kw: SpectralBlock(group=ctx.group(), **kw),
        {"channels": 2, "modes": 2, "dims": 2, "dtype": np.float64},
        {**_ALT_INIT, "channels": 3, "modes": 1, "dims": 1, "activation": False},
        lambda layer: np.ones((1, 4, *(8,) * (len(layer.spectral.modes) - 1),
                               layer.spectral.in_channels), layer.spectral.dtype)),
    "Linear3D": Spec(
        lambda ctx, **kw: (_cube(ctx), Linear3D(**kw))[1],
        {"in_features": 8, "out_features": 8, "dtype": np.float64},
        {**_ALT_INIT, "in_features": 12, "out_features": 12, "swap": True},
        lambda layer: layer.layout.split_input(np.ones((8, layer.in_features), layer.dtype))),
    "LayerNorm3D": Spec(
        lambda ctx, **kw: (_cube(ctx), LayerNorm3D(**kw))[1],
        {"hidden": 8, "dtype": np.float64},
        {"hidden": 12, "eps": 1e-3, "swap": True, "dtype": np.float32, "input_grad": False},
        lambda layer: layer.layout.split_input(np.ones((8, layer.hidden), layer.dtype))),
    "VocabParallelEmbedding": Spec(
        lambda ctx, **kw: VocabParallelEmbedding(group=ctx.group(), **kw),
        {"num_embeddings": 3 * _p() + 1, "embedding_dim": 4, "dtype": np.float64},
        {"num_embeddings": 3 * _p() + 2, "embedding_dim": 5, "use_sequence_parallel": True,
         "init_method": "xavier_uniform", "seed": 1, "dtype": np.float32},
        lambda layer: (np.arange(2 * _p() * 3) % layer.num_embeddings).reshape(2 * _p(), 3)),
    "VocabParallelCrossEntropy": Spec(
        lambda ctx, **kw: VocabParallelCrossEntropy(group=ctx.group(), **kw),
        {"vocab_size": 3 * _p() + 1, "dtype": np.float64},
        {"vocab_size": 3 * _p() + 2, "label_smoothing": 0.1, "ignore_index": 0,
         "dtype": np.float32},
        lambda layer: np.ones((4, 2, layer.vocab_range.stop - layer.vocab_range.start),
                              layer.dtype),
        forward=lambda layer, logits: layer.forward(logits, _targets(layer, logits.shape[:-1]))),
}
_OTHER_DTYPE = {np.dtype(np.float64): np.float32, np.dtype(np.float32): np.float64,
                np.dtype(np.int64): np.int32, np.dtype(np.int32): np.int64}


def _targets(layer: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Classes of every kind for a cross-entropy: each rank's block, and one ignored."""
    t = np.arange(int(np.prod(shape))) % layer.vocab_size
    t[0] = layer.ignore_index
    return t.reshape(shape)


def _other_targets(ctx: Context) -> Any:
    """The cross-entropy with targets of another dtype on the last rank."""
    spec = SPECS["VocabParallelCrossEntropy"]
    layer = spec.make(ctx, **spec.base)
    logits = spec.x(layer)
    target = _targets(layer, logits.shape[:-1])
    return layer.forward(logits, ctx.pick(target, target.astype(np.int32)))


def _layer_case(spec: Spec, method: str, param: str) -> Callable[[Context], Any]:
    def run(ctx: Context) -> Any:
        kwargs = dict(spec.base)
        if param == "ulysses_size":  # the hybrid scheme's
            kwargs.update(scheme="hybrid", ulysses_size=ctx.pick(1, WORLD.size))
        elif method == "__init__":
            kwargs[param] = ctx.pick(kwargs.get(param), spec.other[param])
            kwargs = {k: v for k, v in kwargs.items() if v is not None}
        layer = spec.make(ctx, **kwargs)
        x = spec.x(layer)
        extra = {}
        if method == "forward" and param in ("x", "u", "ids", "logits"):
            x = ctx.pick(x, x.astype(_OTHER_DTYPE[x.dtype]))
        if param == "key_lengths":
            extra["key_lengths"] = ctx.pick([x.shape[0]], [1])
        failed = None
        try:
            y = _first(spec.forward(layer, x, **extra))
        except Exception as err:  # noqa: BLE001 - raised below, once the others know
            failed = err
        # Its neighbours raised in the forward: a rank beyond returned, and goes no further.
        if spec.neighbours and WORLD.allreduce(failed is not None, op=MPI.LOR):
            if failed is not None:
                raise failed
            return y
        if failed is not None:
            raise failed
        dy = np.ones_like(y)
        if method == "backward":
            dy = ctx.pick(dy, dy.astype(_OTHER_DTYPE[dy.dtype]))
        return layer.backward(dy)
    return run


def _register() -> None:
    from pympar import agreed

    for path, params in agreed.INVENTORY.items():
        if not path.startswith("pympar.modules.") or path.count(".") != 3:
            continue
        name, method = path.split(".")[2:]
        for param, entry in params.items():
            if entry.kind in ("label", "checked") and name in SPECS:
                CASES[(path, param)] = _layer_case(SPECS[name], method, param)


_register()


def _split(ctx: Context) -> Any:
    g = ctx.group()
    made = split_context_group(g, ctx.pick(1, g.size))
    for group in made:
        ctx.made.append(group)
    return made


CASES[("pympar.modules.split_context_group", "ulysses_size")] = _split
CASES[("pympar.modules.VocabParallelCrossEntropy.forward", "target")] = _other_targets
