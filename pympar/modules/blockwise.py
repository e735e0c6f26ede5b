"""Masked softmax attention computed block by block, with an online (log-sum-exp) softmax.

The building block of ring and hybrid context-parallel attention: a rank holds the query
rows of some sequence positions and meets the key/value rows of other positions one block at
a time. Arrays here are head-major, ``[B, heads, n, dh]``, so that every block product is one
batched matmul over ``(B, heads)``.

Positions are described by *segments*: a rank's local rows are the concatenation of global
ranges ``(start, stop)`` of the sequence, in order (one range for a contiguous block, two for
the zig-zag order). Queries are taken :data:`TILE_ROWS` rows of one segment at a time, so
score memory is linear in the block length. Masks are decided per pair of a query tile and a
key segment: the keys that the mask hides from the whole tile are not computed (a pair hidden
entirely is skipped; this is where zig-zag order saves causal work), and only the keys that it
hides from part of the tile (under a causal mask, the tile's diagonal square) get an element
mask. So the work of a rank depends on its segments' lengths only, not on how they are
ordered or whether two of them adjoin.

Masks: ``causal`` hides keys after the query; ``key_lengths[b]`` hides keys at positions
``>= key_lengths[b]`` of batch element ``b`` (padding). Every query keeps at least key 0
visible, as :func:`check_key_lengths` requires lengths >= 1.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy

from ..backend import array_module
from ..partition import balanced_sizes, block_slice

__all__ = ["sequence_segments", "segment_positions", "check_key_lengths", "key_mask",
           "OnlineSoftmax", "attend_block", "attend_block_backward"]

Segments = Sequence[tuple[int, int]]

#: Query rows per score tile: scores exist for at most this many queries at a time, so
#: memory grows linearly with the sequence (the tile loop runs in Python, one matmul each).
TILE_ROWS = 512


def sequence_segments(seq_len: int, parts: int, index: int,
                      layout: str = "contiguous") -> list[tuple[int, int]]:
    """Global sequence ranges held by rank ``index`` of ``parts``, in local row order.

    Either way rank ``i`` holds ``n_i = balanced_sizes(seq_len, parts)[i]`` rows (the
    :func:`numpy.array_split` rule); the two layouts differ only in which rows.

    Parameters
    ----------
    seq_len, parts, index : int
    layout : {"contiguous", "zigzag"}
        ``"contiguous"``: block ``index`` of the balanced split.
        ``"zigzag"``: the sequence is cut into ``2 * parts`` chunks and rank ``i`` holds chunks
        ``i`` and ``2 * parts - 1 - i``: its first ``ceil(n_i / 2)`` rows from the front half
        of the sequence, the rest from the back half (so that under a causal mask every rank
        has nearly the same work).

    Returns
    -------
    list of (int, int)

    Examples
    --------
    >>> sequence_segments(10, 2, 0, "zigzag")
    [(0, 3), (8, 10)]
    """
    if layout == "contiguous":
        s = block_slice(seq_len, parts, index)
        return [(s.start, s.stop)]
    if layout == "zigzag":
        sizes = balanced_sizes(seq_len, parts)
        front = [(n + 1) // 2 for n in sizes]
        start = sum(front[:index])
        back = sum(front) + sum(n - f for n, f in zip(sizes[index + 1:], front[index + 1:]))
        return [(start, start + front[index]), (back, back + sizes[index] - front[index])]
    raise ValueError(f"sequence layout must be 'contiguous' or 'zigzag', not {layout!r}")


def segment_positions(segments: Segments) -> numpy.ndarray:
    """Global positions of the local rows, ``int64 [n]``."""
    if not segments:
        return numpy.zeros(0, numpy.int64)
    return numpy.concatenate([numpy.arange(a, b, dtype=numpy.int64) for a, b in segments])


def check_key_lengths(layer: str, key_lengths: Any, batch: int, seq_len: int) -> Any:
    """Validate padding lengths: integers ``1 <= key_lengths[b] <= seq_len``, shape ``(batch,)``.

    Returns
    -------
    numpy.ndarray or None
        ``int64 [batch]`` on the host, or None when ``key_lengths`` is None.
    """
    if key_lengths is None:
        return None
    lens = numpy.asarray(key_lengths.get() if hasattr(key_lengths, "get") else key_lengths)
    if lens.shape != (batch,) or lens.dtype.kind not in "iu":
        raise ValueError(f"{layer}: key_lengths must be integers of shape ({batch},), got "
                         f"{lens.dtype} of shape {lens.shape}")
    if batch and (lens.min() < 1 or lens.max() > seq_len):
        raise ValueError(f"{layer}: key_lengths must lie in [1, {seq_len}] (every query needs a "
                         f"visible key), got {lens.tolist()}")
    return lens.astype(numpy.int64)


def key_mask(xp: Any, q_pos: Any, k_pos: Any, causal: bool, lens: Any) -> Any:
    """Boolean ``[B or 1, 1, nq, nk]`` array, True where the query may see the key; or None."""
    allowed = None
    if causal:
        allowed = (k_pos[None, :] <= q_pos[:, None])[None, None]
    if lens is not None:
        pad = (k_pos[None, :] < lens[:, None])[:, None, None, :]
        allowed = pad if allowed is None else allowed & pad
    return None if allowed is None else xp.asarray(allowed)


def _pairs(q_segs: Segments, k_segs: Segments, causal: bool, lens: Any):
    """Yield ``(q_rows, k_rows, q_range, k_range, mask_from)`` for every pair of a query tile
    (at most :data:`TILE_ROWS` rows of one segment) and a key segment that the mask does not
    hide entirely.

    The key range is the segment cut down to the keys some query of the tile sees (causal: up
    to the tile's last query; padding: below the longest length), so no fully hidden column is
    computed, whatever the segments' lengths or order. Keys before ``mask_from`` are visible to
    every query of the tile and need no element mask; under a causal mask the masked part is
    the tile's own diagonal square, the same on every rank.
    """
    kmax = int(lens.max()) if lens is not None else None
    kmin = int(lens.min()) if lens is not None else None
    q0 = 0
    for seg_a, seg_b in q_segs:
        for qa in range(seg_a, seg_b, TILE_ROWS):
            qb = min(qa + TILE_ROWS, seg_b)
            k0 = 0
            for ka, kb in k_segs:
                hi, free = kb, kb  # keys [ka, hi) computed, [ka, free) unmasked
                if causal:
                    hi, free = min(hi, qb), min(free, qa)
                if lens is not None:
                    hi, free = min(hi, kmax), min(free, kmin)
                if hi > ka:
                    yield (slice(q0 + qa - seg_a, q0 + qb - seg_a), slice(k0, k0 + hi - ka),
                           (qa, qb), (ka, hi), max(free, ka))
                k0 += kb - ka
        q0 += seg_b - seg_a


def _scores(xp: Any, qh: Any, kh: Any, qr: slice, kr: slice, scale: float, qseg: tuple,
            kseg: tuple, mask_from: int, causal: bool, lens: Any) -> Any:
    s = xp.matmul(qh[:, :, qr], kh[:, :, kr].swapaxes(-1, -2))
    s *= scale
    if mask_from < kseg[1]:
        allowed = key_mask(xp, numpy.arange(*qseg), numpy.arange(mask_from, kseg[1]), causal, lens)
        xp.copyto(s[..., mask_from - kseg[0]:], -numpy.inf, where=~allowed)
    return s


class OnlineSoftmax:
    """Running max ``m``, sum ``l`` and unnormalised output ``acc`` of each query row.

    Parameters
    ----------
    qh : array
        Queries ``[B, heads, n, dh]``; the state matches it.
    """

    def __init__(self, qh: Any) -> None:
        xp = array_module(qh)
        self.scale = 1.0 / math.sqrt(qh.shape[-1]) if qh.shape[-1] else 1.0
        self.m = xp.full(qh.shape[:-1], -numpy.inf, dtype=qh.dtype)
        self.l = xp.zeros(qh.shape[:-1], dtype=qh.dtype)
        self.acc = xp.zeros(qh.shape, dtype=qh.dtype)

    def finish(self) -> tuple[Any, Any]:
        """Return the output ``acc / l`` and the log-sum-exp ``m + log(l)`` of every row."""
        xp = array_module(self.acc)
        out = self.acc / self.l[..., None]
        lse = xp.log(self.l)
        lse += self.m
        return out, lse


def attend_block(state: OnlineSoftmax, qh: Any, kh: Any, vh: Any, q_segs: Segments,
                 k_segs: Segments, causal: bool, lens: Any) -> None:
    """Fold one key/value block into ``state`` (log-sum-exp rescaling of earlier blocks)."""
    xp = array_module(qh)
    for qr, kr, qseg, kseg, mask_from in _pairs(q_segs, k_segs, causal, lens):
        s = _scores(xp, qh, kh, qr, kr, state.scale, qseg, kseg, mask_from, causal, lens)
        m_old = state.m[:, :, qr]
        m_new = xp.maximum(m_old, s.max(axis=-1))
        # A row that has seen only hidden keys so far keeps m = -inf; shift it by 0
        # instead, so that exp gives 0 rather than NaN.
        shift = xp.where(m_new == -numpy.inf, 0, m_new)
        s -= shift[..., None]
        xp.exp(s, out=s)
        alpha = m_old - shift
        xp.exp(alpha, out=alpha)
        state.l[:, :, qr] *= alpha
        state.l[:, :, qr] += s.sum(axis=-1)
        acc = state.acc[:, :, qr]
        acc *= alpha[..., None]
        acc += xp.matmul(s, vh[:, :, kr])
        state.m[:, :, qr] = m_new


def attend_block_backward(qh: Any, kh: Any, vh: Any, dout: Any, lse: Any, delta: Any,
                          q_segs: Segments, k_segs: Segments, causal: bool, lens: Any,
                          dq: Any, dk: Any, dv: Any) -> None:
    """Add one key/value block's share to ``dq`` and its gradients to ``dk``, ``dv``.

    ``lse`` is the final log-sum-exp of each query row, ``delta = rowsum(dout * out)``;
    all arrays are head-major and the gradients are accumulated in place.
    """
    xp = array_module(qh)
    scale = 1.0 / math.sqrt(qh.shape[-1]) if qh.shape[-1] else 1.0
    for qr, kr, qseg, kseg, mask_from in _pairs(q_segs, k_segs, causal, lens):
        p = _scores(xp, qh, kh, qr, kr, scale, qseg, kseg, mask_from, causal, lens)
        p -= lse[:, :, qr, None]
        xp.exp(p, out=p)
        do = dout[:, :, qr]
        dv[:, :, kr] += xp.matmul(p.swapaxes(-1, -2), do)
        ds = xp.matmul(do, vh[:, :, kr].swapaxes(-1, -2))
        ds -= delta[:, :, qr, None]
        ds *= p
        ds *= scale
        dq[:, :, qr] += xp.matmul(ds, kh[:, :, kr])
        dk[:, :, kr] += xp.matmul(ds.swapaxes(-1, -2), qh[:, :, qr])
