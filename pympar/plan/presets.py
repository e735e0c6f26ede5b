"""The examples' models as the planner sees them: ``examples/burgers.py`` and ``examples/fno.py``.

Each preset builds the same layers as its example (names, order, flags), lays out the same
groups, and runs the same training step (:class:`~pympar.plan.models.Model`); its defaults are
the example's command-line defaults. ``BurgersModel(hidden=8, ...)`` describes the example run
with ``--hidden 8 ...``.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

from .layers import GELU, Layer, LayerNorm, Linear, Param, Recompute, Sequential
from .models import (Layout, Model, forward_loss_backward, memory_of, my_share,
                     transformer_site, transformer_unfit, ulysses_size)
from .parallel_layers import (ColumnParallelLinear, ContextAttention, Linear3D,
                              RowParallelLinear, SpectralBlock, collective)
from .ledger import Site
from .program import Array, Env
from . import training

__all__ = ["BurgersModel", "FNOModel", "PRESETS"]


class _MLP3D(Layer):
    """``examples/burgers.py``'s MLP3D: split the rows, two Linear3D, gather them back."""

    def __init__(self, hidden: int, ffn: int, rows: int) -> None:
        self.hidden, self.rows = hidden, rows
        self.fc1 = Linear3D(hidden, ffn, rows)
        self.act = GELU()
        self.fc2 = Linear3D(ffn, hidden, rows, swap=True)

    def children(self) -> list[tuple[str, Layer]]:
        return [("fc1", self.fc1), ("act", self.act), ("fc2", self.fc2)]

    def _gather(self, env: Env, block: Array) -> None:
        """``Layout3D.gather_input``: rows over the input group, then the weight group, then
        the columns over the output group (each learning its extents)."""
        s, h = env.itemsize, my_share(self.hidden, env.site, "3d_output")
        rows_w = my_share(self.rows, env.site, "3d_weight")
        collective(env, "3d_input", "all_gather", "all_gather", block.nbytes, rows_w * h * s,
                   learns_extents=True)
        collective(env, "3d_weight", "all_gather", "all_gather", rows_w * h * s,
                    self.rows * h * s, learns_extents=True)
        collective(env, "3d_output", "all_gather", "all_gather", self.rows * h * s,
                   self.rows * self.hidden * s, learns_extents=True)

    def _block(self, env: Env) -> Array:
        rows = my_share(my_share(self.rows, env.site, "3d_weight"), env.site, "3d_input")
        block = env.array((rows, my_share(self.hidden, env.site, "3d_output")))
        env.compute("copy", 0, block.nbytes)
        return block

    def forward(self, env: Env, x: Array) -> Array:
        y = self.fc2.forward(env, self.act.forward(env, self.fc1.forward(env, self._block(env))))
        self._gather(env, y)
        return env.array(x.shape)

    def backward(self, env: Env, dy: Array) -> Array:
        dh = self.fc2.backward(env, self._block(env))
        dx = self.fc1.backward(env, self.act.backward(env, dh))
        self._gather(env, dx)
        return env.array(dy.shape)


class _Block(Layer):
    """``examples/burgers.py``'s pre-norm block; probes the activations when its backward
    starts (as the example's ``on_backward`` does)."""

    def __init__(self, hidden: int, heads: int, grid: int, mlp: Layer) -> None:
        self.ln1, self.ln2 = LayerNorm(hidden), LayerNorm(hidden)
        self.attn = ContextAttention(hidden, heads, grid)
        self.mlp = mlp

    def children(self) -> list[tuple[str, Layer]]:
        return [("ln1", self.ln1), ("attn", self.attn), ("ln2", self.ln2), ("mlp", self.mlp)]

    def forward(self, env: Env, x: Array) -> Array:
        self.attn.forward(env, self.ln1.forward(env, x))
        h = x.like()
        env.compute("add", 0, h.nbytes)
        self.mlp.forward(env, self.ln2.forward(env, h))
        env.compute("add", 0, h.nbytes)
        return x.like()

    def backward(self, env: Env, dy: Array) -> Array:
        env.probe()
        self.ln2.backward(env, self.mlp.backward(env, dy))
        env.compute("add", 0, dy.nbytes)
        self.ln1.backward(env, self.attn.backward(env, dy))
        env.compute("add", 0, dy.nbytes)
        return dy.like()


