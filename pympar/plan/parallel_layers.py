"""Descriptions of pympar's parallel layers: their collectives, checks, caches and work.

Each mirrors its layer in :mod:`pympar.modules` line for line where it communicates: the
same mapping or collective, on the same group, with the same shapes, so its
:class:`~pympar.plan.ledger.Call` s equal what :mod:`pympar.stats` records. The agreement
checks are those of :meth:`pympar.modules.Module.agreement` (one per parallel layer's forward
and backward), of every collective on more than one rank, and of gathers that learn their
extents (``"extents"``: the check, then one small all-gather).

Groups are named by role (see :class:`~pympar.plan.ledger.Site`): ``"tp"``, ``"cp"``, the
3D groups ``"3d_input"``, ``"3d_weight"``, ``"3d_output"``, the attention's ``"ulysses"`` and
``"ring"`` groups (the context group itself, or a group of one, outside ``"hybrid"``), the
spatial group of a spectral layer.
"""

from __future__ import annotations

import math

from ..partition import balanced_sizes
from .layers import GELU, Layer, Linear, Param, matmul_work
from .program import Array, Env, transposed

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ContextAttention", "Linear3D",
           "SpectralBlock", "collective"]


def collective(env: Env, role: str, operation: str, primitive: str, bytes_in: int,
               bytes_out: int, learns_extents: bool = False) -> None:
    """A collective of :mod:`pympar.collectives` on ``role``: its check (with the extents
    exchange of a gather given no sizes) and the call, which records itself on one rank too."""
    env.check(role, "extents" if learns_extents else "board")
    env.call(role, operation, primitive, bytes_in, bytes_out, recorded_alone=True)


def _mine(n: int, env: Env, role: str) -> int:
    """This rank's share of ``n`` over the group of ``role`` (balanced rule)."""
    return balanced_sizes(n, env.site.size(role))[env.site.rank(role)]


class ColumnParallelLinear(Layer):
    """:class:`pympar.modules.ColumnParallelLinear` (no sequence parallelism): output
    features split over ``role``; the input gradient all-reduced."""

    def __init__(self, in_features: int, out_features: int, gather_output: bool = True,
                 bias: bool = True, role: str = "tp", input_grad: bool = True) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.bias, self.role = gather_output, bias, role
        self.input_grad = input_grad

    def own_parameters(self, env: Env) -> list[Param]:
        out = _mine(self.out_features, env, self.role)
        split = env.site.size(self.role) > 1
        return [Param("weight", (out, self.in_features), env.itemsize, split)] + (
            [Param("bias", (out,), env.itemsize, split)] if self.bias else [])

    def forward(self, env: Env, x: Array) -> Array:
        env.check(self.role)
        rows, out = x.size // self.in_features, _mine(self.out_features, env, self.role)
        env.save(self, x)
        matmul_work(env, "linear.forward", rows, self.in_features, out, 3 if self.bias else 1)
        y = env.array((*x.shape[:-1], out))
        if self.gather_output:
            env.call(self.role, "gather_from_hidden.forward", "all_gather", y.nbytes,
                     rows * self.out_features * env.itemsize)
            y = env.array((*x.shape[:-1], self.out_features))
        return y

    def backward(self, env: Env, dy: Array) -> Array | None:
        (x,) = env.release(self)
        env.check(self.role)
        rows, out = x.size // self.in_features, _mine(self.out_features, env, self.role)
        matmul_work(env, "linear.backward", out, rows, self.in_features)
        if self.bias:
            env.compute("linear.backward", 0, rows * out * env.itemsize)
        if not self.input_grad:
            return None
        matmul_work(env, "linear.backward", rows, out, self.in_features)
        env.call(self.role, "copy_to_all.backward", "all_reduce", x.nbytes, x.nbytes)
        return x.like()


