"""Pipeline parallelism: a model cut by depth into stages on their own ranks, micro-batches
flowing through them.

* :class:`PipelineGroup`: the stages as a value over a pympar ``Group`` (first and last
  stage, previous and next rank; :mod:`pympar.pipeline.topology`).
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

The names load with their module on first use, so that a lower floor (the manager) can
import :mod:`pympar.pipeline.topology` without the schedules, which import the layers.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Each public name -> the module that defines it.
_HOMES = {
    "PipelineGroup": "topology", "as_pipeline": "topology",
    "StageTransfer": "transfer",
    "PipelineStage": "stages", "split_stages": "stages", "stage_bounds": "stages",
    "PipelineSchedule": "schedules", "GPipe": "schedules", "OneFOneB": "schedules",
    "Caches": "caches", "take_caches": "caches", "put_caches": "caches",
    "check_consumed": "caches",
}

__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # found at once next time
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
