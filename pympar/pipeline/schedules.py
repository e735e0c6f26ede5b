"""Pipeline schedules: every micro-batch through every stage, forward then backward.

A schedule is the order in which one stage runs the forwards and backwards of ``m``
micro-batches (:meth:`PipelineSchedule.steps`), and :meth:`~PipelineSchedule.run` is one loop
over it: a forward receives the previous stage's activation (the first stage takes its
micro-batch of the inputs), runs the stage and sends the output on (the last stage computes
the loss and its gradient at once); a backward receives the output's gradient, runs the
stage's backward and sends the input's gradient back. Between the two the stage's caches
wait outside its layers (:func:`~pympar.pipeline.caches.take_caches`), one set per micro-batch
in flight.

The loss is the mean over the whole batch: the gradient of micro-batch ``k``'s loss is
scaled by its share ``n_k / n`` of the terms the batch's mean is over (its extent along
``axis``, or what the loss's ``terms(target)`` counts, such as the targets that are not
ignored), so that the gradients accumulated over the micro-batches are those of one
full-batch step, uneven micro-batches included.

:class:`GPipe` runs every forward, then every backward: a stage holds the caches of all
``m`` micro-batches. :class:`OneFOneB` (Megatron's default) starts ``p - s - 1`` forwards
ahead on stage ``s`` of ``p``, then alternates one forward and one backward: stage ``s``
holds at most ``p - s`` micro-batches, whatever ``m``. Interleaved virtual stages are not
provided.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from ..backend import array_module
from ..modules.core import Module
from ..partition import balanced_sizes
from ..settings import check_same
from .caches import check_consumed, put_caches, take_caches
from .topology import PipelineGroup, as_pipeline
from .transfer import StageTransfer

__all__ = ["PipelineSchedule", "GPipe", "OneFOneB"]


class PipelineSchedule:
    """The loop of a pipeline schedule over one stage; :meth:`steps` sets the order.

    Parameters
    ----------
    stage : Module
        This rank's stage (e.g. from :func:`~pympar.pipeline.split_stages`).
    pipeline : PipelineGroup or Group
        The pipeline group; its rank ``s`` runs stage ``s``.
    micro_batches : int
        How many micro-batches each :meth:`run` cuts the batch into.
    loss : Module, optional
        The last stage's loss (``forward(prediction, target) -> float`` with mean reduction,
        ``backward(grad) -> gradient of the prediction``, as :class:`pympar.modules.MSELoss`);
        required there, ignored elsewhere. A loss whose mean is not over the micro-batch's
        extent along ``axis`` says over how many terms it is with ``terms(target) -> int``
        (:class:`~pympar.modules.VocabParallelCrossEntropy`: the targets not ignored).
    axis : int, default 0
        The batch axis of the inputs and targets, cut into micro-batches.
    xp : module, optional
        The array module of the activations received (default: that of the stage's first
        parameter, else NumPy).
    label : str, default "pipeline"
        Names the schedule's transfers.

    Attributes
    ----------
    stage : Module
    pipeline : PipelineGroup
    micro_batches : int
    transfer : StageTransfer
    peak_in_flight : int
        The most micro-batches whose caches this stage held at once, over every run.

    Raises
    ------
    ValueError
        On every rank, for ``micro_batches < 1`` or no loss on the last stage.
    pympar.errors.CollectiveMismatchError
        On every rank, when the stages make different schedules (kind, micro-batches, axis,
        label).

    Notes
    -----
    Creating one is collective over the pipeline group: one comparison of the schedule over
    the group, then the transfer's communicator, which :meth:`free` releases. Every
    :meth:`run` then talks only to the neighbouring stages.
    """

    #: The schedule's name, in its label and in errors.
    name = "PipelineSchedule"

    def __init__(self, stage: Module, pipeline: PipelineGroup | Any, micro_batches: int,
                 loss: Module | None = None, *, axis: int = 0, xp: Any = None,
                 label: str = "pipeline") -> None:
        self.pipeline = as_pipeline(pipeline)
        self.stage, self.loss, self.axis = stage, loss, axis
        described = f"{self.name}(micro_batches={micro_batches}, axis={axis}, label={label!r})"
        error = _refusal(described, stage, micro_batches, axis, loss, self.pipeline.is_last)
        # Compared over the group first (with this rank's refusal, if any): stages making
        # other schedules, or refusing theirs, raise here on every rank.
        check_same(self.pipeline.group.comm, self.name,
                   described if error is None else f"{described}: refused by this rank: {error}")
        if error is not None:
            raise error
        self.micro_batches = operator.index(micro_batches)
        first = next(iter(stage.parameters()), None)
        self.xp = xp or (array_module(first.data) if first is not None else np)
        self.transfer = StageTransfer(self.pipeline, described)
        self.peak_in_flight = 0
        self._stash: dict[int, tuple[Any, Any]] = {}

    def __repr__(self) -> str:
        return f"{self.transfer.label} on {self.pipeline!r}"

    def free(self) -> None:
        """Release the schedule's communicator (collective over the pipeline group;
        idempotent). Free a schedule that will not run again: MPI gives a program a few
        thousand communicators."""
        self.transfer.free()

    def steps(self) -> list[tuple[str, int]]:
        """This stage's order: ``("forward", k)`` and ``("backward", k)`` for every
        micro-batch ``k``."""
        raise NotImplementedError(f"{type(self).__name__}.steps is not implemented")

    def run(self, inputs: Any = None, targets: Any = None, loss_scale: float = 1.0) -> float | None:
        """Forward and backward of one batch through the pipeline; accumulate the gradients.

        Parameters
        ----------
        inputs : array or sequence of arrays
            The first stage's batch (cut along ``axis`` into ``micro_batches`` balanced
            parts), or its micro-batches; ignored on the other stages.
        targets : array or sequence of arrays
            The last stage's targets, cut alike; ignored on the other stages.
        loss_scale : float, default 1.0
            Multiplies the loss gradient (a :class:`pympar.amp.GradScaler`'s
            ``get_scale()``); the loss returned is not scaled.

        Returns
        -------
        float or None
            The mean loss over the batch on the last stage; None on the others.

        Raises
        ------
        Exception
            Whatever a stage raises (its own error, a mismatch with its neighbours, the
            watchdog's timeout) is raised on every stage: the others raise
            :class:`~pympar.errors.PeerEndedError` or the same mismatch.
        """
        total, p = 0.0, self.pipeline
        try:
            data = self._cut(inputs, "inputs") if p.is_first else None
            goal = self._cut(targets, "targets") if p.is_last else None
            if goal is not None:
                terms = [self._terms(t) for t in goal]
                shares = [n / max(sum(terms), 1) for n in terms]
            for action, k in self.steps():
                if action == "forward":
                    x = data[k] if p.is_first else self.transfer.recv_forward(k, self.xp)
                    y = self.stage.forward(x)
                    dy = None
                    if p.is_last:
                        total += shares[k] * self.loss.forward(y, goal[k])
                        dy = self.loss.backward(shares[k] * loss_scale)
                    else:
                        self.transfer.send_forward(y, k)
                    self._stash[k] = (take_caches(self.stage), dy)
                    self.peak_in_flight = max(self.peak_in_flight, len(self._stash))
                else:
                    caches, dy = self._stash.pop(k)
                    if not p.is_last:
                        dy = self.transfer.recv_backward(k, self.xp)
                    put_caches(self.stage, caches)
                    dx = self.stage.backward(dy)
                    check_consumed(self.stage, f"{self.name}.run, micro-batch {k}")
                    if not p.is_first:
                        self.transfer.send_backward(dx, k)
            self.transfer.finish()
        except BaseException as error:
            self._stash.clear()
            take_caches(self.stage)  # a failed micro-batch's caches go too
            self.transfer.abort(error)  # the neighbours raise (nothing when they told us)
            raise
        return total if p.is_last else None

    def _terms(self, target: Any) -> int:
        """How many terms the loss's mean over ``target`` (a micro-batch's) is over."""
        count = getattr(self.loss, "terms", None)
        return int(count(target)) if count is not None else target.shape[self.axis]

    def _cut(self, batch: Any, what: str) -> list[Any]:
        """``batch`` as ``micro_batches`` arrays along ``axis`` (a sequence: as given)."""
        m, axis = self.micro_batches, self.axis
        if isinstance(batch, (list, tuple)):
            if len(batch) != m:
                raise ValueError(f"{self.transfer.label}.run: {len(batch)} {what} given as "
                                 f"micro-batches, expected {m}")
            return list(batch)
        if not hasattr(batch, "shape") or not -batch.ndim <= axis < batch.ndim:
            end = "first" if what == "inputs" else "last"
            raise ValueError(f"{self.transfer.label}.run: the {end} stage needs its {what} as "
                             f"an array with axis {axis}, or a list of {m} micro-batches; got "
                             f"{type(batch).__name__}")
        n = batch.shape[axis]
        if n < m:
            raise ValueError(f"{self.transfer.label}.run: {what} of {n} along axis {axis} "
                             f"cannot make {m} micro-batches")
        cuts, start = [], 0
        for size in balanced_sizes(n, m):
            index = [slice(None)] * batch.ndim
            index[axis] = slice(start, start + size)
            cuts.append(batch[tuple(index)])
            start += size
        return cuts


def _refusal(described: str, stage: Any, micro_batches: Any, axis: Any, loss: Any,
             last: bool) -> Exception | None:
    """Why this rank cannot make the schedule, or None."""
    try:
        if operator.index(micro_batches) < 1:
            return ValueError(f"{described}: need at least one micro-batch")
        operator.index(axis)
    except TypeError:
        return TypeError(f"{described}: micro_batches and axis must be integers")
    if not isinstance(stage, Module):
        return TypeError(f"{described}: stage must be a Module, not {type(stage).__name__}")
    if last and not isinstance(loss, Module):
        return ValueError(f"{described}: the last stage needs a loss Module, got "
                          f"{type(loss).__name__}")
    return None


class GPipe(PipelineSchedule):
    """All forwards, then all backwards (GPipe): a stage holds ``m`` micro-batches.

    See :class:`PipelineSchedule` for the parameters.
    """

    name = "GPipe"

    def steps(self) -> list[tuple[str, int]]:
        """``m`` forwards in order, then ``m`` backwards in order."""
        m = self.micro_batches
        return [("forward", k) for k in range(m)] + [("backward", k) for k in range(m)]


class OneFOneB(PipelineSchedule):
    """One forward, one backward (1F1B, Megatron's default): stage ``s`` of ``p`` holds at
    most ``p - s`` micro-batches.

    See :class:`PipelineSchedule` for the parameters.
    """

    name = "OneFOneB"

    def steps(self) -> list[tuple[str, int]]:
        """``min(p - s - 1, m)`` forwards ahead, then forward ``k + ahead`` and backward
        ``k`` in turn, then the backwards left."""
        m, p, s = self.micro_batches, self.pipeline.size, self.pipeline.rank
        ahead = min(p - s - 1, m)
        order = [("forward", k) for k in range(ahead)]
        for k in range(m - ahead):
            order += [("forward", k + ahead), ("backward", k)]
        return order + [("backward", k) for k in range(m - ahead, m)]