class RowParallelLinear(Layer):
    """:class:`pympar.modules.RowParallelLinear` (no sequence parallelism): input features
    split over ``role``; the output all-reduced, the bias replicated."""

    def __init__(self, in_features: int, out_features: int, input_is_parallel: bool = True,
                 bias: bool = True, role: str = "tp", input_grad: bool = True) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.bias, self.role = input_is_parallel, bias, role
        self.input_grad = input_grad

    def own_parameters(self, env: Env) -> list[Param]:
        width = _mine(self.in_features, env, self.role)
        split = env.site.size(self.role) > 1
        return [Param("weight", (self.out_features, width), env.itemsize, split)] + (
            [Param("bias", (self.out_features,), env.itemsize)] if self.bias else [])

    def forward(self, env: Env, x: Array) -> Array:
        env.check(self.role)
        width = _mine(self.in_features, env, self.role)
        if not self.input_is_parallel and env.site.size(self.role) > 1:
            x = env.array((*x.shape[:-1], width))  # my block of the last axis, a copy
        rows = x.size // width if width else 0
        env.save(self, x)
        matmul_work(env, "linear.forward", rows, width, self.out_features,
                    3 if self.bias else 1)
        y = env.array((*x.shape[:-1], self.out_features))
        env.call(self.role, "reduce_from_all.forward", "all_reduce", y.nbytes, y.nbytes)
        return y

    def backward(self, env: Env, dy: Array) -> Array | None:
        (x,) = env.release(self)
        env.check(self.role)
        width = _mine(self.in_features, env, self.role)
        rows = dy.size // self.out_features
        matmul_work(env, "linear.backward", self.out_features, rows, width)
        if self.bias:
            env.compute("linear.backward", 0, dy.nbytes)
        if not self.input_grad:
            return None
        matmul_work(env, "linear.backward", rows, self.out_features, width)
        dx = x.like()
        if self.input_is_parallel:
            return dx
        env.call(self.role, "scatter_to_hidden.backward", "all_gather", dx.nbytes,
                 rows * self.in_features * env.itemsize)
        return env.array((*x.shape[:-1], self.in_features))


class ContextAttention(Layer):
    """:class:`pympar.modules.ContextAttention` on ``[n, B, hidden]`` blocks: an all-to-all
    over ``"ulysses"`` each way, key/value blocks around ``"ring"`` (contiguous layout, no
    mask).

    Parameters
    ----------
    hidden, heads : int
    sequence : int
        The global sequence length (every context rank's block follows from it).
    """

    def __init__(self, hidden: int, heads: int, sequence: int, input_grad: bool = True) -> None:
        self.hidden, self.heads, self.sequence = hidden, heads, sequence
        self.head_dim = hidden // heads
        self.qkv = Linear(hidden, 3 * hidden)
        self.proj = Linear(hidden, hidden)
        self.input_grad = input_grad

    def children(self) -> list[tuple[str, Layer]]:
        return [("qkv", self.qkv), ("proj", self.proj)]

    def _ring_rows(self, env: Env) -> list[int]:
        """Rows of every ring rank: the context rows of its Ulysses group."""
        blocks = balanced_sizes(self.sequence, env.site.size("cp"))
        u, rings = env.site.size("ulysses"), env.site.size("ring")
        return [sum(blocks[j * u:(j + 1) * u]) for j in range(rings)]

    def _kv(self, env: Env, rows: list[int]) -> list[int]:
        """Bytes of the key/value block of every ring rank (``rows`` each, this rank's
        heads)."""
        each = 2 * self._batch * _mine(self.heads, env, "ulysses") * self.head_dim * env.itemsize
        return [each * n for n in rows]

    def forward(self, env: Env, x: Array) -> Array:
        n, self._batch = x.shape[0], x.shape[1]
        env.check("cp", "extents")
        heads = _mine(self.heads, env, "ulysses")
        rows = self._ring_rows(env)
        r, ring = env.site.rank("ring"), env.site.size("ring")
        qkv = self.qkv.forward(env, x).view((n, self._batch, 3, self.heads, self.head_dim))
        if env.site.size("ulysses") > 1:
            shape = (rows[r], self._batch, 3, heads, self.head_dim)
            env.call("ulysses", "all_to_all_from_sequence_to_hidden.forward", "all_to_all",
                     qkv.nbytes, math.prod(shape) * env.itemsize)
            env.check("ulysses")
            qkv = env.array(shape)
        qkvh = transposed(qkv, (2, 1, 3, 0, 4))
        if ring > 1:
            env.check("ring")
        kv = self._kv(env, rows)
        for t in range(ring):
            src = (r - t) % ring
            if t < ring - 1:
                env.call("ring", "ring_attention.forward", "ring_transfer", kv[src],
                         kv[(src - 1) % ring])
            env.compute("attention.forward", 4.0 * self._batch * heads * rows[r] * rows[src]
                        * self.head_dim, self._batch * heads * rows[r] * rows[src]
                        * env.itemsize)
        out_h = env.array((self._batch, heads, rows[r], self.head_dim))
        lse = env.array((self._batch, heads, rows[r]))
        out = transposed(out_h, (2, 0, 1, 3))
        if env.site.size("ulysses") > 1:
            env.call("ulysses", "all_to_all_from_hidden_to_sequence.forward", "all_to_all",
                     out.nbytes, n * self._batch * self.hidden * env.itemsize)
            env.check("ulysses")
            out = env.array((n, self._batch, self.heads, self.head_dim))
        env.save(self, qkvh, out_h, lse)
        return self.proj.forward(env, out.view((n, self._batch, self.hidden)))

    def backward(self, env: Env, dy: Array) -> Array | None:
        qkvh, _, _ = env.release(self)
        env.check("cp")
        n, heads = dy.shape[0], _mine(self.heads, env, "ulysses")
        rows = self._ring_rows(env)
        r, ring = env.site.rank("ring"), env.site.size("ring")
        dout = self.proj.backward(env, dy)
        if env.site.size("ulysses") > 1:
            env.check("ulysses")
            env.call("ulysses", "all_to_all_from_hidden_to_sequence.backward", "all_to_all",
                     dout.nbytes, rows[r] * self._batch * heads * self.head_dim * env.itemsize)
        if ring > 1:
            env.check("ring")
        blocks = self._kv(env, rows)
        kv = [blocks[(r - t) % ring] for t in range(ring)]
        for t in range(ring):
            src = (r - t) % ring
            if t < ring - 1:
                env.call("ring", "ring_attention.backward", "ring_transfer", kv[t], kv[t + 1])
            if t > 0:
                env.call("ring", "ring_attention.backward", "ring_transfer", 0, kv[t])
            env.call("ring", "ring_attention.backward", "ring_transfer", kv[t], 0)
            env.compute("attention.backward", 10.0 * self._batch * heads * rows[r] * rows[src]
                        * self.head_dim, self._batch * heads * rows[r] * rows[src]
                        * env.itemsize)
        env.call("ring", "ring_attention.backward", "ring_transfer", 0, kv[0])
        dqkv = transposed(qkvh.like(), (3, 1, 0, 2, 4))
        if env.site.size("ulysses") > 1:
            env.check("ulysses")
            env.call("ulysses", "all_to_all_from_sequence_to_hidden.backward", "all_to_all",
                     dqkv.nbytes, n * self._batch * 3 * self.hidden * env.itemsize)
            dqkv = env.array((n, self._batch, 3 * self.hidden))
        dx = self.qkv.backward(env, dqkv.view((n, self._batch, 3 * self.hidden)))
        return dx if self.input_grad else None


