"""A model cut by depth: each pipeline stage builds and holds only its own layers.

:func:`split_stages` cuts a chain of layers (a ``Sequential``, a list of layers, or of
functions that build one) into consecutive stages, by the balanced rule or by the counts the
user gives, and returns this rank's :class:`PipelineStage`. The stage registers each layer
under its index in the whole chain, so its parameters have the names they have in the
serial ``Sequential`` (``"5.weight"``): checkpoints, state dicts and optimizers see the same
names whatever the cut, and a checkpoint saved under one cut loads under any other
(:mod:`pympar.checkpoint` writes the union of every stage's parameters).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence, Union

from ..modules.core import Module, Sequential
from ..partition import balanced_sizes
from ..settings import check_same
from .topology import PipelineGroup, as_pipeline

__all__ = ["PipelineStage", "split_stages", "stage_bounds"]

LayerOrFactory = Union[Module, Callable[[], Module]]


def stage_bounds(layers: int, stages: int, balance: Sequence[int] | None = None) -> list[range]:
    """The layer indices of each stage: consecutive runs of ``range(layers)``.

    Parameters
    ----------
    layers : int
        The number of layers in the chain.
    stages : int
        The number of pipeline stages.
    balance : sequence of int, optional
        Layers per stage, in stage order (each at least 1, adding up to ``layers``). By
        default the balanced rule: the first ``layers % stages`` stages hold one more.

    Returns
    -------
    list of range

    Raises
    ------
    ValueError
        For fewer layers than stages, or a balance of the wrong length, a stage without a
        layer, or counts that do not add up to ``layers``.
    """
    layers, stages = operator.index(layers), operator.index(stages)
    if stages < 1:
        raise ValueError(f"stage_bounds: need at least one stage, got {stages}")
    if balance is None:
        if layers < stages:
            raise ValueError(f"stage_bounds: {layers} layers cannot fill {stages} stages "
                             f"(each stage needs at least one layer)")
        counts = list(balanced_sizes(layers, stages))
    else:
        counts = [operator.index(c) for c in balance]
        if len(counts) != stages or min(counts) < 1 or sum(counts) != layers:
            raise ValueError(f"stage_bounds: balance {list(balance)} must give each of the "
                             f"{stages} stages at least one layer, {layers} in all")
    starts = [sum(counts[:s]) for s in range(stages)]
    return [range(a, a + n) for a, n in zip(starts, counts)]


class PipelineStage(Sequential):
    """One pipeline stage: consecutive layers of a chain, named by their index in it.

    A ``Sequential`` (forward runs the layers in order, backward in reverse) whose layers
    are registered as ``"<index in the chain>"``, so parameter names are the serial model's.

    Parameters
    ----------
    layers : mapping of int to Module
        This stage's layers by their index in the whole chain (consecutive).
    stage : int
        This stage's position in the pipeline.
    stages : int
        The number of stages.

    Attributes
    ----------
    stage, stages : int
    layer_range : range
        The indices of this stage's layers in the chain.
    holds_part_of_model : bool
        True: the stage's parameters are part of a model whose other parts live on other
        ranks (:func:`pympar.checkpoint.save` and ``load`` then work on the union).
    """

    holds_part_of_model = True

    def __init__(self, layers: dict[int, Module], stage: int, stages: int) -> None:
        Module.__init__(self)  # not Sequential's: it would name the layers 0, 1, ...
        indices = sorted(layers)
        if not indices or indices != list(range(indices[0], indices[0] + len(indices))):
            raise ValueError(f"PipelineStage: the layers' indices must be consecutive, got "
                             f"{indices}")
        for i in indices:
            if not isinstance(layers[i], Module):
                raise TypeError(f"PipelineStage: layer {i} is {type(layers[i]).__name__}, "
                                f"not a Module")
            setattr(self, str(i), layers[i])
        self.stage, self.stages = int(stage), int(stages)
        self.layer_range = range(indices[0], indices[-1] + 1)

    def extra_repr(self) -> str:
        """The stage and its layers' indices."""
        r = self.layer_range
        return f"stage {self.stage} of {self.stages}, layers {r.start}-{r.stop - 1}"


def split_stages(layers: Sequence[LayerOrFactory] | Module, pipeline: PipelineGroup | Any,
                 balance: Sequence[int] | None = None) -> PipelineStage:
    """This rank's stage of a chain of layers cut by depth; collective over the pipeline.

    Parameters
    ----------
    layers : Sequential or sequence of Module or of callables
        The whole chain, as every rank sees it. A callable (taking no argument, returning a
        Module) is called only on the stage that holds it: build big models that way, so that
        each rank allocates only its own layers' parameters (give each layer its own init
        seed, as the serial model does, and they start as the serial model's).
    pipeline : PipelineGroup or Group
        The pipeline group; its rank ``s`` holds stage ``s``.
    balance : sequence of int, optional
        Layers per stage (see :func:`stage_bounds`); balanced by default.

    Returns
    -------
    PipelineStage

    Raises
    ------
    ValueError
        On every rank, for a cut that :func:`stage_bounds` refuses.
    pympar.errors.CollectiveMismatchError
        On every rank, when the ranks of the pipeline pass different numbers of layers or
        balances.
    """
    pipeline = as_pipeline(pipeline)
    chain = list(layers)
    check_same(pipeline.group.comm, "split_stages",
               f"{len(chain)} layers, balance={None if balance is None else list(balance)}")
    mine = stage_bounds(len(chain), pipeline.size, balance)[pipeline.rank]
    built = {}
    for i in mine:
        layer = chain[i]
        built[i] = layer if isinstance(layer, Module) else layer()
    return PipelineStage(built, pipeline.rank, pipeline.size)
