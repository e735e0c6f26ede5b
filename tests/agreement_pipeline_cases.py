"""The pipeline's cases of tests/test_agreement_mismatch.py (see agreement_cases.py).

Every rank of the world is one stage. A transfer's arguments are compared by the neighbour
receiving the message, which tells its neighbours, and so on along the pipeline: every stage
raises the mismatch. Where the last rank's differing call is a send it cannot make as the
last stage (forward) or a receive of the first stage's, the case runs the pipeline reversed:
the last rank is stage 0. Importing this module registers the layers' and these cases:
``CASES`` is theirs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agreement_cases import WORLD, Context, case
from agreement_layer_cases import CASES  # the one table: the layers' cases registered too
from pympar.group import Group
from pympar.modules import Linear, MSELoss
from pympar.pipeline import GPipe, StageTransfer, split_stages

__all__ = ["CASES"]

_PP = "pympar.pipeline."


def _reversed(ctx: Context) -> Group:
    """The world as a pipeline whose stage 0 is the last rank (collective)."""
    n = WORLD.size
    group = Group(WORLD.Split(0, n - 1 - WORLD.rank), f"pp-reversed-{len(ctx.made)}",
                  list(range(n - 1, -1, -1)))
    ctx.made.append(group)
    return group


def _forward_chain(transfer: StageTransfer, sent: int = 0, expected: int = 0) -> None:
    """Every stage receives one activation from the previous one and sends one on."""
    pipe = transfer.pipeline
    if not pipe.is_first:
        transfer.recv_forward(expected)
    if not pipe.is_last:
        transfer.send_forward(np.ones((2, 3)), sent)
    transfer.finish()


def _round_trip(transfer: StageTransfer, gradient: Any = None, sent: int = 0,
                expected: int = 0) -> None:
    """One activation forward through every stage, its gradient back (``gradient(x)``)."""
    pipe = transfer.pipeline
    x = None if pipe.is_first else transfer.recv_forward(0)
    if not pipe.is_last:
        transfer.send_forward(np.ones((2, 3)), 0)
        transfer.recv_backward(expected)
    if not pipe.is_first:
        transfer.send_backward(gradient(x) if gradient is not None else x, sent)
    transfer.finish()


@case(_PP + "StageTransfer.__init__", "label")
def _label(ctx: Context, param: str) -> Any:
    return _forward_chain(StageTransfer(ctx.group(), label=ctx.pick("pipeline", "other")))


@case(_PP + "StageTransfer.send_forward", "micro_batch")
def _send_forward(ctx: Context, param: str) -> Any:
    return _forward_chain(StageTransfer(_reversed(ctx)), sent=ctx.pick(0, 1))


@case(_PP + "StageTransfer.recv_forward", "micro_batch")
def _recv_forward(ctx: Context, param: str) -> Any:
    return _forward_chain(StageTransfer(ctx.group()), expected=ctx.pick(0, 1))


@case(_PP + "StageTransfer.send_backward", "dx", "micro_batch")
def _send_backward(ctx: Context, param: str) -> Any:
    transfer = StageTransfer(ctx.group())
    if param == "dx":
        return _round_trip(transfer, gradient=lambda x: ctx.pick(x, x[:1]))
    return _round_trip(transfer, sent=ctx.pick(0, 1))


@case(_PP + "StageTransfer.recv_backward", "micro_batch")
def _recv_backward(ctx: Context, param: str) -> Any:
    return _round_trip(StageTransfer(_reversed(ctx)), expected=ctx.pick(0, 1))


def _chain(n: int) -> list:
    return [Linear(3, 3, dtype=np.float64, seed=i) for i in range(n)]


@case(_PP + "split_stages", "layers", "balance")
def _split(ctx: Context, param: str) -> Any:
    group = ctx.group()
    n = group.size + 1
    if param == "layers":
        return split_stages(_chain(ctx.pick(n, n + 1)), group)
    return split_stages(_chain(n), group, balance=ctx.pick(None, [1] * (n - 2) + [2]))


@case(_PP + "PipelineSchedule.__init__", "micro_batches", "axis", "loss", "label")
def _schedule(ctx: Context, param: str) -> Any:
    group = ctx.group()
    stage = split_stages(_chain(group.size), group)
    kwargs: dict[str, Any] = {"micro_batches": 2, "loss": MSELoss()}
    kwargs[param] = ctx.pick(kwargs.get(param, {"axis": 0, "label": "pipeline"}.get(param)),
                             {"micro_batches": 3, "axis": 1, "loss": None,
                              "label": "other"}[param])
    run = GPipe(stage, group, **kwargs)
    return run.run(np.ones((4, 3)), np.ones((4, 3)))