class Linear3D(Layer):
    """:class:`pympar.modules.Linear3D` on a cube (roles ``"3d_input"``, ``"3d_weight"``,
    ``"3d_output"``; ``swap`` exchanges input and output), its input ``(rows block, in
    block)``.

    Parameters
    ----------
    in_features, out_features : int
    rows : int
        The rows of the whole activation the cube splits (every rank's block follows).
    swap : bool
    """

    def __init__(self, in_features: int, out_features: int, rows: int, swap: bool = False,
                 bias: bool = True, input_grad: bool = True) -> None:
        self.in_features, self.out_features, self.rows = in_features, out_features, rows
        self.swap, self.bias, self.input_grad = swap, bias, input_grad
        self.a, self.c = ("3d_output", "3d_input") if swap else ("3d_input", "3d_output")

    def _blocks(self, env: Env) -> tuple[int, ...]:
        """``(rows of block w, of its sub-block c, in block c, out block a, its sub-block w)``."""
        w = "3d_weight"
        rows_w = _mine(self.rows, env, w)
        out_a = _mine(self.out_features, env, self.a)
        return (rows_w, _mine(rows_w, env, self.c), _mine(self.in_features, env, self.c),
                out_a, _mine(out_a, env, w))

    def own_parameters(self, env: Env) -> list[Param]:
        _, _, in_c, _, out_aw = self._blocks(env)
        return [Param("weight", (out_aw, in_c), env.itemsize, True)] + (
            [Param("bias", (out_aw,), env.itemsize, True)] if self.bias else [])

    def forward(self, env: Env, x: Array) -> Array:
        s, op = env.itemsize, "Linear3D.forward:"
        rows_w, rows_wc, in_c, out_a, out_aw = self._blocks(env)
        env.check("tp")
        collective(env, self.a, op + "all_gather", "all_gather", x.nbytes, rows_w * in_c * s,
                   learns_extents=True)
        collective(env, "3d_weight", op + "all_gather", "all_gather", out_aw * in_c * s,
                   out_a * in_c * s)
        matmul_work(env, "linear.forward", rows_w, in_c, out_a)
        collective(env, self.c, op + "reduce_scatter", "reduce_scatter", rows_w * out_a * s,
                   rows_wc * out_a * s)
        if self.bias:
            collective(env, "3d_weight", op + "all_gather", "all_gather", out_aw * s, out_a * s)
        env.save(self, env.array((rows_w, in_c)), env.array((out_a, in_c)))
        return env.array((rows_wc, out_a))

    def backward(self, env: Env, dy: Array) -> Array | None:
        env.release(self)
        s, op = env.itemsize, "Linear3D.backward:"
        rows_w, rows_wc, in_c, out_a, out_aw = self._blocks(env)
        env.check("tp")
        collective(env, self.c, op + "all_gather", "all_gather", dy.nbytes, rows_w * out_a * s,
                   learns_extents=True)
        matmul_work(env, "linear.backward", out_a, rows_w, in_c)
        collective(env, "3d_weight", op + "reduce_scatter", "reduce_scatter", out_a * in_c * s,
                   out_aw * in_c * s)
        if self.bias:
            collective(env, "3d_weight", op + "reduce_scatter", "reduce_scatter", out_a * s,
                       out_aw * s)
        if not self.input_grad:
            return None
        matmul_work(env, "linear.backward", rows_w, out_a, in_c)
        collective(env, self.a, op + "reduce_scatter", "reduce_scatter", rows_w * in_c * s,
                   _mine(rows_w, env, self.a) * in_c * s)
        return env.array((_mine(rows_w, env, self.a), in_c))


