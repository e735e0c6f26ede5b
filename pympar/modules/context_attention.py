"""Context-parallel self-attention: Ulysses, ring, or Ulysses inside a sub-group and ring across.

:class:`ContextAttention` takes this rank's sequence block ``[n, B, hidden]`` of the
context-parallel group (``P`` ranks) and returns the attention output for the same rows. The
three schemes are one algorithm with two group sizes, ``P = U * R``:

* ``"ulysses"`` (``U = P``, ``R = 1``): an all-to-all trades the sequence shard for a head shard,
  every rank attends over the whole sequence for its heads, and an all-to-all returns.
* ``"ring"`` (``U = 1``, ``R = P``): key/value blocks travel around the ring
  (:mod:`pympar.modules.ring_attention`); any number of heads.
* ``"hybrid"``: an all-to-all inside each Ulysses group of ``U`` consecutive context ranks, ring
  attention across the ``R`` groups for the heads it got, and the all-to-all back.

Sequence layout: context rank ``c`` holds the rows :func:`~pympar.modules.blockwise.
sequence_segments` gives it (``layout="contiguous"``: block ``c`` of the balanced split;
``"zigzag"``: chunks ``c`` and ``2P-1-c`` of ``2P``, which balances causal work over the ring).
Masks: ``causal`` (constructor) and ``key_lengths`` (per call, padding); positions are global,
so the three schemes give the same result for the same input.

Forward and backward run inside a :func:`pympar.mappings.label` naming the layer's settings,
which the agreement checks of its all-to-alls and of the ring
(:func:`pympar.collectives.agree`) compare: ranks that built different layers raise
:class:`~pympar.debug.CollectiveMismatchError`.
"""

from __future__ import annotations

from typing import Any

import numpy
from mpi4py import MPI

from .. import mappings
from ..backend import array_module, is_cupy_array
from ..group import Group
from ..manager import resolve_group
from ..partition import balanced_sizes
from .blockwise import check_key_lengths, sequence_segments
from .core import Module
from .linear import Linear
from .ring_attention import ring_attention_backward, ring_attention_forward

__all__ = ["ContextAttention", "split_context_group"]

SCHEMES = ("ulysses", "ring", "hybrid")


