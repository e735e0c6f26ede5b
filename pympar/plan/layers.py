"""Descriptions of pympar's replicated layers, run symbolically on one rank (an :class:`Env`).

Each description mirrors its layer in :mod:`pympar.modules`: what its ``forward`` caches
(:meth:`Env.save`), what it computes (:meth:`Env.compute`: a kind, FLOPs and bytes) and,
for the parallel ones (:mod:`pympar.plan.parallel_layers`), which collectives it calls and
which agreement checks it makes. A description knows its parameters' shapes on the rank
(:meth:`Layer.parameters`), so memory and gradient buckets follow from the same objects.

Element-wise work is priced by the bytes it touches (``flops`` 0); matrix products by their
FLOPs and the bytes of their operands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from .program import Array, Env, Sized

__all__ = ["Param", "Layer", "Linear", "LayerNorm", "GELU", "Sequential", "Recompute",
           "matmul_work"]


@dataclass(frozen=True)
class Param(Sized):
    """One parameter on one rank.

    Attributes
    ----------
    name : str
        Dotted, as :meth:`pympar.modules.Module.named_parameters` names it.
    shape : tuple of int
        This rank's block.
    itemsize : int
        Bytes per element.
    split : bool
        Whether the block is a part of the full parameter split over a model-parallel group
        (its gradient is then complete without a sum over that group).
    """

    name: str
    shape: tuple[int, ...]
    itemsize: int
    split: bool = False


def matmul_work(env: Env, kind: str, m: int, k: int, n: int, passes: int = 1) -> None:
    """One ``(m, k) @ (k, n)`` product: ``2 m k n`` FLOPs and the bytes of its operands, the
    result's counted ``passes`` times (a bias added to it, a sum over its rows)."""
    env.compute(kind, 2.0 * m * k * n, (m * k + k * n + passes * m * n) * env.itemsize)


class Layer:
    """A layer description: forward and backward against an :class:`Env`.

    Attributes
    ----------
    input_grad : bool
        Whether backward computes the input gradient (as :attr:`pympar.modules.Module.input_grad`).
    """

    input_grad: bool = True

    def forward(self, env: Env, x: Array) -> Array:
        """Run the forward on ``x``; return the output."""
        raise NotImplementedError

    def backward(self, env: Env, dy: Array) -> Array | None:
        """Run the backward; return the input gradient (None without ``input_grad``)."""
        raise NotImplementedError

    def own_parameters(self, env: Env) -> list[Param]:
        """This layer's own parameters (not its children's), named without a prefix."""
        return []

    def children(self) -> list[tuple[str, "Layer"]]:
        """Sub-layers by attribute name, in registration order."""
        return []

    def parameters(self, env: Env, prefix: str = "") -> Iterator[Param]:
        """Every parameter of this layer and its children, in the order of
        :meth:`pympar.modules.Module.named_parameters`."""
        for p in self.own_parameters(env):
            yield Param(f"{prefix}{p.name}", p.shape, p.itemsize, p.split)
        for name, child in self.children():
            yield from child.parameters(env, f"{prefix}{name}.")

    def layers(self) -> Iterator["Layer"]:
        """This layer and every descendant, pre-order."""
        yield self
        for _, child in self.children():
            yield from child.layers()


