"""Multi-head self-attention: sequence-parallel (Ulysses) and tensor-parallel.

Activations are ``[S, B, H]`` (sequence first); inside attention ``q``, ``k``, ``v``
are ``[S, B, heads, dh]``, with heads contiguous in ``H`` (head ``h`` owns columns
``h*dh:(h+1)*dh``). :class:`DistributedAttention` takes a sequence shard ``[S/P, B, H]``
and uses the all-to-all mappings to trade it for a head shard ``[S, B, heads/P, dh]``
around the attention core, so every head sees the whole sequence (it is
:class:`~pympar.modules.ContextAttention` with ``scheme="ulysses"``).
:class:`ParallelAttention` splits the heads over the tensor-parallel group with a fused
QKV :class:`~pympar.modules.ColumnParallelLinear` and an output
:class:`~pympar.modules.RowParallelLinear`. Both take ``causal=`` and, per call,
padding ``key_lengths``.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy

from ..backend import array_module
from ..group import Group
from ..manager import resolve_group
from .blockwise import check_key_lengths, key_mask
from .context_attention import ContextAttention
from .core import Module
from .parallel_linear import ColumnParallelLinear, RowParallelLinear
from .validation import check_array

__all__ = ["attention_forward", "attention_backward", "DistributedAttention", "ParallelAttention"]


def attention_forward(q: Any, k: Any, v: Any, mask: Any = None) -> tuple[Any, tuple]:
    """Softmax attention over axis 0 of ``[S, B, heads, dh]`` arrays.

    Parameters
    ----------
    q, k, v : array
        ``[S, B, heads, dh]``.
    mask : array of bool, optional
        Broadcastable to ``[B, heads, S, S]``, True where a query may see a key (see
        :func:`~pympar.modules.blockwise.key_mask`); every query must see some key.

    Returns
    -------
    out : array
        ``[S, B, heads, dh]``.
    cache : tuple
        What :func:`attention_backward` needs.
    """
    xp = array_module(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    # [B, heads, S, dh]: batched matmuls over (B, heads)
    qh, kh, vh = (a.transpose(1, 2, 0, 3) for a in (q, k, v))
    probs = xp.matmul(qh, kh.swapaxes(-1, -2))
    probs *= scale
    if mask is not None:
        xp.copyto(probs, -numpy.inf, where=~mask)  # exp(-inf) = 0: hidden keys get no weight
    probs -= probs.max(axis=-1, keepdims=True)
    xp.exp(probs, out=probs)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = xp.matmul(probs, vh).transpose(2, 0, 1, 3)
    return xp.ascontiguousarray(out), (qh, kh, vh, probs, scale)


def attention_backward(dout: Any, cache: tuple) -> tuple[Any, Any, Any]:
    """Gradients ``(dq, dk, dv)`` of :func:`attention_forward`, each ``[S, B, heads, dh]``."""
    xp = array_module(dout)
    qh, kh, vh, probs, scale = cache
    dh = dout.transpose(1, 2, 0, 3)
    dv = xp.matmul(probs.swapaxes(-1, -2), dh)
    dscores = xp.matmul(dh, vh.swapaxes(-1, -2))
    # softmax backward: P * (dP - rowsum(dP * P))
    dscores -= (dscores * probs).sum(axis=-1, keepdims=True)
    dscores *= probs
    dscores *= scale
    dq = xp.matmul(dscores, kh)
    dk = xp.matmul(dscores.swapaxes(-1, -2), qh)
    back = lambda a: xp.ascontiguousarray(a.transpose(2, 0, 1, 3))  # noqa: E731
    return back(dq), back(dk), back(dv)


def _check_heads(layer: str, hidden: int, num_heads: int) -> int:
    if num_heads < 1 or hidden % num_heads:
        raise ValueError(f"{layer}: hidden size {hidden} is not divisible by num_heads {num_heads}")
    return hidden // num_heads


class DistributedAttention(ContextAttention):
    """Sequence-parallel multi-head self-attention (DeepSpeed-Ulysses style).

    :class:`~pympar.modules.ContextAttention` with ``scheme="ulysses"``. The input is this
    rank's sequence block ``[S_local, B, hidden]`` of the context-parallel group (the balanced
    split). Q, K and V come from one fused projection, one all-to-all turns the sequence shard
    into a head shard (heads need not divide the group size: they are split by the balanced
    rule), attention runs on whole sequences, and one all-to-all returns to the sequence shard
    before the output projection. Projection weights are replicated; their gradients are
    partial sums over the sequence, to be summed over the context group (e.g.
    :func:`pympar.optim.allreduce_gradients` over the data-context group).

    Parameters
    ----------
    hidden : int
    num_heads : int
    group : Group, optional
        Context-parallel group; the current one by default.
    bias : bool
    dtype : dtype
    seed : int
        ``seed`` seeds the QKV projection, ``seed + 1`` the output projection.
    xp : module, optional
    causal : bool
        Hide keys after each query; ``forward(x, key_lengths=)`` also takes padding lengths.
    input_grad : bool
        False: :meth:`backward` returns None and computes no input gradient.

    Attributes
    ----------
    qkv : Linear
        ``hidden -> 3*hidden``, rows ordered ``[q; k; v]``, heads contiguous.
    proj : Linear
        ``hidden -> hidden``.
    """

    def __init__(self, hidden: int, num_heads: int, group: Group | None = None, bias: bool = True,
                 dtype: Any = numpy.float32, seed: int = 0, xp: Any = None, causal: bool = False,
                 input_grad: bool = True) -> None:
        super().__init__(hidden, num_heads, "ulysses", group=group, causal=causal, bias=bias,
                         dtype=dtype, seed=seed, xp=xp, input_grad=input_grad)


class ParallelAttention(Module):
    """Tensor-parallel multi-head self-attention built from Column and Row layers.

    Each rank of the tensor-parallel group owns ``num_heads / P`` heads: the
    fused QKV projection is a :class:`ColumnParallelLinear` with ``stride=3``
    (every rank holds its heads of Q, K and V), and the output projection a
    :class:`RowParallelLinear` with ``input_is_parallel=True``. One all-reduce
    in forward and one in backward (or all-gather / reduce-scatter of the
    sequence with ``use_sequence_parallel``).

    Parameters
    ----------
    hidden, num_heads : int
        ``num_heads`` must be divisible by the group size.
    group : Group, optional
        Tensor-parallel group; the current one by default.
    use_sequence_parallel : bool
        Input and output are sequence blocks ``[S_local, B, hidden]``.
    bias : bool
    dtype : dtype
    seed : int
        ``seed`` seeds QKV, ``seed + 1`` the output projection.
    xp : module, optional
    causal : bool
        Hide keys after each query; ``forward(x, key_lengths=)`` also takes padding lengths.
    input_grad : bool
        False: :meth:`backward` returns None, and the QKV layer computes no input gradient
        and issues no collective for it.
    """

    def __init__(self, hidden: int, num_heads: int, group: Group | None = None,
                 use_sequence_parallel: bool = False, bias: bool = True,
                 dtype: Any = numpy.float32, seed: int = 0, xp: Any = None,
                 causal: bool = False, input_grad: bool = True) -> None:
        super().__init__()
        self.causal, self.input_grad = bool(causal), bool(input_grad)
        self.head_dim = _check_heads("ParallelAttention", hidden, num_heads)
        group = resolve_group(group, "ParallelAttention")
        if num_heads % group.size:
            raise ValueError(f"ParallelAttention: num_heads {num_heads} is not divisible by the "
                             f"tensor-parallel size {group.size}")
        self.hidden, self.num_heads = int(hidden), int(num_heads)
        self.local_heads = num_heads // group.size
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, bias, gather_output=False,
                                        use_sequence_parallel=use_sequence_parallel, dtype=dtype,
                                        group=group, seed=seed, stride=3, xp=xp)
        self.proj = RowParallelLinear(hidden, hidden, bias, input_is_parallel=True,
                                      use_sequence_parallel=use_sequence_parallel, dtype=dtype,
                                      group=group, seed=seed + 1, xp=xp)
        # The projections' collectives look alike whatever the heads and mask: agreed here.
        self.label_calls(f"ParallelAttention(heads={self.num_heads}, causal={self.causal})")

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, num_heads={self.num_heads}, local_heads={self.local_heads}"

    def forward(self, x: Any, key_lengths: Any = None) -> Any:
        """Self-attention of ``x`` (``[S, B, hidden]``, or a sequence block).

        ``key_lengths`` (``[B]`` integers, optional): keys at positions ``>= key_lengths[b]``
        are padding.
        """
        group, sp = self.qkv.group, self.qkv.use_sequence_parallel
        lens = None if key_lengths is None else numpy.asarray(
            key_lengths.get() if hasattr(key_lengths, "get") else key_lengths)
        # The key lengths are local work that no collective sees: agreed with the input.
        extra = () if lens is None else (f"key_lengths {lens.dtype.str} {lens.shape} of "
                                         f"checksum {zlib.crc32(lens.tobytes()):08x}",)
        with self.agreement("forward", x, group, (0,) if sp else (), extra=extra):
            qkv = self.qkv.forward(x)
            seq, batch = qkv.shape[0], qkv.shape[1]
            lens = check_key_lengths(type(self).__name__, lens, batch, seq)
            pos = numpy.arange(seq)
            mask = key_mask(array_module(x), pos, pos, self.causal, lens)
            qkv = qkv.reshape(seq, batch, 3, self.local_heads, self.head_dim)
            out, cache = attention_forward(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], mask)
            y = self.proj.forward(out.reshape(seq, batch, self.local_heads * self.head_dim))
            self.save_for_backward(cache, y.shape)
            return y

    def backward(self, dy: Any) -> Any:
        """Return the input gradient (None with ``input_grad=False``); accumulate parameters'."""
        cache, y_shape = self.saved_tensors()
        with self.agreement("backward", dy, self.qkv.group,
                            (0,) if self.qkv.use_sequence_parallel else (),
                            validate=(check_array, self, dy, None, self.qkv.dtype,
                                      "output gradient", y_shape)):
            return self._backward(self.proj.backward(dy), cache)

    def _backward(self, dout: Any, cache: tuple) -> Any:
        if not self.input_grad and not any(p.requires_grad for p in self.qkv.parameters()):
            self.qkv.saved_tensors()  # its backward is skipped: release its cache unused
            return None  # nothing below the output projection needs a gradient
        seq, batch = dout.shape[0], dout.shape[1]
        dout = dout.reshape(seq, batch, self.local_heads, self.head_dim)
        dqkv = array_module(dout).stack(attention_backward(dout, cache), axis=2)
        # set here, not in __init__: Sequential may switch input_grad off after construction
        self.qkv.input_grad = self.input_grad
        dx = self.qkv.backward(dqkv.reshape(seq, batch, 3 * self.local_heads * self.head_dim))
        return dx if self.input_grad else None
