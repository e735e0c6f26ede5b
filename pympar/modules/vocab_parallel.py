"""The vocabulary split over the tensor-parallel group: embedding and cross-entropy.

The two largest matrices of a token model are the embedding table ``(vocabulary, hidden)``
and the output projection to ``(tokens, vocabulary)`` logits. Here both keep only this
rank's block of the vocabulary (the balanced split of :mod:`pympar.partition`, any size):

* :class:`VocabParallelEmbedding` looks up the tokens of its block, zeros the others, and
  sums over the group (one all-reduce, or a reduce-scatter along the sequence).
* :class:`VocabParallelCrossEntropy` takes this rank's block of the logits (the output of a
  :class:`~pympar.modules.ColumnParallelLinear` with ``gather_output=False``) and computes
  the softmax cross-entropy with two all-reduces of ``3 * tokens`` numbers at most: the
  row maxima, then the stacked row sums (exponentials, target logit, and with label
  smoothing the logits' sum). No rank holds a ``(tokens, vocabulary)`` array.

Token ids and targets are replicated over the group (every rank of it passes the same
ones): like any input, their values are data, not compared by the agreement.
"""

from __future__ import annotations

import math
from typing import Any, Union

import numpy

from .. import backend, collectives, mappings
from ..backend import array_module
from ..group import Group
from ..manager import resolve_group
from ..partition import Placement, Split, block_slice
from .core import Module, described_init
from .init_methods import InitMethod
from .losses import _scalar
from .parameter import Parameter
from .sharded_init import init_shard
from .validation import check_array

__all__ = ["VocabParallelEmbedding", "VocabParallelCrossEntropy"]


def _check_ids(layer: Module, ids: Any, vocab: int, what: str, allowed: int | None = None) -> None:
    """Raise unless ``ids`` is an integer array with every value in ``[0, vocab)`` (or equal
    to ``allowed``, the ignored target)."""
    if not isinstance(ids, numpy.ndarray) and not backend.is_cupy_array(ids):
        raise TypeError(f"{type(layer).__name__}: {what} must be an integer numpy.ndarray or "
                        f"cupy.ndarray, got {type(ids).__name__}")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"{type(layer).__name__}: {what} must be integers, got {ids.dtype}")
    if ids.size == 0:
        return
    flat = ids.reshape(-1)
    kept = flat if allowed is None else flat[flat != allowed]
    if kept.size and (int(kept.min()) < 0 or int(kept.max()) >= vocab):
        ignored = "" if allowed is None else f" (or ignore_index={allowed})"
        raise ValueError(f"{type(layer).__name__}: {what} must lie in [0, {vocab}){ignored}; "
                         f"got values from {int(kept.min())} to {int(kept.max())}")


def _add_rows(table: Any, index: Any, rows: Any) -> None:
    """``table[index[i]] += rows[i]`` for every ``i``, repeated indices summed."""
    array_module(table).add.at(table, index, rows)


