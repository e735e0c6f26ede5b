"""The planner on a chain of pympar layers (its Python API): calls, bytes and memory exact.

A ``Sequential`` of layer norm, context-parallel attention, a Column -> GELU -> Row MLP and a
replicated ``Linear`` runs one step on every layout of this world size (all-reduced
gradients, and ZeRO); the recorders' rows and :mod:`pympar.memory` must equal what
:class:`pympar.plan.ChainModel` predicts for each rank.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import WORLD, agree
from pympar import manager, stats
from pympar.memory import activation_bytes, memory_report
from pympar.modules import (GELU, ColumnParallelLinear, ContextAttention, LayerNorm, Linear,
                            RowParallelLinear, Sequential)
from pympar.optim import AdamW, allreduce_gradients
from pympar.partition import block_slice
from pympar.plan.custom import ChainModel, describe_module
from pympar.plan.ledger import canonical, rows
from pympar.plan.models import run_step
from pympar.zero import ZeroRedundancyOptimizer

SEQUENCE, BATCH, HIDDEN, HEADS = 9, 5, 8, 2
KINDS = ("parameters", "gradients", "optimizer", "workspace", "activations")


def build(scheme: str) -> Sequential:
    return Sequential(LayerNorm(HIDDEN, dtype=np.float64),
                      ContextAttention(HIDDEN, HEADS, scheme, dtype=np.float64, seed=1),
                      ColumnParallelLinear(HIDDEN, 4 * HIDDEN, gather_output=False,
                                           dtype=np.float64, seed=2), GELU(),
                      RowParallelLinear(4 * HIDDEN, HIDDEN, input_is_parallel=True,
                                        dtype=np.float64, seed=3),
                      Linear(HIDDEN, HIDDEN, dtype=np.float64, seed=4))


def step(net: Sequential, state, zero: bool) -> tuple[dict, dict]:
    optimizer = (ZeroRedundancyOptimizer(net, AdamW, group=state.data_context, lr=1e-3) if zero
                 else AdamW(net.parameters(), lr=1e-3))
    x = np.random.default_rng(0).standard_normal((SEQUENCE, BATCH, HIDDEN))
    x = x[block_slice(SEQUENCE, state.context.size, state.context.rank)][
        :, block_slice(BATCH, state.data.size, state.data.rank)]
    with stats.record() as rec:
        net.zero_grad()
        y = net.forward(x)
        cached = activation_bytes(net)
        net.backward(np.ones_like(y))
        if not zero:
            allreduce_gradients(net, state.data_context)
        optimizer.step()
    report = memory_report(net, optimizer)
    report["activations"] = cached
    recorded: dict = {}
    for (group, operation), (calls, bytes_in, bytes_out, _) in rec.rows.items():
        key = (group, canonical(operation))
        recorded[key] = [a + b for a, b in zip(recorded.get(key, [0, 0, 0]),
                                               (calls, bytes_in, bytes_out))]
    return recorded, report


@pytest.mark.mpi(min_size=1)
def test_a_chain_sends_and_holds_what_its_plan_says(clean_state):
    manager.initialize_parallel(comm=MPI.COMM_SELF)  # built on one rank, as a user would
    try:
        template = ChainModel.from_module(build("ring"), SEQUENCE, BATCH, HIDDEN)
    finally:
        manager.destroy_parallel()
    assert template.itemsize == 8 and template.heads == HEADS
    problems = []
    for layout in template.layouts(WORLD.size):
        if template.unfit(layout) is not None:
            continue
        state = manager.initialize_parallel(layout.tp, layout.cp)
        try:
            net = build(layout.attention)
            recorded, report = step(net, state, layout.zero)
            model = ChainModel.from_module(net, SEQUENCE, BATCH, HIDDEN)
        finally:
            manager.destroy_parallel()
        planned = run_step(model, layout, WORLD.rank)
        want = rows(planned.env.calls, planned.env.site)
        problems += [f"{layout}: {key} recorded {recorded.get(key)} planned {want.get(key)}"
                     for key in set(recorded) | set(want) if recorded.get(key) != want.get(key)]
        problems += [f"{layout}: {kind} accounted {report[kind]} planned {planned.memory[kind]}"
                     for kind in KINDS if report[kind] != planned.memory[kind]]
    agree(not problems, "; ".join(problems[:3]))


@pytest.mark.skipif(WORLD.size > 1, reason="no communication; one rank is enough")
def test_a_layer_the_planner_does_not_know_is_named():
    from pympar.modules import ReLU
    with pytest.raises(ValueError, match="does not know ReLU.*it knows Linear"):
        describe_module(Sequential(Linear(4, 4), ReLU()), 8)
