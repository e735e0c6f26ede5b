"""Plan any chain of pympar layers: :class:`ChainModel` and :func:`describe_module`.

Build the model once on one rank (no launcher: every parallel layer's group is then this
rank alone), and describe it::

    from pympar.plan import ChainModel, rank, machine
    model = ChainModel.from_module(net, sequence=4096, batch=32, hidden=1024)
    fitting, unfit = rank(model, 64, machine("hdr"))

The input is ``[sequence, batch, hidden]`` (pympar's convention: the sequence is axis 0): the
sequence split over the context-parallel group, the batch over the data-parallel group; the
tensor-parallel layers split over the tensor-parallel group. One step is ``zero_grad``, the
forward, the backward of a gradient of ones, the gradients summed over the data x context
group (:func:`pympar.optim.allreduce_gradients` averaging them, or ZeRO) and a step of
:class:`pympar.optim.AdamW` with its default weight decay: a loss and its all-reduce are the
program's own and not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import training
from .layers import GELU, Layer, LayerNorm, Linear, Param, Recompute, Sequential
from .models import Layout, Model, memory_of, my_share, transformer_site, transformer_unfit
from .parallel_layers import ColumnParallelLinear, ContextAttention, RowParallelLinear
from .ledger import Site
from .program import Env

__all__ = ["ChainModel", "describe_module", "KNOWN_LAYERS"]

#: The pympar layers a chain may hold (containers: Sequential, Recompute).
KNOWN_LAYERS = ("Linear", "LayerNorm", "GELU", "ColumnParallelLinear", "RowParallelLinear",
                "ContextAttention", "Sequential", "Recompute")


def describe_module(module: Any, sequence: int) -> Layer:
    """The description of a pympar layer (and its children), for a sequence of ``sequence``.

    Raises
    ------
    ValueError
        For a layer the planner does not know (the message lists those it knows), or a
        tensor-parallel layer with sequence parallelism or ``skip_bias_add``.
    """
    kind = type(module).__name__
    grad = bool(getattr(module, "input_grad", True))
    if kind == "Sequential":
        names = list(module._modules)
        return Sequential(*(describe_module(m, sequence) for m in module._modules.values()),
                          names=names)
    if kind == "Recompute":
        return Recompute(describe_module(module.module, sequence))
    if kind == "Linear":
        return Linear(module.in_features, module.out_features, module.bias is not None, grad)
    if kind == "LayerNorm" and module.weight is not None:
        return LayerNorm(module.hidden)
    if kind == "GELU":
        return GELU()
    if kind in ("ColumnParallelLinear", "RowParallelLinear"):
        if module.use_sequence_parallel or module.skip_bias_add:
            raise ValueError(f"the planner does not price {kind} with sequence parallelism "
                             f"or skip_bias_add")
        if kind == "ColumnParallelLinear":
            return ColumnParallelLinear(module.in_features, module.out_features,
                                        module.gather_output, module.bias is not None,
                                        input_grad=grad)
        return RowParallelLinear(module.in_features, module.out_features,
                                 module.input_is_parallel, module.bias is not None,
                                 input_grad=grad)
    if kind == "ContextAttention" and not module.causal and module.layout == "contiguous":
        return ContextAttention(module.hidden, module.num_heads, sequence, grad)
    raise ValueError(f"the planner does not know {kind} (with these settings); it knows "
                     f"{', '.join(KNOWN_LAYERS)}")


@dataclass
class ChainModel(Model):
    """A chain of pympar layers on ``[sequence, batch, hidden]`` inputs (module docstring).

    Attributes
    ----------
    network : Layer
        Its description (:func:`describe_module`).
    sequence, batch, hidden : int
        The global input's extents.
    itemsize : int
    heads : int
        The attention's heads (0 without attention): Ulysses splits them.
    """

    network: Layer = None  # type: ignore[assignment]
    sequence: int = 1
    batch: int = 1
    hidden: int = 1
    itemsize: int = 4
    heads: int = 0
    name: str = "chain"

    @classmethod
    def from_module(cls, module: Any, sequence: int, batch: int, hidden: int) -> "ChainModel":
        """Describe a pympar ``Sequential`` (or any layer the planner knows), with its
        parameters' dtype."""
        itemsize = np.dtype(module.parameters()[0].dtype).itemsize if module.parameters() \
            else 4
        heads = max((getattr(m, "num_heads", 0) for m in module.modules()), default=0)
        return cls(describe_module(module, sequence), sequence, batch, hidden, itemsize,
                   heads)

    def site(self, layout: Layout, world_rank: int) -> Site:
        return transformer_site(layout, world_rank)

    def layouts(self, ranks: int) -> list[Layout]:
        out = []
        for tp in (d for d in range(1, ranks + 1) if ranks % d == 0):
            for cp in (d for d in range(1, ranks // tp + 1) if ranks // tp % d == 0):
                schemes = ["ulysses", "ring"] if cp > 1 and self.heads else ["ulysses"]
                for scheme in schemes:
                    for zero in (False, True):
                        out.append(Layout(tp, cp, ranks // (tp * cp), "1d", scheme, 0, zero))
        return out

    def unfit(self, layout: Layout) -> str | None:
        if layout.mode != "1d" or layout.recompute:
            return "a chain is planned in 1d tensor parallelism, without recompute wrappers"
        return transformer_unfit(layout, self.batch, self.sequence)

    def step(self, env: Env, layout: Layout) -> list[Param]:
        params = list(self.network.parameters(env))
        n = my_share(self.sequence, env.site, "cp")
        b = my_share(self.batch, env.site, "dp")
        training.zero_grad(env, params)
        y = self.network.forward(env, env.array((n, b, self.hidden)))
        env.probe()
        self.network.backward(env, y.like())
        if layout.zero:
            training.zero_step(env, params, "dp-cp")
        else:
            training.allreduce_gradients(env, params, "dp-cp", average=True)
            training.adamw_step(env, params)
        return params

    def memory(self, env: Env, layout: Layout, params: list[Param]) -> dict[str, int]:
        """Parameters, gradients, AdamW and the activations cached after the forward."""
        return memory_of(env, params, "dp-cp" if layout.zero else None)