class VocabParallelEmbedding(Module):
    """A lookup table ``(num_embeddings, embedding_dim)`` with its rows split over the TP group.

    Rank ``r`` holds rows ``block_slice(num_embeddings, P, r)``. ``forward(ids)`` looks up
    the ids of its block, writes zeros for the others, and sums the ranks' outputs: every
    rank gets ``weight[ids]`` of the full table.

    Parameters
    ----------
    num_embeddings : int
        The vocabulary size (any; the first ``num_embeddings % P`` ranks hold one row more).
    embedding_dim : int
        The width of a row.
    use_sequence_parallel : bool
        Reduce-scatter the output along the sequence (axis 0 of ``ids``) instead of
        all-reducing it: rank ``r`` gets its block of the sequence, as the sequence-parallel
        layers after it expect; ``backward`` then takes that block's gradient.
    init_method : str or callable
        The table's init (:mod:`pympar.modules.init_methods`); the default draws
        ``N(0, 0.02^2)``, as Megatron's embeddings do.
    dtype : dtype
        Table and output dtype.
    group : Group, optional
        Tensor-parallel group; the current one by default.
    seed : int
        Init seed: the shards of every TP size are blocks of the same full table.
    xp : module, optional
        ``numpy`` (default) or ``cupy``: where the table lives.

    Attributes
    ----------
    weight : Parameter
        ``(rows of this rank, embedding_dim)``; its ``placement`` splits axis 0 over
        ``group``.
    vocab_range : slice
        The rows of the full table this rank holds.
    """

    input_grad = False  # token ids have no gradient

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 use_sequence_parallel: bool = False,
                 init_method: Union[str, InitMethod] = "normal", dtype: Any = numpy.float32,
                 group: Group | None = None, seed: int = 0, xp: Any = None) -> None:
        super().__init__()
        if int(num_embeddings) < 1 or int(embedding_dim) < 1:
            raise ValueError(f"VocabParallelEmbedding: num_embeddings={num_embeddings} and "
                             f"embedding_dim={embedding_dim} must be positive")
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.use_sequence_parallel = bool(use_sequence_parallel)
        self.dtype = numpy.dtype(dtype)
        self.group = resolve_group(group, type(self).__name__)
        self.vocab_range = block_slice(self.num_embeddings, self.group.size, self.group.rank)
        placement = Placement((self.num_embeddings, self.embedding_dim),
                              (Split.over(self.group, 0),))
        self.weight = Parameter(init_shard(placement, init_method, self.dtype, seed=seed, xp=xp),
                                placement=placement)
        self.label_calls(f"VocabParallelEmbedding({self.num_embeddings}x{self.embedding_dim}, "
                         f"sequence_parallel={self.use_sequence_parallel}, "
                         f"dtype={self.dtype.name})", (described_init(seed, init_method),))

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"group={self.group.name}, dtype={self.dtype.name}")

    def forward(self, ids: Any) -> Any:
        """Return the embeddings ``(*ids.shape, embedding_dim)`` (with sequence parallelism,
        this rank's block of axis 0).

        Parameters
        ----------
        ids : integer array
            Token ids in ``[0, num_embeddings)``, the same on every rank of the group (with
            sequence parallelism, at least one axis).
        """
        with self.agreement("forward", ids, self.group,
                            validate=(self._check_input, ids)):
            start, stop = self.vocab_range.start, self.vocab_range.stop
            outside = (ids < start) | (ids >= stop)
            local = ids.astype(numpy.intp)  # a narrow integer dtype cannot hold ids - start
            local -= start
            local[outside] = 0
            if stop > start:
                y = self.weight.data[local]
                y[outside] = 0
            else:  # more ranks than words: this rank has none
                y = array_module(self.weight.data).zeros((*ids.shape, self.embedding_dim),
                                                         self.dtype)
            self.save_for_backward(local, outside, ids.shape)
            if self.use_sequence_parallel:
                return mappings.reduce_scatter_to_sequence(y, group=self.group)
            # y is a fresh array of this layer: sum it in place.
            return mappings.reduce_from_all(y, group=self.group, out=y)

    def _check_input(self, ids: Any) -> None:
        _check_ids(self, ids, self.num_embeddings, "ids")
        if self.use_sequence_parallel and ids.ndim < 1:
            raise ValueError("VocabParallelEmbedding: with use_sequence_parallel the ids need "
                             "a sequence axis (axis 0)")

    def backward(self, dy: Any) -> None:
        """Accumulate the table's gradient from the output gradient ``dy`` (in the layout
        ``forward`` returned); return None (ids have no gradient)."""
        local, outside, shape = self.saved_tensors()
        sp = self.use_sequence_parallel
        expected = None if sp else (*shape, self.embedding_dim)
        with self.agreement("backward", dy, self.group, (0,) if sp else (),
                            validate=(check_array, self, dy, self.embedding_dim, self.dtype,
                                      "output gradient", expected)):
            if sp:
                dy = mappings.reduce_scatter_to_sequence.backward(dy, group=self.group,
                                                                  global_size=shape[0])
            if self.weight.requires_grad:
                xp = array_module(dy)
                grad = xp.zeros_like(self.weight.data)
                rows = dy.reshape(-1, self.embedding_dim)
                kept = ~outside.reshape(-1)
                _add_rows(grad, local.reshape(-1)[kept], rows[kept])
                self.weight.accumulate_grad(grad, consume=True)
        return None


