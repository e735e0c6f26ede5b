"""What save and load share: the logical tensors, the ranks' agreement, the replica split.

The ranks agree on every verdict with one small all-reduce (:func:`agree`), so a failure on
one rank raises the same :class:`~pympar.checkpoint.format.CheckpointError` on all of them.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import manager
from ..partition import Placement
from .files import replica_share
from .format import CheckpointError, stored_dtype

_MESSAGE_BYTES = 2048


@dataclass
class Tensor:
    name: str
    placement: Placement
    array: Any  # this rank's shard (NumPy or CuPy), viewed as the stored dtype's kind
    logical: np.dtype
    stored: np.dtype


def default_comm(comm: Any) -> MPI.Intracomm:
    if comm is not None:
        return getattr(comm, "comm", comm)
    return manager.parallel_comm()


def agree(comm: MPI.Intracomm, error: str | None) -> None:
    """Raise one ``CheckpointError`` on every rank when any rank has an error.

    The lowest failing rank's message is sent to all (as bytes: nothing is pickled).
    """
    size = comm.Get_size()
    flag = np.array([comm.Get_rank() if error else size], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MIN)
    root = int(flag[0])
    if root == size:
        return
    message = np.zeros(_MESSAGE_BYTES, dtype=np.uint8)
    if error:
        raw = error.encode("utf-8", "replace")[:_MESSAGE_BYTES]
        message[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    if size > 1:
        comm.Bcast(message, root=root)
    text = bytes(message).rstrip(b"\0").decode("utf-8", "replace")
    raise CheckpointError(text + (f" [rank {root}]" if size > 1 else ""))


def attempt(comm: MPI.Intracomm, func: Any, *args: Any) -> Any:
    """Run ``func`` on this rank, then agree: all ranks raise if any failed."""
    result, error = None, None
    try:
        result = func(*args)
    except CheckpointError as err:
        error = str(err)
    except Exception as err:  # noqa: BLE001 - any failure must reach the other ranks
        error = f"{type(err).__name__}: {err}"
    agree(comm, error)
    return result


def tensors_of(model: Any, optimizer: Any) -> tuple[list[Tensor], dict | None]:
    """The logical tensors of a model (and optimizer), with this rank's blocks.

    The optimizer speaks the local state protocol of :mod:`pympar.optim`:
    ``local_state_dict()`` (this rank's block of every state array, the live buffers) and
    ``state_placements()`` (where each parameter's block sits). A plain optimizer's block is
    the parameter's shard, :class:`~pympar.zero.ZeroRedundancyOptimizer`'s its share: one code
    path, and sharded state is never gathered.
    """
    out, by_id = [], {}
    for name, p in model.named_parameters():
        out.append(make(name, p.placement, p.data))
        by_id[id(p)] = name
    if optimizer is None:
        return out, None
    if not hasattr(optimizer, "local_state_dict") or not hasattr(optimizer, "state_placements"):
        raise CheckpointError(f"a {type(optimizer).__name__} cannot be checkpointed: it has no "
                              "local_state_dict() and state_placements()")
    state, places = optimizer.local_state_dict(), optimizer.state_placements()
    steps = {}
    for i, p in enumerate(optimizer.params):
        name = by_id.get(id(p))
        if name is None:
            raise CheckpointError(f"the optimizer's parameter {i} ({p.name}) is not a parameter "
                                  "of the model")
        steps[name] = state["state"][i]["step"]
        for key, value in state["state"][i].items():
            if key == "step":
                continue
            if tuple(value.shape) != places[i].local_shape:
                raise CheckpointError(f"optimizer state {key!r} of {name!r} has shape "
                                      f"{tuple(value.shape)}, its placement says "
                                      f"{places[i].local_shape}")
            out.append(make(f"optimizer/{name}/{key}", places[i], value))
    meta = {"type": state["type"], "hyperparameters": state["hyperparameters"], "steps": steps}
    return out, meta


def make(name: str, placement: Placement, array: Any) -> Tensor:
    logical = np.dtype(array.dtype)
    stored = stored_dtype(logical)
    if stored.kind != logical.kind:  # bfloat16 travels as its uint16 bit pattern
        array = array.view(stored)
    return Tensor(name, placement, array, logical, stored)


def signature(tensors: list[Tensor]) -> int:
    return call_key(repr([(t.name, t.placement.shape, t.stored.str) for t in tensors]))


def call_key(text: str) -> int:
    """A 56-bit hash of ``text`` (it fits an int64 exchanged by MPI): of a call's arguments in
    words for :func:`same_call`, of the tensors for :func:`signature`, of a block's boxes."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def same_call(comm: MPI.Intracomm, what: str, shown: str, keys: np.ndarray) -> None:
    """Raise one ``CheckpointError`` on every rank when the ranks' calls differ.

    ``keys`` holds every rank's :func:`call_key` (already all-gathered); when one differs
    from rank 0's, rank 0 and the first such rank send their ``shown`` (as bytes: nothing
    is pickled), and every rank raises naming both.
    """
    differ = np.flatnonzero(keys != keys[0])
    if not differ.size:
        return
    other = int(differ[0])
    words = []
    for root in (0, other):
        message = np.zeros(_MESSAGE_BYTES // 2, dtype=np.uint8)
        if comm.Get_rank() == root:
            raw = shown.encode("utf-8", "replace")[:message.size]
            message[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        comm.Bcast(message, root=root)
        words.append(bytes(message).rstrip(b"\0").decode("utf-8", "replace"))
    raise CheckpointError(f"{what}: the ranks pass different arguments: rank 0 {words[0]}; "
                          f"rank {other} {words[1]} (every rank must pass the same)")


def block_key(t: Tensor) -> int:
    boxes = [tuple((s.start, s.stop) for s in g) for g, _ in t.placement.pieces()]
    return call_key(repr(boxes))


def held(t: Tensor) -> int:
    """The elements of tensor ``t`` this rank holds (none where it is absent)."""
    return sum(math.prod(s.stop - s.start for s in g) for g, _ in t.placement.pieces())


def replicas(comm: MPI.Intracomm, tensors: list[Tensor]) -> list[tuple[int, int]]:
    """Per tensor, ``(count, index)``: how many ranks hold this rank's block, and which of
    them this rank is; collective.

    One all-gather of a small key per tensor finds the ranks holding the same block. The
    distinct blocks must tile the full array exactly.
    """
    size = comm.Get_size()
    mine = np.array([[block_key(t), held(t)] for t in tensors],
                    dtype=np.int64).reshape(len(tensors), 2)
    every = np.empty((size, len(tensors), 2), dtype=np.int64)
    comm.Allgather(mine, every)
    rank, out = comm.Get_rank(), []
    for i, t in enumerate(tensors):
        keys = every[:, i, 0]
        holders = np.flatnonzero(keys == keys[rank])
        _, first = np.unique(keys, return_index=True)
        if int(every[first, i, 1].sum()) != math.prod(t.placement.shape):
            raise CheckpointError(f"tensor {t.name!r}: the ranks' blocks do not tile its full "
                                  f"shape {t.placement.shape} (inconsistent placements)")
        out.append((len(holders), int(np.searchsorted(holders, rank))))
    return out


def share(piece: tuple, count: int, index: int) -> tuple | None:
    """This replica's part ``(global box, local box)`` of a ``(global, local)`` piece that
    ``count`` ranks hold, or None (:func:`~pympar.checkpoint.files.replica_share`)."""
    g, lo = piece
    part = replica_share(g, count, index)
    if part is None:
        return None
    local = tuple(slice(l.start + s.start - gg.start, l.start + s.stop - gg.start)
                  for l, s, gg in zip(lo, part, g))
    return part, local


def shares(comm: MPI.Intracomm, tensors: list[Tensor]) -> list[list[tuple]]:
    """Per tensor, the ``(global box, local box)`` pieces this rank writes; collective.

    Ranks holding the same block (:func:`replicas`) split it, so that each writes about
    ``1/count`` of it.
    """
    out = []
    for t, (count, index) in zip(tensors, replicas(comm, tensors)):
        parts = (share(piece, count, index) for piece in t.placement.pieces())
        out.append([p for p in parts if p is not None])
    return out


def file_name(i: int) -> str:
    return f"t{i:05d}.npy"


def optimizer_names(model: Any, optimizer: Any) -> list[str]:
    by_id = {id(p): name for name, p in model.named_parameters()}
    return [by_id[id(p)] for p in optimizer.params]


class open_fd:
    """A read-only file descriptor as a context manager."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))

    def __enter__(self) -> int:
        return self.fd

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)
