"""``PipelineGroup``: the stages of a pipeline as a value over one pympar ``Group``.

The group's rank ``s`` runs stage ``s``: activations flow from rank ``s`` to rank ``s + 1``
and their gradients back. Everything here is rank arithmetic on the group (no message), so
that the manager's Megatron-named getters (first and last stage, previous and next rank) and
the pipeline's transfers read the same answers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PipelineGroup", "as_pipeline"]


class PipelineGroup:
    """The stages of a pipeline: a pympar ``Group`` whose rank ``s`` runs stage ``s``.

    Parameters
    ----------
    group : Group
        The pipeline group (``Mesh(...).group("pp")``): its ranks in stage order.

    Attributes
    ----------
    group : Group
    rank : int
        This rank's stage (its rank in ``group``).
    size : int
        The number of stages.
    is_first, is_last : bool
        Whether this rank runs the first (reads the data) or the last stage (the loss).
    prev_rank, next_rank : int or None
        The group ranks of the previous and next stages (None at either end).
    prev_global_rank, next_global_rank : int or None
        The same as global ranks (the mesh's parent communicator). Megatron's
        ``get_pipeline_model_parallel_prev_rank`` and ``..._next_rank`` (and pympar's, in
        :mod:`pympar.manager`) wrap around at the ends instead.

    Raises
    ------
    TypeError
        When ``group`` is not a pympar ``Group`` (it needs ``rank``, ``size``, ``ranks`` and
        ``comm``).
    """

    def __init__(self, group: Any) -> None:
        if not all(hasattr(group, a) for a in ("rank", "size", "ranks", "comm", "name")):
            raise TypeError(f"PipelineGroup: group must be a pympar Group (Mesh.group('pp')), "
                            f"not {type(group).__name__}")
        self.group = group
        self.rank, self.size = int(group.rank), int(group.size)
        self.is_first, self.is_last = self.rank == 0, self.rank == self.size - 1
        self.prev_rank = None if self.is_first else self.rank - 1
        self.next_rank = None if self.is_last else self.rank + 1
        self.prev_global_rank = None if self.is_first else int(group.ranks[self.rank - 1])
        self.next_global_rank = None if self.is_last else int(group.ranks[self.rank + 1])

    @property
    def name(self) -> str:
        """str: The group's name (``"pp-0-2"``)."""
        return self.group.name

    def __repr__(self) -> str:
        return f"PipelineGroup({self.group.name!r}, stage {self.rank} of {self.size})"


def as_pipeline(pipeline: Any) -> PipelineGroup:
    """``pipeline`` as a :class:`PipelineGroup` (a ``Group`` is wrapped, a ``PipelineGroup``
    returned as it is)."""
    return pipeline if isinstance(pipeline, PipelineGroup) else PipelineGroup(pipeline)