class VocabParallelCrossEntropy(Module):
    """Mean softmax cross-entropy of logits whose vocabulary axis is split over the TP group.

    ``forward(logits, target)`` takes this rank's block of the vocabulary (the last axis,
    ``block_slice(vocab_size, P, r)``) and the full integer targets, and returns the mean
    over the targets that are not ``ignore_index`` of

    ``(1 - s) * -log p[target] + s * mean_v(-log p[v])``

    with ``p = softmax(logits)`` over the whole vocabulary and ``s = label_smoothing`` (the
    definition of ``torch.nn.CrossEntropyLoss``). ``backward`` returns this rank's block of
    the gradient of the logits.

    Parameters
    ----------
    vocab_size : int
        The full vocabulary (the logits' last axis, summed over the group).
    label_smoothing : float
        ``s`` in ``[0, 1]``.
    ignore_index : int
        Targets equal to it add nothing to the loss and get a zero gradient; the mean is
        over the others (0.0 when there are none).
    dtype : dtype
        The logits' dtype.
    group : Group, optional
        Tensor-parallel group; the current one by default.
    """

    def __init__(self, vocab_size: int, label_smoothing: float = 0.0, ignore_index: int = -100,
                 dtype: Any = numpy.float32, group: Group | None = None) -> None:
        super().__init__()
        if int(vocab_size) < 1:
            raise ValueError(f"VocabParallelCrossEntropy: vocab_size={vocab_size} must be "
                             "positive")
        if not 0.0 <= float(label_smoothing) <= 1.0:
            raise ValueError(f"VocabParallelCrossEntropy: label_smoothing={label_smoothing} "
                             "must lie in [0, 1]")
        self.vocab_size = int(vocab_size)
        self.label_smoothing = float(label_smoothing)
        self.ignore_index = int(ignore_index)
        self.dtype = numpy.dtype(dtype)
        self.group = resolve_group(group, type(self).__name__)
        self.vocab_range = block_slice(self.vocab_size, self.group.size, self.group.rank)
        # repr() of the float: ranks whose smoothings differ in the last bit disagree.
        self.label_calls(f"VocabParallelCrossEntropy({self.vocab_size}, "
                         f"label_smoothing={self.label_smoothing!r}, "
                         f"ignore_index={self.ignore_index}, dtype={self.dtype.name})")

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, label_smoothing={self.label_smoothing}, "
                f"ignore_index={self.ignore_index}, group={self.group.name}")

    def forward(self, logits: Any, target: Any) -> float:
        """Return the mean loss as a Python float (the same on every rank of the group).

        Parameters
        ----------
        logits : array of shape (..., rows of this rank's vocabulary block)
            Unnormalized scores of this rank's block.
        target : integer array of shape (...)
            Class indices in ``[0, vocab_size)`` or ``ignore_index``, the same on every rank.
        """
        width = self.vocab_range.stop - self.vocab_range.start
        with self.agreement("forward", logits, self.group, (-1,),
                            extra=(tuple(getattr(target, "shape", ())),
                                   str(getattr(target, "dtype", type(target).__name__))),
                            validate=(self._check_input, logits, target, width)):
            return self._forward(logits, target)

    def terms(self, target: Any) -> int:
        """How many terms the mean of :meth:`forward` with ``target`` is over: the targets
        that are not ``ignore_index`` (a pipeline schedule weighs micro-batches by it)."""
        return int((target != self.ignore_index).sum())

    def _check_input(self, logits: Any, target: Any, width: int) -> None:
        check_array(self, logits, width, self.dtype, "logits")
        _check_ids(self, target, self.vocab_size, "targets", self.ignore_index)
        if tuple(target.shape) != tuple(logits.shape[:-1]):
            raise ValueError(f"VocabParallelCrossEntropy: targets of shape "
                             f"{tuple(target.shape)} do not match logits of shape "
                             f"{tuple(logits.shape)} (expected {tuple(logits.shape[:-1])})")

    def _forward(self, logits: Any, target: Any) -> float:
        xp = array_module(logits)
        width = logits.shape[-1]
        z = logits.reshape(math.prod(logits.shape[:-1]), width).copy()
        n = z.shape[0]
        t = target.reshape(n).astype(numpy.intp, copy=False)  # room for t - start
        # A rank with an empty block (more ranks than words) offers -inf to the maxima.
        top = z.max(axis=1) if width else xp.full(n, -xp.inf, dtype=z.dtype)
        collectives.all_reduce(self.group, top, op="max", out=top)
        z -= top[:, None]
        smoothing = self.label_smoothing
        # Half-precision logits sum in float32: a row's exponentials pass float16's 65504
        # once the vocabulary has more words.
        sums = xp.zeros((3 if smoothing else 2, n), dtype=backend.accumulation_dtype(z.dtype))
        start, stop = self.vocab_range.start, self.vocab_range.stop
        mine = xp.nonzero((t >= start) & (t < stop))[0]
        sums[1, mine] = z[mine, t[mine] - start]
        if smoothing:
            z.sum(axis=1, dtype=sums.dtype, out=sums[2])
        xp.exp(z, out=z)
        z.sum(axis=1, dtype=sums.dtype, out=sums[0])
        collectives.all_reduce(self.group, sums, out=sums)
        log_total = xp.log(sums[0])
        loss = log_total - sums[1]
        if smoothing:
            loss *= 1.0 - smoothing
            loss += smoothing * (log_total - sums[2] / self.vocab_size)
        kept = t != self.ignore_index
        count = int(kept.sum())
        z /= sums[0][:, None]  # the softmax of this rank's block
        self.save_for_backward(z, mine, t[mine] - start, kept, count, logits.shape)
        return float(loss[kept].sum(dtype=xp.float64)) / count if count else 0.0

    def backward(self, grad: float = 1.0) -> Any:
        """Return this rank's block of ``dloss/dlogits``:
        ``grad * (softmax - (1 - s) onehot(target) - s / vocab_size) / count`` on the kept
        rows, 0 on the ignored ones. No communication: every rank holds its block of the
        softmax from ``forward``."""
        probs, mine, columns, kept, count, shape = self.saved_tensors()
        grad = _scalar(self, grad)
        probs[mine, columns] -= 1.0 - self.label_smoothing
        if self.label_smoothing:
            probs -= self.label_smoothing / self.vocab_size
        probs *= kept[:, None] * (grad / max(count, 1))
        return probs.reshape(shape)
