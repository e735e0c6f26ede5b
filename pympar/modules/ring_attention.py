"""Ring attention: queries stay, key/value blocks travel around the context-parallel ring.

Every rank of a ring of ``R`` ranks holds the queries, keys and values of its own sequence
positions. In ``R`` steps each rank folds one key/value block into an online softmax
(:mod:`pympar.modules.blockwise`) while the block moves on to the next rank: step ``t``
works on the block of rank ``(r - t) mod R``, and the transfer of the block for step
``t + 1`` (a non-blocking send to ``r + 1`` and receive from ``r - 1``) overlaps the math of
step ``t``. The backward pass sends the key/value blocks around again, with their gradient
accumulators travelling one step behind, so that after ``R`` steps each accumulator is home.

Per rank and call: forward sends ``R - 1`` key/value blocks, backward ``R - 1`` key/value
blocks and ``R`` key/value gradient blocks. Memory is ``O(S / R)``: scores exist for one
block pair at a time and are recomputed in backward from the saved log-sum-exp.

Arrays are head-major, ``[B, heads, n, dh]``; key and value travel together as
``kv [2, B, heads, n, dh]``. Block lengths may differ between ranks; every rank knows them all
from the segments, so messages have known sizes.

No collective check covers point-to-point messages, so each forward and backward starts with
one :func:`pympar.collectives.agree` on what the ring's messages depend on (batch, heads,
head size, dtype, mask, every rank's segments): ranks that differ raise
:class:`~pympar.debug.CollectiveMismatchError` instead of exchanging blocks of another size
or meaning.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from mpi4py import MPI

from .. import stats
from ..collectives import agree
from ..backend import (array_module, cuda_aware, is_cupy_array, mpi_datatype, staging_buffer,
                       synchronize)
from ..group import Group
from .blockwise import OnlineSoftmax, Segments, attend_block, attend_block_backward

__all__ = ["ring_attention_forward", "ring_attention_backward"]

_KV, _DKV = 17, 18  # message tags: key/value blocks and their gradient accumulators


class _Transfer:
    """One posted non-blocking send to the next rank and/or receive from the previous one.

    Device buffers: the stream is synchronized before anything is posted, since a kernel
    may still write the block to send or read the buffer about to be received into (the
    last step's block); a CUDA-aware transport writes on its own stream. Without CUDA-aware
    MPI the blocks travel through pinned host buffers, one per role (tag and direction),
    reused from call to call.
    """

    def __init__(self, group: Group, operation: str, send: Any = None, recv: Any = None,
                 tag: int = _KV) -> None:
        self.group, self.operation, self.recv, self.send = group, operation, recv, send
        comm, size = group.comm, group.size
        device = is_cupy_array(send if send is not None else recv)
        if device:
            synchronize(send if send is not None else recv)
        staged = device and not cuda_aware()
        self.wire_recv = None
        self.requests = []
        if recv is not None:
            self.wire_recv = staging_buffer(("ring", tag, "recv"), recv) if staged else recv
            self.requests.append(comm.Irecv([self.wire_recv, mpi_datatype(recv.dtype)],
                                            source=(group.rank - 1) % size, tag=tag))
        if send is not None:
            if staged:
                self.wire_send = staging_buffer(("ring", tag, "send"), send)
                send.get(out=self.wire_send)  # blocking: the host copy is complete
            else:
                self.wire_send = send
            self.requests.append(comm.Isend([self.wire_send, mpi_datatype(send.dtype)],
                                            dest=(group.rank + 1) % size, tag=tag))

    def wait(self) -> None:
        """Complete both requests; account the bytes and the time blocked here to any active
        stats recorder."""
        start = time.perf_counter()
        MPI.Request.Waitall(self.requests)
        if self.recv is not None and self.wire_recv is not self.recv:
            self.recv.set(self.wire_recv)
        if stats.is_recording():
            stats.add(self.group.name, self.operation,
                      0 if self.send is None else self.send.nbytes,
                      0 if self.recv is None else self.recv.nbytes,
                      time.perf_counter() - start)


def _rows(segments: Segments) -> int:
    return sum(b - a for a, b in segments)


def _agree(group: Group, what: str, qh: Any, kv: Any, segments: Sequence[Segments],
           causal: bool, lens: Any, *others: Any) -> None:
    """One agreement check of the ring's settings; then refuse arrays that do not fit them.

    ``others`` (backward: ``dout``, ``out``, ``lse``) must match ``qh`` too. The local shape
    checks come after the agreement (as a flag in its key), so that a rank with a misshapen
    array makes every rank raise rather than leave the others waiting in the ring.
    """
    rows = _rows(segments[group.rank])
    fits = (qh.ndim == 4 and kv.shape == (2, *qh.shape) and qh.shape[2] == rows
            and kv.dtype == qh.dtype and all(o.shape[:3] == qh.shape[:3] for o in others))
    batch, heads, dh = qh.shape[0], qh.shape[1], qh.shape[-1]
    key = (what, batch, heads, dh, qh.dtype.str, bool(causal), tuple(tuple(map(tuple, s)) for s in segments),
           None if lens is None else lens.tobytes(), fits)
    agree(group, key, f"{what}(batch={batch}, heads={heads}, head_dim={dh}, dtype={qh.dtype}, "
                      f"causal={bool(causal)}, segments={[list(s) for s in segments]}, "
                      f"key_lengths={None if lens is None else lens.tolist()}, arrays fit={fits})")
    if not fits:
        raise ValueError(f"{what}: qh {tuple(qh.shape)} {qh.dtype}, kv {tuple(kv.shape)} "
                         f"{kv.dtype} (and the gradients) do not fit this rank's {rows} rows: "
                         f"expected qh [B, heads, {rows}, dh] and kv [2, *qh.shape]")


def _view(buffer: Any, like: Any, rows: int) -> Any:
    """``buffer``'s first elements as a ``[2, B, heads, rows, dh]`` block shaped like ``like``."""
    shape = (like.shape[0], like.shape[1], like.shape[2], rows, like.shape[4])
    count = shape[0] * shape[1] * shape[2] * rows * shape[4]
    return buffer[:count].reshape(shape)


def _buffers(xp: Any, kv: Any, segments: Sequence[Segments], count: int) -> list[Any]:
    most = max(_rows(s) for s in segments)
    per_row = kv.shape[0] * kv.shape[1] * kv.shape[2] * kv.shape[4]
    return [xp.empty(most * per_row, dtype=kv.dtype) for _ in range(count)]


def ring_attention_forward(qh: Any, kv: Any, group: Group | None, segments: Sequence[Segments],
                           causal: bool = False, lens: Any = None) -> tuple[Any, Any]:
    """Attention of this rank's queries over the keys and values of the whole ring.

    Parameters
    ----------
    qh : array
        Queries ``[B, heads, n, dh]`` of this rank's positions.
    kv : array
        Keys and values ``[2, B, heads, n, dh]`` of the same positions (any strides: the
        ring sends a C-contiguous copy of a block that is not).
    group : Group or None
        The ring; None or a size-1 group means this rank alone.
    segments : sequence of segments
        ``segments[j]``: the global sequence ranges of ring rank ``j``'s rows, in row order.
    causal : bool
    lens : numpy.ndarray or None
        Key lengths per batch element (padding), from
        :func:`~pympar.modules.blockwise.check_key_lengths`.

    Returns
    -------
    out : array
        ``[B, heads, n, dh]``.
    lse : array
        ``[B, heads, n]``, the log-sum-exp of each query row (what backward needs).
    """
    size = 1 if group is None else group.size
    rank = 0 if group is None else group.rank
    if size > 1:
        kv = array_module(kv).ascontiguousarray(kv)  # the ring sends its bytes in memory order
        _agree(group, "ring_attention.forward", qh, kv, segments, causal, lens)
    state = OnlineSoftmax(qh)
    cur, bufs = kv, _buffers(array_module(kv), kv, segments, 2) if size > 1 else None
    for step in range(size):
        src = (rank - step) % size
        transfer = None
        if step < size - 1:
            nxt = _view(bufs[step % 2], kv, _rows(segments[(src - 1) % size]))
            transfer = _Transfer(group, "ring_attention.forward", send=cur, recv=nxt)
        attend_block(state, qh, cur[0], cur[1], segments[rank], segments[src], causal, lens)
        if transfer is not None:
            transfer.wait()
            cur = nxt
    return state.finish()


def ring_attention_backward(dout: Any, qh: Any, kv: Any, out: Any, lse: Any,
                            group: Group | None, segments: Sequence[Segments],
                            causal: bool = False, lens: Any = None,
                            dq: Any = None, dkv: Any = None) -> tuple[Any, Any]:
    """Gradients of :func:`ring_attention_forward` for this rank's queries, keys and values.

    Parameters
    ----------
    dout : array
        ``[B, heads, n, dh]``, gradient of ``out``.
    qh, kv, group, segments, causal, lens
        As given to the forward.
    out, lse : array
        The forward's results.
    dq, dkv : array, optional
        Zero-filled outputs shaped like ``qh`` and ``kv`` (allocated when None).

    Returns
    -------
    dq, dkv : array
    """
    xp = array_module(qh)
    size = 1 if group is None else group.size
    rank = 0 if group is None else group.rank
    dq = xp.zeros_like(qh) if dq is None else dq
    dkv = xp.zeros_like(kv) if dkv is None else dkv
    if size > 1:
        kv = xp.ascontiguousarray(kv)  # the ring sends its bytes in memory order
        _agree(group, "ring_attention.backward", qh, kv, segments, causal, lens, dout, out, lse)
    delta = (dout * out).sum(axis=-1)
    mine = segments[rank]
    if size == 1:
        attend_block_backward(qh, kv[0], kv[1], dout, lse, delta, mine, mine, causal, lens,
                              dq, dkv[0], dkv[1])
        return dq, dkv
    kv_bufs = _buffers(xp, kv, segments, 2)
    # Two accumulators alternate, so that one can still be on its way to the next rank
    # while the next block's gradient is computed into the other.
    acc_bufs, in_buf = _buffers(xp, kv, segments, 2), _buffers(xp, kv, segments, 1)[0]
    cur, sending = kv, None
    op = "ring_attention.backward"
    for step in range(size):
        src = (rank - step) % size
        transfers = []
        if step < size - 1:
            nxt = _view(kv_bufs[step % 2], kv, _rows(segments[(src - 1) % size]))
            transfers.append(_Transfer(group, op, send=cur, recv=nxt))
        if step > 0:  # the accumulator of block src, from the ranks it has already visited
            incoming = _view(in_buf, kv, _rows(segments[src]))
            transfers.append(_Transfer(group, op, recv=incoming, tag=_DKV))
        # acc's buffer was sent two steps ago, and that send was completed last step.
        acc = _view(acc_bufs[step % 2], kv, _rows(segments[src]))
        acc.fill(0)
        attend_block_backward(qh, cur[0], cur[1], dout, lse, delta, mine, segments[src], causal,
                              lens, dq, acc[0], acc[1])
        if sending is not None:
            sending.wait()
        for transfer in transfers:
            transfer.wait()
        if step > 0:
            acc += incoming
        sending = _Transfer(group, op, send=acc, tag=_DKV)
        if step < size - 1:
            cur = nxt
    home = _Transfer(group, op, recv=_view(in_buf, kv, _rows(mine)), tag=_DKV)
    home.wait()
    sending.wait()
    dkv[...] = home.recv
    return dq, dkv
