"""The planner's ledger against reality: the statistics recorders and the memory accounting.

For every layout of the examples on this world size (tensor, context and 3D sizes, the three
attention schemes; ZeRO with recomputation once per model-parallel shape), one training step
of ``examples/burgers.py`` and ``examples/fno.py`` is recorded (a run of two steps minus a run
of one: setup and validation cancel) and compared, on every rank, per group and operation,
with the calls and bytes the planner predicts for that rank: exactly. The memory the planner
predicts equals what the example reports from :mod:`pympar.memory` (Burgers) and what
:func:`pympar.memory.memory_report` counts after a step (the FNO), on every rank.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from mpi_helpers import WORLD, agree
from pympar import stats
from pympar.plan.ledger import canonical, rows
from pympar.plan.models import Layout, run_step, ulysses_size
from pympar.plan.presets import BurgersModel, FNOModel

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
KINDS = ("parameters", "gradients", "optimizer", "workspace", "activations")
BURGERS = ["--batch", "8", "--grid", "10", "--hidden", "8", "--heads", "2", "--layers", "1",
           "--trajectories", "4", "--frames", "3", "--dtype", "float64", "--quiet"]
FNO = ["--batch", "8", "--grid", "10", "--width", "4", "--modes", "3", "--layers", "2",
       "--samples", "8", "--solver-steps", "4", "--dtype", "float64", "--quiet"]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"plan_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def one_step(train, argv: list[str]) -> tuple[dict, dict]:
    """One step's recorder rows (group, canonical operation) -> [calls, bytes in, bytes out],
    from a run of two steps minus a run of one; and the two-step run's metrics."""
    def recorded(steps: int):
        with stats.record() as rec:
            metrics = train(argv + ["--steps", str(steps)])
        return rec.rows, metrics
    (one, _), (two, metrics) = recorded(1), recorded(2)
    step: dict = {}
    for key in set(one) | set(two):
        a, b = one.get(key, [0, 0, 0, 0.0]), two.get(key, [0, 0, 0, 0.0])
        diff = [b[i] - a[i] for i in range(3)]
        if any(diff):
            name = (key[0], canonical(key[1]))
            step[name] = [x + y for x, y in zip(step.get(name, [0, 0, 0]), diff)]
    return step, metrics


def burgers_layouts(world: int) -> list[Layout]:
    """Every (tp, cp, mode, attention) of ``world`` ranks that the example runs, plain; and
    ZeRO with recompute once per (tp, cp, mode). (The planner calls a layout that leaves
    ranks without heads or features unfit; the example runs it, and it is counted here.)"""
    model = BurgersModel(hidden=8, heads=2, layers=1, grid=10, batch=8, itemsize=8)
    out = []
    for layout in model.layouts(world):
        reason = model.unfit(layout)
        if (reason is not None and "leave" not in reason) or layout.zero != layout.recompute:
            continue
        if not layout.zero or layout.attention == "ulysses":
            out.append(layout)
    return out


def flags(layout: Layout) -> list[str]:
    return (["--tp", str(layout.tp), "--cp", str(layout.cp), "--mode", layout.mode,
             "--attention", layout.attention]
            + (["--ulysses-size", str(ulysses_size(layout))] if layout.attention == "hybrid"
               else []) + ["--zero"] * layout.zero + ["--recompute"] * layout.recompute)


def differences(got: dict, want: dict) -> list[str]:
    return [f"{key}: recorded {got.get(key)} planned {want.get(key)}"
            for key in sorted(set(got) | set(want)) if got.get(key) != want.get(key)]


@pytest.mark.mpi(min_size=1)
def test_burgers_every_layout_sends_what_the_plan_says_and_holds_its_memory():
    burgers = load("burgers")
    model = BurgersModel(hidden=8, heads=2, layers=1, grid=10, batch=8, itemsize=8)
    layouts = burgers_layouts(WORLD.size)
    assert layouts and all(layout.ranks == WORLD.size for layout in layouts)
    problems = []
    for layout in layouts:
        step, metrics = one_step(lambda argv: burgers.train(burgers.parse_args(argv)),
                                 BURGERS + flags(layout))
        planned = run_step(model, layout, WORLD.rank)
        wrong = differences(step, rows(planned.env.calls, planned.env.site))
        memory = metrics["memory"][WORLD.rank]
        wrong += [f"{kind}: accounted {memory[kind]} planned {planned.memory[kind]}"
                  for kind in KINDS if memory[kind] != planned.memory[kind]]
        problems += [f"{flags(layout)} {w}" for w in wrong]
        assert step or WORLD.size == 1  # a parallel layout communicates
    agree(not problems, "; ".join(problems[:3]))


@pytest.mark.mpi(min_size=1)
def test_fno_every_layout_sends_what_the_plan_says():
    fno = load("fno")
    model = FNOModel(width=4, modes=3, layers=2, grid=10, batch=8, itemsize=8)
    problems = []
    for layout in model.layouts(WORLD.size):
        step, _ = one_step(lambda argv: fno.train(fno.parse_args(argv)),
                           FNO + ["--spatial", str(layout.cp)])
        planned = run_step(model, layout, WORLD.rank)
        problems += [f"spatial={layout.cp} {w}"
                     for w in differences(step, rows(planned.env.calls, planned.env.site))]
    agree(not problems, "; ".join(problems[:3]))


@pytest.mark.mpi(min_size=1)
def test_fno_memory_is_the_accounting_after_a_step():
    from pympar.memory import activation_bytes, memory_report
    from pympar.mesh import Mesh
    from pympar.modules.fno import split_parameters
    from pympar.optim import AdamW, allreduce_gradients
    from pympar.partition import block_slice
    fno = load("fno")
    model = FNOModel(width=4, modes=3, layers=2, grid=10, batch=8, itemsize=8)
    problems = []
    for layout in model.layouts(WORLD.size):
        mesh = Mesh(WORLD, {"x": layout.cp, "dp": layout.dp})
        groups = spatial, data, both = mesh.group("x"), mesh.group("dp"), mesh.group("x", "dp")
        try:
            net = fno.FNO2d(4, 3, 2, spatial, np.float64, 0)
            optimizer = AdamW(net.parameters(), lr=1e-3, weight_decay=0.0)
            x = np.random.default_rng(0).standard_normal((8, 10, 10, 3))
            x = x[block_slice(8, data.size, data.rank)][:, block_slice(10, spatial.size,
                                                                      spatial.rank)]
            net.zero_grad()
            y = net.forward(x)
            cached = activation_bytes(net)
            net.backward(np.ones_like(y))
            replicated, split = split_parameters(net)
            allreduce_gradients(replicated, both)
            allreduce_gradients(split, data)
            optimizer.step()
            report = memory_report(net, optimizer)
            report["activations"] = cached
        finally:
            for group in groups:
                group.free()
        planned = run_step(model, layout, WORLD.rank).memory
        problems += [f"spatial={layout.cp} {kind}: accounted {report[kind]} planned "
                     f"{planned[kind]}" for kind in KINDS if report[kind] != planned[kind]]
    agree(not problems, "; ".join(problems[:3]))