class SpectralBlock(Layer):
    """:class:`pympar.modules.fno.SpectralBlock` on 2-D fields ``(batch, x1 block, x2,
    width)``, ``x1`` split over ``role``: one all-to-all of the kept modes each way, per
    direction (the backward's second only with ``input_grad``).

    Parameters
    ----------
    width : int
        Channels.
    modes : tuple of int
        Modes kept along ``x1`` and ``x2``.
    grid : tuple of int
        The global ``(x1, x2)`` extents.
    """

    def __init__(self, width: int, modes: tuple[int, int], grid: tuple[int, int],
                 activation: bool = True, role: str = "x", input_grad: bool = True) -> None:
        self.width, self.modes, self.grid, self.role = width, modes, grid, role
        self.pointwise = Linear(width, width)
        self.act = GELU() if activation else None
        self.input_grad = input_grad

    def children(self) -> list[tuple[str, Layer]]:
        return [("pointwise", self.pointwise)] + ([("act", self.act)] if self.act else [])

    def parameters(self, env: Env, prefix: str = ""):
        m1, m2 = self.modes
        split = env.site.size(self.role) > 1
        shape = (2 * m1, _mine(m2, env, self.role) if split else m2, self.width, self.width)
        yield Param(f"{prefix}spectral.weight_real", shape, env.itemsize, split)
        yield Param(f"{prefix}spectral.weight_imag", shape, env.itemsize, split)
        yield from super().parameters(env, prefix)

    def _exchanges(self, env: Env, direction: str, both: bool) -> None:
        """The all-to-all of the kept modes (and back): whole ``x1`` <-> whole modes."""
        if env.site.size(self.role) == 1:
            return
        rows, cs = self._rows, 2 * env.itemsize
        mine = self._batch * rows * self.modes[1] * self.width * cs
        whole = self._batch * self.grid[0] * _mine(self.modes[1], env, self.role) * self.width * cs
        operation = f"SpectralConv.{direction}"
        collective(env, self.role, operation, "all_to_all", mine, whole, learns_extents=True)
        if both:
            collective(env, self.role, operation, "all_to_all", whole, mine,
                       learns_extents=True)

    def _spectral_work(self, env: Env, kind: str) -> None:
        """The local transforms and the per-mode products of one direction."""
        (n1, n2), (m1, m2), w = self.grid, self.modes, self.width
        split = env.site.size(self.role) > 1
        m2l = _mine(m2, env, self.role) if split else m2
        b, rows = self._batch, self._rows
        flops = (2.5 * b * rows * w * n2 * math.log2(max(n2, 2)) * 2
                 + 5.0 * b * m2l * w * n1 * math.log2(max(n1, 2)) * 2
                 + 8.0 * b * 2 * m1 * m2l * w * w)
        env.compute(kind, flops, b * rows * n2 * w * env.itemsize)

    def forward(self, env: Env, x: Array) -> Array:
        self._batch, self._rows = x.shape[0], x.shape[1]
        m1, m2 = self.modes
        split = env.site.size(self.role) > 1
        m2l = _mine(m2, env, self.role) if split else m2
        self._exchanges(env, "forward", True)
        self._spectral_work(env, "spectral.forward")
        cs = 2 * env.itemsize
        env.save(self, env.array((self._batch, 2 * m1 * m2l, self.width), cs),
                 env.array((2 * m1 * m2l, self.width, self.width), cs))
        self.pointwise.forward(env, x)
        y = x.like()
        env.compute("add", 0, y.nbytes)
        return y if self.act is None else self.act.forward(env, y)

    def backward(self, env: Env, dy: Array) -> Array | None:
        g = dy if self.act is None else self.act.backward(env, dy)
        env.release(self)
        self._exchanges(env, "backward", self.input_grad)
        self._spectral_work(env, "spectral.backward")
        dx = self.pointwise.backward(env, g)
        if not self.input_grad:
            return None
        env.compute("add", 0, dx.nbytes)
        return dx
