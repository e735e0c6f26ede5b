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

Forward and backward start with one agreement over the context group
(:meth:`~pympar.modules.Module.agreement`) on the layer's settings, the input's dtype and
extents, the key lengths and every rank's block length, so ranks that built different
layers or pass inputs only some refuse raise :class:`~pympar.errors.CollectiveMismatchError`
on every rank.
"""

from __future__ import annotations

from typing import Any

import zlib

import numpy
from mpi4py import MPI

from .. import collectives, mappings
from ..backend import array_module
from ..group import Group
from ..manager import resolve_group
from ..partition import balanced_sizes
from .blockwise import check_key_lengths, sequence_segments
from .core import Module, described_init
from .linear import Linear
from .ring_attention import ring_attention_backward, ring_attention_forward
from .validation import check_array

__all__ = ["ContextAttention", "split_context_group"]

SCHEMES = ("ulysses", "ring", "hybrid")


def split_context_group(group: Group, ulysses_size: int) -> tuple[Group, Group]:
    """Split a context group into Ulysses groups of consecutive ranks and ring groups across.

    Collective over ``group``: every member must call it, with the same ``ulysses_size``
    (compared first: every rank raises when one passes another).
    Context rank ``c`` lands in Ulysses group ``c // U`` (at position ``c % U``) and ring group
    ``c % U`` (at position ``c // U``).

    Returns
    -------
    ulysses, ring : Group
        Named ``"ulysses-<global ranks>"`` and ``"ring-<global ranks>"``.
    """
    u, c = int(ulysses_size), group.rank
    if u < 1 or group.size % u:
        error = ValueError(f"ContextAttention: ulysses_size {ulysses_size} does not divide "
                           f"the context-parallel size {group.size}")
        collectives.refuse(group, "split_context_group", error)
        raise error
    # Ranks splitting by other sizes would make groups whose names lie: agreed first.
    collectives.agree(group, ("split_context_group", u), f"split_context_group(ulysses_size={u})")
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
        self.label_calls(name, (described_init(seed),))

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

    def _segments(self, x: Any, sizes: tuple[int, ...], lens: Any) -> tuple[list, Any]:
        """Every ring rank's global row ranges (after any Ulysses all-to-all) and the checked
        key lengths, from every context rank's block length ``sizes`` (agreed: every rank
        raises alike)."""
        name, p = type(self).__name__, self.group.size
        seq_len = sum(sizes)
        if sizes != balanced_sizes(seq_len, p):
            raise ValueError(f"{name}: block lengths {list(sizes)} over the context "
                             f"group are not the balanced split of {seq_len} rows "
                             f"{list(balanced_sizes(seq_len, p))}")
        lens = check_key_lengths(name, lens, x.shape[1], seq_len)
        u = 1 if self.ulysses is None else self.ulysses.size
        ctx = [sequence_segments(seq_len, p, c, self.layout) for c in range(p)]
        # Adjoining segments are kept apart: query tiles then start at chunk boundaries, so
        # under zig-zag every ring rank computes the same number of scores.
        return [[s for c in range(j * u, (j + 1) * u) for s in ctx[c] if s[1] > s[0]]
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
        lens = None if key_lengths is None else numpy.asarray(
            key_lengths.get() if hasattr(key_lengths, "get") else key_lengths)
        # The key lengths are local work that no collective sees: agreed with the input.
        extra = () if lens is None else (f"key_lengths {lens.dtype.str} {lens.shape} of "
                                         f"checksum {zlib.crc32(lens.tobytes()):08x}",)
        with self.agreement("forward", x, self.group, (0,), 0, extra,
                            (self._check, x, "input")) as sizes:
            segments, lens = self._segments(x, sizes, lens)
            return self._forward(x, segments, lens)

    def _forward(self, x: Any, segments: list, lens: Any) -> Any:
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
        saved = self.saved_tensors()
        with self.agreement("backward", dy, self.group, (0,),
                            validate=(self._check, dy, "output gradient")):
            return self._backward(dy, *saved)

    def _check(self, x: Any, what: str) -> None:
        check_array(self, x, self.hidden, self.qkv.dtype, what=what, min_ndim=3)
        if x.ndim != 3:
            raise ValueError(f"{type(self).__name__}: expected {what} [n, B, {self.hidden}], "
                             f"got shape {tuple(x.shape)}")

    def _backward(self, dy: Any, qkvh: Any, out_h: Any, lse: Any, segments: list,
                  lens: Any) -> Any:
        n, batch = dy.shape[0], dy.shape[1]
        dout = self.proj.backward(dy).reshape(n, batch, self.num_heads, self.head_dim)
        if not self.input_grad and not any(p.requires_grad for p in self.qkv.parameters()):
            self.qkv.saved_tensors()  # its backward is skipped: release its cache unused
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
