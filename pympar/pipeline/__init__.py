"""Pipeline parallelism: a model cut by depth into stages on their own ranks, micro-batches
flowing through them.

* :class:`PipelineGroup`: the stages as a value over a pympar ``Group`` (first and last
  stage, previous and next rank).
* :class:`StageTransfer`: activations to the next stage and their gradients back, agreed
  with the neighbouring stage only (:mod:`pympar.pipeline.transfer`).
* :func:`split_stages`, :class:`PipelineStage`, :func:`stage_bounds`: a chain of layers cut
  into stages, parameters named as in the serial model (:mod:`pympar.pipeline.stages`).
* :class:`GPipe` and :class:`OneFOneB`: the schedules, one loop over ``forward`` and
  ``backward`` (:mod:`pympar.pipeline.schedules`), holding several micro-batches' caches
  outside the layers (:func:`take_caches`, :func:`put_caches`).

Data parallelism, ZeRO, the loss scaler and ``Recompute`` work per stage;
:func:`pympar.checkpoint.save` writes the serial checkpoint whatever the cut, and
:func:`~pympar.checkpoint.load` reads it under any other.
"""

from .caches import Caches, check_consumed, put_caches, take_caches
from .schedules import GPipe, OneFOneB, PipelineSchedule
from .stages import PipelineStage, split_stages, stage_bounds
from .topology import PipelineGroup, as_pipeline
from .transfer import StageTransfer

__all__ = ["PipelineGroup", "as_pipeline", "StageTransfer", "PipelineStage", "split_stages",
           "stage_bounds", "PipelineSchedule", "GPipe", "OneFOneB", "Caches", "take_caches",
           "put_caches", "check_consumed"]