class Linear(Layer):
    """:class:`pympar.modules.Linear`: replicated ``x @ W.T + b``; caches its input."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_grad: bool = True) -> None:
        self.in_features, self.out_features, self.bias = in_features, out_features, bias
        self.input_grad = input_grad

    def own_parameters(self, env: Env) -> list[Param]:
        params = [Param("weight", (self.out_features, self.in_features), env.itemsize)]
        return params + ([Param("bias", (self.out_features,), env.itemsize)] if self.bias else [])

    def forward(self, env: Env, x: Array) -> Array:
        rows = x.size // self.in_features
        env.save(self, x)  # x2d: a view of x
        matmul_work(env, "linear.forward", rows, self.in_features, self.out_features,
                    3 if self.bias else 1)
        return env.array((*x.shape[:-1], self.out_features))

    def backward(self, env: Env, dy: Array) -> Array | None:
        (x,) = env.release(self)
        rows = x.size // self.in_features
        matmul_work(env, "linear.backward", self.out_features, rows, self.in_features)
        if self.bias:
            env.compute("linear.backward", 0, dy.nbytes)
        if not self.input_grad:
            return None
        matmul_work(env, "linear.backward", rows, self.out_features, self.in_features)
        return env.array(x.shape)


class LayerNorm(Layer):
    """:class:`pympar.modules.LayerNorm` over the last axis; caches ``xhat`` and ``rstd``."""

    def __init__(self, hidden: int) -> None:
        self.hidden = hidden

    def own_parameters(self, env: Env) -> list[Param]:
        return [Param("weight", (self.hidden,), env.itemsize),
                Param("bias", (self.hidden,), env.itemsize)]

    def forward(self, env: Env, x: Array) -> Array:
        env.save(self, x.like(), x.like((*x.shape[:-1], 1)))
        env.compute("layernorm.forward", 0, x.nbytes)
        return x.like()

    def backward(self, env: Env, dy: Array) -> Array:
        xhat, _ = env.release(self)
        env.compute("layernorm.backward", 0, xhat.nbytes)
        return xhat.like()


class GELU(Layer):
    """:class:`pympar.modules.GELU`: caches its input and the tanh."""

    def forward(self, env: Env, x: Array) -> Array:
        env.save(self, x, x.like())
        env.compute("gelu.forward", 0, x.nbytes)
        return x.like()

    def backward(self, env: Env, dy: Array) -> Array:
        x, _ = env.release(self)
        env.compute("gelu.backward", 0, x.nbytes)
        return x.like()


class Sequential(Layer):
    """:class:`pympar.modules.Sequential`: children ``"0"``, ``"1"``, ...

    Parameters
    ----------
    *layers : Layer
    names : sequence of str, optional
        Attribute names instead of ``"0"``, ``"1"``, ... (a model's own container).
    """

    def __init__(self, *layers: Layer, names: Iterable[str] | None = None) -> None:
        self.items = list(zip(names or map(str, range(len(layers))), layers))

    @property  # type: ignore[override]
    def input_grad(self) -> bool:
        return self.items[0][1].input_grad if self.items else True

    def children(self) -> list[tuple[str, Layer]]:
        return list(self.items)

    def forward(self, env: Env, x: Array) -> Array:
        for _, layer in self.items:
            x = layer.forward(env, x)
        return x

    def backward(self, env: Env, dy: Array) -> Array | None:
        for _, layer in reversed(self.items):
            dy = layer.backward(env, dy)
        return dy


class Recompute(Layer):
    """:class:`pympar.modules.Recompute`: keeps its input only; backward runs the forward
    again (its collectives and checks too), then the wrapped backward.

    Parameters
    ----------
    inner : Layer
    on_backward : callable, optional
        Called with the env after the recomputation, when the inner caches are full (the
        examples' peak probe).
    """

    def __init__(self, inner: Layer, on_backward=None) -> None:
        self.inner, self.on_backward = inner, on_backward

    @property  # type: ignore[override]
    def input_grad(self) -> bool:
        return self.inner.input_grad

    def parameters(self, env: Env, prefix: str = "") -> Iterator[Param]:
        # The wrapped block keeps its own names (the model registers it under its name).
        return iter(())

    def forward(self, env: Env, x: Array) -> Array:
        y = self.inner.forward(env, x)
        for layer in self.inner.layers():
            env.release(layer)
        env.save(self, x)
        return y

    def backward(self, env: Env, dy: Array) -> Array | None:
        (x,) = env.release(self)
        self.inner.forward(env, x)
        return self.inner.backward(env, dy)
