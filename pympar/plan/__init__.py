"""A layout planner: what a layout of a model costs, before the job runs.

For a model (the examples' presets, or any chain of pympar layers), a rank count and a
machine, :func:`rank` lists the layouts that fit, fastest first by predicted step time, with
each one's memory per rank, bytes sent per step and share of communication, and says why the
others do not fit; ``python -m pympar plan`` prints it (:mod:`pympar.plan.cli`). Nothing runs
in parallel: the prediction is arithmetic on one process.

How it predicts:

* :mod:`~pympar.plan.program`, :mod:`~pympar.plan.layers`,
  :mod:`~pympar.plan.parallel_layers`, :mod:`~pympar.plan.training`: one rank's training step
  run symbolically, layer by layer as pympar's code runs it: its collectives (group,
  operation, bytes: what :mod:`pympar.stats` records, exactly), its agreement checks, its
  local work and the arrays it caches (what :mod:`pympar.memory` counts, exactly);
* :mod:`~pympar.plan.costs`: each collective's messages, bytes and round trips per
  algorithm, inside a node and across nodes, and the check's cost;
* :mod:`~pympar.plan.machines`: alpha-beta-gamma machines (this one, measured by
  :mod:`~pympar.plan.calibrate`; InfiniBand HDR and 25 GbE CPU nodes; a GPU node);
* :mod:`~pympar.plan.ranking`: the step time and the ranking.

Examples
--------
>>> from pympar.plan import BurgersModel, Layout, machine, predict
>>> p = predict(BurgersModel(), Layout(tp=2, cp=2, dp=2), machine("hdr"))
>>> p.fits, p.calls > 0, p.memory["total"] > 0
(True, True, True)
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Layout", "Model", "run_step", "BurgersModel", "FNOModel", "ChainModel",
           "describe_module", "Machine", "Link", "machine", "PRESETS", "Prediction",
           "predict", "rank", "traffic", "algorithm", "check_seconds"]

# Imported on first use: ``python -m pympar`` builds its options from pympar.plan.cli without
# loading the layers, optimizers and mappings these need.
_WHERE = {"Layout": "models", "Model": "models", "run_step": "models",
          "BurgersModel": "presets", "FNOModel": "presets", "ChainModel": "custom",
          "describe_module": "custom", "Machine": "machines", "Link": "machines",
          "machine": "machines", "PRESETS": "machines", "Prediction": "ranking",
          "predict": "ranking", "rank": "ranking", "traffic": "costs", "algorithm": "costs",
          "check_seconds": "costs"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