@dataclass
class BurgersModel(Model):
    """``examples/burgers.py``: a transformer over the grid points (DP x CP x TP or 3D).

    Attributes are the example's flags: ``--hidden``, ``--heads``, ``--layers``, ``--grid``,
    ``--batch``; ``itemsize`` 4 for ``--dtype float32``, 8 for ``float64``.
    """

    hidden: int = 64
    heads: int = 4
    layers: int = 2
    grid: int = 64
    batch: int = 16
    itemsize: int = 4
    name: str = "burgers"

    def site(self, layout: Layout, world_rank: int) -> Site:
        return transformer_site(layout, world_rank)

    def layouts(self, ranks: int) -> list[Layout]:
        out = []
        for tp in _divisors(ranks):
            for cp in _divisors(ranks // tp):
                modes = ["1d"] + (["3d"] if tp > 1 and round(tp ** (1 / 3)) ** 3 == tp else [])
                schemes = ["ulysses", "ring", "hybrid"] if cp > 1 else ["ulysses"]
                for mode in modes:
                    for scheme in schemes:
                        if scheme == "hybrid" and ulysses_size(Layout(cp=cp)) in (1, cp):
                            continue  # hybrid would be plain ring or plain Ulysses
                        for zero in (False, True):
                            for recompute in (False, True):
                                out.append(Layout(tp, cp, ranks // (tp * cp), mode, scheme,
                                                  0, zero, recompute))
        return out

    def unfit(self, layout: Layout) -> str | None:
        if layout.mode == "3d":
            d = round(layout.tp ** (1 / 3))
            if d ** 3 != layout.tp:
                return f"3d needs a cube tp (1, 8, 27, ...), not {layout.tp}"
            if min(self.hidden, 4 * self.hidden) < d * d:
                return f"Linear3D needs hidden >= depth**2 = {d * d}"
        if self.hidden % self.heads:
            return f"hidden {self.hidden} is not divisible by heads {self.heads}"
        if layout.mode == "1d" and layout.tp > 4 * self.hidden:
            return f"tp {layout.tp} leaves ranks without MLP features (4 * hidden = " \
                   f"{4 * self.hidden})"
        ulysses = {"ulysses": layout.cp, "ring": 1}.get(layout.attention, ulysses_size(layout))
        if ulysses > self.heads:
            return f"Ulysses groups of {ulysses} ranks leave ranks without heads " \
                   f"({self.heads} heads)"
        return transformer_unfit(layout, self.batch, self.grid)

    def network(self, layout: Layout, env: Env) -> Sequential:
        """The example's ``BurgersTransformer`` for this rank."""
        n = my_share(self.grid, env.site, "cp")
        rows = n * my_share(self.batch, env.site, "dp")
        ffn = 4 * self.hidden
        blocks = []
        for _ in range(self.layers):
            mlp: Layer = (_MLP3D(self.hidden, ffn, rows) if layout.mode == "3d" else Sequential(
                ColumnParallelLinear(self.hidden, ffn, gather_output=False), GELU(),
                RowParallelLinear(ffn, self.hidden), names=("fc1", "act", "fc2")))
            blocks.append(_Block(self.hidden, self.heads, self.grid, mlp))
        run = [Recompute(b) for b in blocks] if layout.recompute else blocks
        names = ["embed", *(f"block{i}" for i in range(self.layers)), "norm", "head"]
        net = Sequential(Linear(3, self.hidden, input_grad=False), *blocks,
                         LayerNorm(self.hidden), Linear(self.hidden, 1), names=names)
        net.items[1:1 + self.layers] = [(f"block{i}", b) for i, b in enumerate(run)]
        self._blocks = blocks
        return net

    def step(self, env: Env, layout: Layout) -> list[Param]:
        net = self.network(layout, env)
        params = list(_named(net, self._blocks, env))
        n = my_share(self.grid, env.site, "cp")
        b = my_share(self.batch, env.site, "dp")
        training.zero_grad(env, params)
        env.compute("step.burgers", 0, 0)  # the example's own Python around the layers
        forward_loss_backward(env, net, env.array((n, b, 3)), (n, b), "dp-cp")
        if layout.zero:
            training.zero_step(env, params, "dp-cp")
        else:
            training.allreduce_gradients(env, params, "dp-cp")
            training.adamw_step(env, params)
        return params

    def memory(self, env: Env, layout: Layout, params: list[Param]) -> dict[str, int]:
        """As ``examples/burgers.py`` reports it (AdamW without weight decay)."""
        return memory_of(env, params, "dp-cp" if layout.zero else None)


def _named(net: Sequential, blocks: list[Layer], env: Env):
    """The parameters in ``BurgersTransformer``'s order (blocks under ``block<i>``, also
    when wrapped for recomputation)."""
    for name, layer in net.children():
        if name.startswith("block"):
            layer = blocks[int(name[5:])]
        yield from layer.parameters(env, f"{name}.")


@dataclass
class FNOModel(Model):
    """``examples/fno.py``: an FNO on 2-D fields, the grid's rows split over the spatial
    group (the layout's ``cp``), the batch over the rest.

    Attributes are the example's flags: ``--width``, ``--modes``, ``--layers``, ``--grid``,
    ``--batch``; ``itemsize`` 4 for ``--dtype float32``, 8 for ``float64``.
    """

    width: int = 16
    modes: int = 8
    layers: int = 3
    grid: int = 32
    batch: int = 8
    itemsize: int = 4
    name: str = "fno"
    spatial_axis: str = "spatial"

    def site(self, layout: Layout, world_rank: int) -> Site:
        site = Site(world_rank, {"x": layout.cp, "dp": layout.dp}, "x-dp")
        site.add("x", ("x",))
        site.add("dp", ("dp",))
        site.add("x-dp", ("x", "dp"))
        return site

    def layouts(self, ranks: int) -> list[Layout]:
        return [Layout(cp=p, dp=ranks // p) for p in _divisors(ranks)]

    def unfit(self, layout: Layout) -> str | None:
        if layout.tp != 1 or layout.mode != "1d" or layout.zero or layout.recompute:
            return "the FNO example has spatial and data parallelism only"
        if self.batch < layout.dp:
            return f"batch {self.batch} is smaller than dp {layout.dp}"
        if self.grid < layout.cp:
            return f"grid {self.grid} has fewer rows than spatial {layout.cp}"
        if 2 * self.modes > self.grid:
            return f"modes {self.modes} need a grid of at least {2 * self.modes}"
        return None

    def step(self, env: Env, layout: Layout) -> list[Param]:
        w = self.width
        blocks = [SpectralBlock(w, (self.modes, self.modes), (self.grid, self.grid),
                                activation=i < self.layers - 1) for i in range(self.layers)]
        net = Sequential(Linear(3, w, input_grad=False), *blocks, Linear(w, 4 * w), GELU(),
                         Linear(4 * w, 1), names=["lift", *(f"block{i}" for i in
                                                            range(self.layers)),
                                                  "proj1", "act", "proj2"])
        params = list(net.parameters(env))
        rows = my_share(self.grid, env.site, "x")
        b = my_share(self.batch, env.site, "dp")
        training.zero_grad(env, params)
        env.compute("step.fno", 0, 0)  # the example's own Python around the layers
        forward_loss_backward(env, net, env.array((b, rows, self.grid, 3)),
                              (b, rows, self.grid), "x-dp")
        training.allreduce_gradients(env, [p for p in params if not p.split], "x-dp")
        training.allreduce_gradients(env, [p for p in params if p.split], "dp")
        training.adamw_step(env, params)
        return params

    def memory(self, env: Env, layout: Layout, params: list[Param]) -> dict[str, int]:
        """Parameters, gradients, AdamW and the activations cached after the forward."""
        return memory_of(env, params, None)


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (pairs up to its square root: a million ranks in a
    thousand steps)."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


#: The example models by name, with the examples' defaults.
PRESETS: dict[str, type[Model]] = {"burgers": BurgersModel, "fno": FNOModel}
