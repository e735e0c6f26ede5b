"""The models the planner knows: the examples' (``burgers``, ``fno``) and any chain of layers.

A :class:`Model` lays a :class:`Layout` over its mesh (:meth:`Model.site`: one rank's groups),
says why a layout does not fit it (:meth:`Model.unfit`), and runs one training step of one
rank symbolically (:meth:`Model.step`), exactly as its program does it: for the examples,
the loop body of ``examples/burgers.py`` and ``examples/fno.py`` from ``model.zero_grad()``
to ``optimizer.step()``, the span their ``median_step_seconds`` times.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field, replace
from typing import Any

from ..partition import balanced_sizes
from .layers import Layer, Param
from .ledger import GroupAt, Site, sub_group
from .program import Array, Env
from . import training

__all__ = ["Layout", "Model", "StepResult", "run_step"]


@dataclass(frozen=True)
class Layout:
    """One way to lay a model over ranks.

    Attributes
    ----------
    tp, cp, dp : int
        Tensor-, context- (the examples' FNO: spatial-) and data-parallel sizes.
    mode : {"1d", "3d"}
        Tensor parallelism over one axis, or a cube (``tp = d**3``).
    attention : {"ulysses", "ring", "hybrid"}
        The context-parallel attention scheme.
    ulysses : int
        Ranks per Ulysses group of ``"hybrid"``.
    zero : bool
        ZeRO-1 over the data x context group instead of all-reduced gradients.
    recompute : bool
        Every transformer block's activations recomputed in backward.
    """

    tp: int = 1
    cp: int = 1
    dp: int = 1
    mode: str = "1d"
    attention: str = "ulysses"
    ulysses: int = 0
    zero: bool = False
    recompute: bool = False

    @property
    def ranks(self) -> int:
        """The ranks it takes."""
        return self.tp * self.cp * self.dp

    def with_ranks(self, ranks: int) -> "Layout":
        """This layout's model-parallel part with the data-parallel size ``ranks`` leaves."""
        return replace(self, dp=ranks // (self.tp * self.cp))


@dataclass
class StepResult:
    """One rank's step, run symbolically.

    Attributes
    ----------
    env : Env
        Its calls, checks, work and activation peak.
    params : list of Param
    memory : dict of str to int
        ``parameters``, ``gradients``, ``optimizer``, ``workspace``, ``activations`` (the
        peak) and ``total``, as :func:`pympar.memory.memory_report` counts them.
    """

    env: Env
    params: list[Param]
    memory: dict[str, int] = field(default_factory=dict)


class Model:
    """A model the planner can lay out and run.

    Attributes
    ----------
    name : str
    itemsize : int
        Bytes per element of its parameters and activations.
    """

    name = "model"
    itemsize = 4

    def site(self, layout: Layout, world_rank: int) -> Site:
        """One rank's groups under ``layout``."""
        raise NotImplementedError

    def unfit(self, layout: Layout) -> str | None:
        """Why ``layout`` cannot run this model (None when it can)."""
        return None

    def layouts(self, ranks: int) -> list[Layout]:
        """Every layout of ``ranks`` ranks worth weighing (fitting or not)."""
        raise NotImplementedError

    def step(self, env: Env, layout: Layout) -> list[Param]:
        """Run one training step of one rank against ``env``; return its parameters."""
        raise NotImplementedError


def run_step(model: Model, layout: Layout, world_rank: int = 0) -> StepResult:
    """Run one step of ``world_rank`` under ``layout``; its ledger and memory."""
    site = model.site(layout, world_rank)
    env = Env(site, model.itemsize)
    params = model.step(env, layout)
    result = StepResult(env, params)
    result.memory = dict(model.memory(env, layout, params))  # type: ignore[attr-defined]
    result.memory["total"] = sum(result.memory.values())
    return result


def self_group(world_rank: int) -> GroupAt:
    """A group of this rank alone (a mapping or ring on it does nothing)."""
    return GroupAt(f"self-{world_rank}", 1, 0, (world_rank,))


def transformer_site(layout: Layout, world_rank: int) -> Site:
    """The groups of :func:`pympar.manager.initialize_parallel` (order ``tp-cp-dp``) and of
    the attention scheme (:func:`pympar.modules.context_attention.split_context_group`)."""
    if layout.mode == "3d":
        d = round(layout.tp ** (1 / 3))
        sizes = {"tp_i": d, "tp_j": d, "tp_k": d, "cp": layout.cp, "dp": layout.dp}
        site = Site(world_rank, sizes, "tp_i-tp_j-tp_k-cp-dp")
        site.add("tp", ("tp_i", "tp_j", "tp_k"), "tp")
        site.add("3d_input", ("tp_j",), "3d_input")
        site.add("3d_weight", ("tp_i",), "3d_weight")
        site.add("3d_output", ("tp_k",), "3d_output")
    else:
        site = Site(world_rank, {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp},
                    "tp-cp-dp")
        site.add("tp", ("tp",), "tp")
    cp = site.add("cp", ("cp",))
    site.add("dp", ("dp",))
    site.add("dp-cp", ("dp", "cp"))
    alone = self_group(world_rank)
    if layout.attention == "ulysses":
        site.groups["ulysses"], site.groups["ring"] = cp, alone
    elif layout.attention == "ring":
        site.groups["ulysses"], site.groups["ring"] = alone, cp
    else:
        u, c = ulysses_size(layout), cp.rank
        site.groups["ulysses"] = sub_group(cp, "ulysses", list(range((c // u) * u,
                                                                    (c // u + 1) * u)))
        site.groups["ring"] = sub_group(cp, "ring", list(range(c % u, cp.size, u)))
    return site


def ulysses_size(layout: Layout) -> int:
    """Context ranks per Ulysses group of ``"hybrid"`` (the examples' default: the largest
    divisor ``u`` of ``cp`` with ``u * u <= cp``)."""
    if layout.ulysses:
        return layout.ulysses
    return max(u for u in range(1, math.isqrt(layout.cp) + 1) if layout.cp % u == 0)


def transformer_unfit(layout: Layout, batch: int, sequence: int) -> str | None:
    """Why a transformer's ``layout`` cannot split a batch of ``batch`` sequences of
    ``sequence`` tokens (None when it can)."""
    if batch < layout.dp:
        return f"batch {batch} is smaller than dp {layout.dp}"
    if sequence < layout.cp:
        return f"sequence of {sequence} is shorter than cp {layout.cp}"
    if layout.attention == "hybrid" and layout.cp % ulysses_size(layout):
        return f"ulysses size {ulysses_size(layout)} does not divide cp {layout.cp}"
    return None


def my_share(n: int, site: Site, role: str) -> int:
    """This rank's share of ``n`` items over the group of ``role``."""
    return balanced_sizes(n, site.size(role))[site.rank(role)]


def forward_loss_backward(env: Env, net: Layer, x: Array, out_shape: tuple[int, ...],
                          role: str) -> None:
    """Forward, the loss (its all-reduce over ``role``), the loss gradient, backward; the
    activation peak probed after the forward."""
    net.forward(env, x)
    env.probe()
    out = env.array(out_shape)
    env.compute("elementwise", 0, 3 * out.nbytes)  # err = y - target, its dot, err *= factor
    env.check(role)
    env.call(role, "all_reduce", "all_reduce", 8, 8, recorded_alone=True)
    net.backward(env, out)


def describe(layout: Layout, model: Any = None) -> str:
    """A layout in a few words (``"tp=2 cp=2 dp=2 ulysses zero"``)."""
    spatial = getattr(model, "spatial_axis", None)
    if spatial:
        return f"{spatial}={layout.cp} dp={layout.dp}"
    words = [f"tp={layout.tp}" + (" (3d)" if layout.mode == "3d" else ""), f"cp={layout.cp}",
             f"dp={layout.dp}"]
    if layout.cp > 1:
        words.append(layout.attention + (f"(u={ulysses_size(layout)})"
                                         if layout.attention == "hybrid" else ""))
    words += [flag for flag, on in (("zero", layout.zero), ("recompute", layout.recompute)) if on]
    return " ".join(words)


def memory_of(env: Env, params: list[Param], zero_role: str | None) -> dict[str, int]:
    """Parameters, gradients, AdamW (sharded over ``zero_role`` when given) and the
    activation peak, in bytes."""
    zero = None
    if zero_role is not None:
        zero = training.zero_plan(params, env.site.size(zero_role), env.site.rank(zero_role))
    state = training.optimizer_memory(params, zero)
    nbytes = training.parameter_bytes(params)
    return {"parameters": nbytes, "gradients": nbytes, "optimizer": state["optimizer"],
            "workspace": state["workspace"], "activations": env.peak}
