"""The layers timed inside the examples' own training loops, on one rank (calibration).

A layer's time depends on what runs around it: a whole model's arrays evict each other from
the caches, and the memory the allocator hands out is warm or fresh depending on what was
freed before. So where the repository's ``examples/`` are at hand, the calibration runs
``examples/burgers.py`` and ``examples/fno.py`` themselves (their ``train``, one rank, a few
sizes around those their layouts give a rank on 1 to 8 ranks), times every layer's forward
and backward (its sub-layers' taken out), AdamW's step and ``zero_grad``, and compares a run
of ``S`` steps with one of ``2S``: setup and validation cancel, one step's time per kind
remains. What a step spends outside the layers (residual adds, the loss, Python) is the
kind ``step.<example>``: the median step less the layers' times.

Every run is a fresh process (``python -m pympar.plan.in_examples NAME STEPS FLAGS...``, one
BLAS thread), as the examples run: a process that has freed arrays of megabytes gets such
arrays back from glibc's heap, one that has not maps fresh pages for each (the Burgers step
took 9 ms in the first kind of process and 19.5 ms in the second).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from .kernels import Sample, _timed_layers
from .models import Layout, run_step
from .presets import BurgersModel, FNOModel

__all__ = ["EXAMPLES", "CONFIGS", "available", "samples", "timed_run", "corun"]

#: The repository's examples (beside the package in a checkout).
EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"

#: Per example, the flags of the runs timed (sizes a rank holds on 1 to 8 ranks).
CONFIGS: dict[str, list[list[str]]] = {
    "burgers": [[], ["--batch", "8"], ["--grid", "32"], ["--batch", "8", "--grid", "32"],
                ["--batch", "4"], ["--grid", "16"]],
    "fno": [[], ["--batch", "4"], ["--batch", "2"], ["--batch", "1"]],
}


def available() -> bool:
    """Whether the examples are at hand (a repository checkout)."""
    return all((EXAMPLES / f"{name}.py").is_file() for name in CONFIGS)


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"pympar_calibration_{name}",
                                                  EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _timed_steps(totals: dict[str, float]) -> Iterator[None]:
    """Inside: AdamW's steps add to ``totals["adamw"]``, ``zero_grad`` to ``"zero_grad"``."""
    from ..modules.core import Module
    from ..optim import Adam
    saved = [(Adam, "step", "adamw"), (Module, "zero_grad", "zero_grad")]
    originals = [cls.__dict__[attr] for cls, attr, _ in saved]

    def timed(original: Any, key: str) -> Any:
        def run(self: Any, *args: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(self, *args, **kw)
            finally:
                totals[key] = totals.get(key, 0.0) + time.perf_counter() - start
        return run
    for (cls, attr, key), original in zip(saved, originals):
        setattr(cls, attr, timed(original, key))
    try:
        yield
    finally:
        for (cls, attr, _), original in zip(saved, originals):
            setattr(cls, attr, original)


def _model(name: str, flags: list[str]) -> Any:
    """The preset of ``name`` with the example's ``--batch`` and ``--grid`` among ``flags``."""
    sizes = {flags[i][2:]: int(flags[i + 1]) for i in range(0, len(flags), 2)}
    return (BurgersModel if name == "burgers" else FNOModel)(**sizes)


def timed_run(name: str, steps: int, flags: list[str]) -> tuple[dict[str, float], float]:
    """Run the example ``name`` for ``steps`` steps in this process with every layer,
    AdamW's step and ``zero_grad`` timed; their seconds by kind and the median step."""
    example = _load(name)
    totals: dict[str, float] = {}
    with _timed_layers(totals), _timed_steps(totals):
        metrics = example.train(example.parse_args([*flags, "--steps", str(steps), "--quiet"]))
    return totals, metrics["median_step_seconds"]


def _one_thread() -> dict[str, str]:
    """This process's environment with one BLAS/OpenMP thread (as the examples run)."""
    return dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                MKL_NUM_THREADS="1")


def _fresh(name: str, steps: int, flags: list[str]) -> tuple[dict[str, float], float]:
    """:func:`timed_run` in a fresh process (one BLAS thread, no launcher)."""
    done = subprocess.run([sys.executable, "-m", "pympar.plan.in_examples", name, str(steps),
                           *flags], capture_output=True, text=True, env=_one_thread(),
                          check=True, timeout=600)
    totals, median = json.loads(done.stdout.strip().splitlines()[-1])
    return totals, median


def corun(cores: int, steps: int = 30, rounds: int = 3) -> float:
    """How much slower the Burgers example's step runs while ``cores`` copies run side by
    side than alone: the median over ``rounds`` of the ratio of their median steps."""
    env, ratios = _one_thread(), []
    for _ in range(rounds):
        solo = _fresh("burgers", steps, [])[1]
        runs = [subprocess.Popen([sys.executable, "-m", "pympar.plan.in_examples", "burgers",
                                  str(steps)], stdout=subprocess.PIPE, text=True, env=env)
                for _ in range(cores)]
        together = [json.loads(run.communicate(timeout=600)[0].strip().splitlines()[-1])[1]
                    for run in runs]
        ratios.append(sum(together) / len(together) / solo)
    return max(1.0, statistics.median(ratios))


def samples(steps: int = 15) -> list[Sample]:
    """Per example, size and kind: one step's seconds inside the example (fresh runs of
    ``steps`` and ``2 * steps`` steps compared), beside the work its preset emits for the
    size."""
    out: list[Sample] = []
    for name, configs in CONFIGS.items():
        for flags in configs:
            (short, _), (long, median) = (_fresh(name, count, flags)
                                          for count in (steps, 2 * steps))
            per_step = {kind: (long[kind] - short.get(kind, 0.0)) / steps for kind in long}
            done = run_step(_model(name, flags), Layout()).env.work
            for kind, seconds in per_step.items():
                work = [w for w in done if w.kind == kind]
                if work:
                    out.append((work, max(seconds, 0.0)))
            # The rest of the step: the work of kinds not timed (residual adds, the loss)
            # and the example's own Python, ``step.<example>``.
            rest = [w for w in done if w.kind not in per_step]
            out.append((rest, max(median - sum(per_step.values()), 0.0)))
    return out


if __name__ == "__main__":
    from threadpoolctl import threadpool_limits
    with threadpool_limits(1):
        found = timed_run(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
    print(json.dumps(found))