def split_context_group(group: Group, ulysses_size: int) -> tuple[Group, Group]:
    """Split a context group into Ulysses groups of consecutive ranks and ring groups across.

    Collective over ``group``: every member must call it, with the same ``ulysses_size``.
    Context rank ``c`` lands in Ulysses group ``c // U`` (at position ``c % U``) and ring group
    ``c % U`` (at position ``c // U``).

    Returns
    -------
    ulysses, ring : Group
        Named ``"ulysses-<global ranks>"`` and ``"ring-<global ranks>"``.
    """
    u, c = int(ulysses_size), group.rank
    if u < 1 or group.size % u:
        raise ValueError(f"ContextAttention: ulysses_size {ulysses_size} does not divide the "
                         f"context-parallel size {group.size}")
    inner = [group.ranks[i] for i in range((c // u) * u, (c // u + 1) * u)]
    across = list(group.ranks[c % u::u])
    return (Group(group.comm.Split(c // u, c % u), "ulysses-" + "-".join(map(str, inner)), inner),
            Group(group.comm.Split(c % u, c // u), "ring-" + "-".join(map(str, across)), across))


def _rows(segments: list, ring: Group | None) -> int:
    """Rows of this rank's Ulysses group: the ring rank's segments."""
    return sum(b - a for a, b in segments[0 if ring is None else ring.rank])


class ContextAttention(Module):
    """Context-parallel multi-head self-attention with a choice of scheme.

    Parameters
    ----------
    hidden, num_heads : int
    scheme : {"ulysses", "ring", "hybrid"}
    group : Group, optional
        Context-parallel group; the current one by default.
    ulysses_size : int, optional
        ``"hybrid"`` only: ranks per Ulysses group (must divide the group size). The Ulysses and
        ring groups are made from ``group`` with ``Comm.Split`` in the constructor, which is
        therefore collective over ``group`` (see :func:`split_context_group`).
    groups : (Group, Group), optional
        ``"hybrid"`` only, instead of ``ulysses_size``: ready Ulysses and ring groups, laid out
        as :func:`split_context_group` makes them.
    causal : bool
        Hide keys after each query.
    layout : {"contiguous", "zigzag"}
        Which sequence rows each context rank holds (module docstring).
    bias : bool
    dtype : dtype
    seed : int
        ``seed`` seeds the QKV projection, ``seed + 1`` the output projection.
    xp : module, optional
    input_grad : bool
        False: :meth:`backward` returns None and computes no input gradient.

    Attributes
    ----------
    qkv : Linear
        ``hidden -> 3*hidden``, rows ``[q; k; v]``, heads contiguous; replicated.
    proj : Linear
        ``hidden -> hidden``; replicated.

    Notes
    -----
    Projection gradients are partial sums over this rank's rows; sum them over the context
    group (e.g. :func:`pympar.optim.allreduce_gradients` over the data-context group).
    """

    def __init__(self, hidden: int, num_heads: int, scheme: str = "ring",
                 group: Group | None = None, ulysses_size: int | None = None,
                 groups: tuple[Group, Group] | None = None, causal: bool = False,
                 layout: str = "contiguous", bias: bool = True, dtype: Any = numpy.float32,
                 seed: int = 0, xp: Any = None, input_grad: bool = True) -> None:
        super().__init__()
        if num_heads < 1 or hidden % num_heads:
            raise ValueError(f"{type(self).__name__}: hidden size {hidden} is not divisible by "
                             f"num_heads {num_heads}")
        if scheme not in SCHEMES:
            raise ValueError(f"ContextAttention: scheme must be one of {SCHEMES}, not {scheme!r}")
        sequence_segments(1, 1, 0, layout)  # validates the layout name
        self.hidden, self.num_heads, self.head_dim = int(hidden), int(num_heads), hidden // num_heads
        self.scheme, self.causal, self.layout = scheme, bool(causal), layout
        self.input_grad = bool(input_grad)
        self.group = resolve_group(group, type(self).__name__, "context")
        self.ulysses, self.ring = self._groups(ulysses_size, groups)
        self.qkv = Linear(hidden, 3 * hidden, bias, dtype=dtype, seed=seed, xp=xp)
        self.proj = Linear(hidden, hidden, bias, dtype=dtype, seed=seed + 1, xp=xp)
        name = (f"{type(self).__name__}(hidden={self.hidden}, heads={self.num_heads}, "
                f"scheme={scheme}, ulysses={1 if self.ulysses is None else self.ulysses.size}, "
                f"causal={self.causal}, layout={layout}, bias={bias}, "
                f"dtype={numpy.dtype(dtype).name})")
        self._forward_label, self._backward_label = name + ".forward", name + ".backward"

    def _groups(self, ulysses_size: int | None, groups: Any) -> tuple[Group | None, Group | None]:
        if self.scheme == "ulysses":
            return self.group, None
        if self.scheme == "ring":
            return None, self.group
        if groups is not None:
            ulysses, ring = groups
            c, u = self.group.rank, ulysses.size
            ok = (ulysses.size * ring.size == self.group.size
                  and tuple(ulysses.ranks) == self.group.ranks[(c // u) * u:(c // u + 1) * u]
                  and tuple(ring.ranks) == self.group.ranks[c % u::u])
            if not self.group.comm.allreduce(ok, op=MPI.LAND):
                raise ValueError("ContextAttention: groups= must be Ulysses groups of consecutive "
                                 "context ranks and ring groups across them "
                                 "(as split_context_group makes)")
            return ulysses, ring
        if ulysses_size is None:
            raise ValueError("ContextAttention: scheme 'hybrid' needs ulysses_size= or groups=")
        return split_context_group(self.group, ulysses_size)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, num_heads={self.num_heads}, scheme={self.scheme}, "
                f"causal={self.causal}, layout={self.layout}, group={self.group.name}")

    def _ring_segments(self, x: Any, key_lengths: Any) -> tuple[int, list, Any]:
        """The sequence length, every ring rank's global row ranges (after any Ulysses
        all-to-all) and the checked key lengths.

        One small allgather over the context group carries each rank's block length, whether
        its input fits the layer, and its key lengths, so that input refused on one rank is
        refused on every rank (the others would otherwise wait in the ring or all-to-all).
        """
        name, p = type(self).__name__, self.group.size
        dtype = self.qkv.dtype
        array = isinstance(x, numpy.ndarray) or is_cupy_array(x)
        # The dtype too: the projection would refuse it on this rank alone.
        fits = array and x.ndim == 3 and x.shape[2] == self.hidden and x.dtype == dtype
        lens = None if key_lengths is None else numpy.asarray(
            key_lengths.get() if hasattr(key_lengths, "get") else key_lengths)
        mine = (x.shape[0] if array and x.ndim else 0, fits, None if lens is None else
                (lens.dtype.str, lens.shape, lens.tolist()))
        everyone = self.group.comm.allgather(mine)  # a few bytes: block lengths, key lengths
        if not all(fit for _, fit, _ in everyone):
            bad = [c for c, (_, fit, _) in enumerate(everyone) if not fit]
            shown = (f"shape {tuple(x.shape)} {x.dtype}" if array else type(x).__name__)
            raise ValueError(f"{name}: the input of context ranks {bad} is not [n, B, "
                             f"{self.hidden}] {dtype} (this rank's: {shown})")
        sizes = tuple(n for n, _, _ in everyone)
        seq_len = sum(sizes)
        if sizes != balanced_sizes(seq_len, p):
            raise ValueError(f"{name}: block lengths {list(sizes)} over the context "
                             f"group are not the balanced split of {seq_len} rows "
                             f"{list(balanced_sizes(seq_len, p))}")
        if any(k != everyone[0][2] for _, _, k in everyone):
            raise ValueError(f"{name}: the ranks of the context group pass different "
                             f"key_lengths: {[k and k[2] for _, _, k in everyone]}")
        # every rank checks the same key lengths, so a refusal is everyone's
        lens = check_key_lengths(name, lens, x.shape[1], seq_len)
        u = 1 if self.ulysses is None else self.ulysses.size
        ctx = [sequence_segments(seq_len, p, c, self.layout) for c in range(p)]
        # Adjoining segments are kept apart: query tiles then start at chunk boundaries, so
        # under zig-zag every ring rank computes the same number of scores.
        return seq_len, [[s for c in range(j * u, (j + 1) * u) for s in ctx[c] if s[1] > s[0]]
                         for j in range(p // u)], lens

    def forward(self, x: Any, key_lengths: Any = None) -> Any:
        """Attend over the whole sequence.

        Parameters
        ----------
        x : array
            This rank's rows ``[n, B, hidden]`` (see ``layout``).
        key_lengths : array of int, optional
            ``[B]``: keys at global positions ``>= key_lengths[b]`` are padding (hidden).

        Returns
        -------
        array
            ``[n, B, hidden]``, the same rows.
        """
        with mappings.label(self._forward_label):
            return self._forward(x, key_lengths)

    def _forward(self, x: Any, key_lengths: Any) -> Any:
        _, segments, lens = self._ring_segments(x, key_lengths)
        n, batch = x.shape[0], x.shape[1]
        xp = array_module(x)
        qkv = self.qkv.forward(x).reshape(n, batch, 3, self.num_heads, self.head_dim)
        if self.ulysses is not None:
            qkv = mappings.all_to_all_from_sequence_to_hidden(qkv, group=self.ulysses,
                                                              seq_axis=0, head_axis=3,
                                                              global_size=_rows(segments, self.ring))
        # head-major [3, B, heads, rows, dh]: one contiguous copy, and kv = qkvh[1:] travels as is
        qkvh = xp.ascontiguousarray(qkv.transpose(2, 1, 3, 0, 4))
        out_h, lse = ring_attention_forward(qkvh[0], qkvh[1:], self.ring, segments,
                                            self.causal, lens)
        out = xp.ascontiguousarray(out_h.transpose(2, 0, 1, 3))
        if self.ulysses is not None:
            out = mappings.all_to_all_from_hidden_to_sequence(out, group=self.ulysses,
                                                              seq_axis=0, head_axis=2,
                                                              global_size=self.num_heads)
        self.save_for_backward(qkvh, out_h, lse, segments, lens)
        return self.proj.forward(out.reshape(n, batch, self.hidden))

    def backward(self, dy: Any) -> Any:
        """Return the input gradient (None with ``input_grad=False``); accumulate parameters'."""
        with mappings.label(self._backward_label):
            return self._backward(dy)

    def _backward(self, dy: Any) -> Any:
        qkvh, out_h, lse, segments, lens = self.saved_tensors()
        n, batch = dy.shape[0], dy.shape[1]
        dout = self.proj.backward(dy).reshape(n, batch, self.num_heads, self.head_dim)
        if not self.input_grad and not any(p.requires_grad for p in self.qkv.parameters()):
            return None  # nothing below the output projection needs a gradient
        xp = array_module(dy)
        if self.ulysses is not None:
            dout = mappings.all_to_all_from_hidden_to_sequence.backward(
                dout, group=self.ulysses, seq_axis=0, head_axis=2, global_size=qkvh.shape[3])
        dout_h = xp.ascontiguousarray(dout.transpose(1, 2, 0, 3))
        dqkvh = xp.zeros_like(qkvh)
        ring_attention_backward(dout_h, qkvh[0], qkvh[1:], out_h, lse, self.ring, segments,
                                self.causal, lens, dq=dqkvh[0], dkv=dqkvh[1:])
        dqkv = xp.ascontiguousarray(dqkvh.transpose(3, 1, 0, 2, 4))
        if self.ulysses is not None:
            dqkv = mappings.all_to_all_from_sequence_to_hidden.backward(
                dqkv, group=self.ulysses, seq_axis=0, head_axis=3, global_size=self.num_heads)
        # set here, not in __init__: Sequential may switch input_grad off after construction
        self.qkv.input_grad = self.input_grad
        dx = self.qkv.backward(dqkv.reshape(n, batch, 3 * self.hidden))
        return dx if self.input_grad else None
