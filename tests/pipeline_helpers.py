"""What the pipeline tests share: layouts cut from a ``Mesh``, a chain of layers, its serial
training as the reference, and the pipelined training checked against it.

The chain is seven layers (so that stages hold uneven runs of them): plain ``Linear``, or,
with tensor parallelism, ``Linear`` then two Column -> GELU -> Row pairs whose TP-split
activations cross stage boundaries (each TP rank sends its shard to its counterpart in the
next stage). The serial reference is the same chain built over a group of one rank, with the
whole batch: every data-parallel replica trains on its own rows of it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from layer_helpers import self_group
from mpi_helpers import WORLD, agree
from pympar.mesh import Mesh
from pympar.modules import (GELU, ColumnParallelLinear, Linear, MSELoss, ReLU,
                            RowParallelLinear, Sequential)
from pympar.optim import AdamW, allreduce_gradients

P = WORLD.Get_size()
FEATURES, HIDDEN, WIDE, OUT = 5, 6, 8, 3
ROWS = 11  # per data-parallel replica: uneven micro-batches for most counts
STEPS = 10
TOLERANCE = {"rtol": 1e-10, "atol": 1e-12}

#: name -> (mesh sizes, order): 2 and 4 stages alone, and composed with TP and DP in
#: several orders (pp innermost, between, outermost).
_ALL = {
    "pp1": ({"pp": 1}, "pp"),
    "pp2": ({"pp": 2}, "pp"),
    "pp4": ({"pp": 4}, "pp"),
    "pp2-tp2": ({"tp": 2, "pp": 2}, "tp-pp"),
    "pp2-dp2": ({"pp": 2, "dp": 2}, "dp-pp"),
    "pp2-tp2-dp2": ({"tp": 2, "pp": 2, "dp": 2}, "pp-tp-dp"),
    "pp4-dp2": ({"pp": 4, "dp": 2}, "pp-dp"),
}
LAYOUTS = [name for name, (sizes, _) in _ALL.items() if int(np.prod(list(sizes.values()))) == P]


class Layout:
    """The groups of one layout: ``pp``, and ``tp``/``dp`` (a group of one where absent)."""

    def __init__(self, name: str) -> None:
        sizes, order = _ALL[name]
        mesh = Mesh(WORLD, sizes, order=order)
        self.name, self.made = name, []
        self.pp = self._group(mesh, "pp")
        self.tp = self._group(mesh, "tp") if "tp" in sizes else self_group()
        self.dp = self._group(mesh, "dp") if "dp" in sizes else None

    def _group(self, mesh: Mesh, axis: str) -> Any:
        group = mesh.group(axis)
        self.made.append(group)
        return group

    @property
    def tensor_parallel(self) -> bool:
        return self.tp.size > 1 or "tp" in self.name

    def free(self) -> None:
        for group in self.made:
            group.free()


def layers(tp_group: Any, tensor_parallel: bool) -> list:
    """The chain of seven layers (float64), over ``tp_group`` where tensor-parallel."""
    f64 = np.float64
    if not tensor_parallel:
        return [Linear(FEATURES, HIDDEN, dtype=f64, seed=1), GELU(),
                Linear(HIDDEN, HIDDEN, dtype=f64, seed=2), ReLU(),
                Linear(HIDDEN, HIDDEN, dtype=f64, seed=3), GELU(),
                Linear(HIDDEN, OUT, dtype=f64, seed=4)]

    def pair(n_in: int, n_out: int, seed: int) -> list:
        return [ColumnParallelLinear(n_in, WIDE, gather_output=False, dtype=f64, group=tp_group,
                                     seed=seed),
                GELU(),
                RowParallelLinear(WIDE, n_out, input_is_parallel=True, dtype=f64,
                                  group=tp_group, seed=seed + 1)]

    return [Linear(FEATURES, HIDDEN, dtype=f64, seed=1), *pair(HIDDEN, HIDDEN, 2),
            *pair(HIDDEN, OUT, 4)]


def batch(step: int, replicas: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole batch of ``step`` (every replica's rows), the same on every rank."""
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((ROWS * replicas, FEATURES))
    return x, np.tanh(x[:, :OUT] * 1.5) + 0.1 * rng.standard_normal((ROWS * replicas, OUT))


def rows(x: np.ndarray, dp: Any) -> np.ndarray:
    """This replica's rows of a whole batch."""
    r = 0 if dp is None else dp.rank
    return x[r * ROWS:(r + 1) * ROWS]


_SERIAL: dict[tuple, dict] = {}


def serial_training(tensor_parallel: bool, replicas: int, steps: int = STEPS) -> dict:
    """The serial reference (cached): losses, first gradients and parameters per step."""
    key = (tensor_parallel, replicas, steps)
    if key not in _SERIAL:
        model = Sequential(*layers(self_group(), tensor_parallel))
        optimizer, loss = AdamW(model, lr=1e-2), MSELoss()
        found: dict = {"losses": [], "grads": None, "params": []}
        for step in range(steps):
            x, t = batch(step, replicas)
            model.zero_grad()
            found["losses"].append(loss.forward(model.forward(x), t))
            model.backward(loss.backward(1.0))
            if step == 0:
                found["grads"] = {n: p.grad.copy() for n, p in model.named_parameters()}
            optimizer.step()
            found["params"].append({n: p.data.copy() for n, p in model.named_parameters()})
        _SERIAL[key] = found
    return _SERIAL[key]


def worst(stage: Any, full: dict, what: str) -> list[str]:
    """The parameters of ``stage`` whose ``what`` ("grad" or "data") differ from this rank's
    block of the serial arrays ``full`` (by name; a layer wrapped in ``Recompute`` is
    ``"<i>.module.<name>"``)."""
    bad = []
    for name, p in stage.named_parameters():
        mine, theirs = getattr(p, what), p.placement.take(full[name.replace(".module.", ".")])
        if mine is None or not np.allclose(mine, theirs, **TOLERANCE):
            err = "None" if mine is None else f"{np.max(np.abs(mine - theirs)):.3g}"
            bad.append(f"{name}.{what}: max error {err}")
    return bad


def mean_loss(value: float | None, layout: Layout) -> float | None:
    """The last stage's loss averaged over the data-parallel replicas (None elsewhere)."""
    if value is None or layout.dp is None:
        return value
    return float(layout.dp.all_reduce(np.array([value]))[0]) / layout.dp.size


def check_training(layout: Layout, stage: Any, schedule: Any, optimizer: Any,
                   reduce: bool = True, grads: bool = True, steps: int = STEPS) -> None:
    """Train ``steps`` steps through ``schedule`` and check, on every rank together, the
    loss every step, every gradient of the first step (``grads``) and every parameter after
    each step against the serial reference; ``reduce``: average the gradients over the
    data-parallel group before the step (not for ZeRO, whose step does)."""
    replicas = 1 if layout.dp is None else layout.dp.size
    reference = serial_training(layout.tensor_parallel, replicas, steps)
    problems = []
    for step in range(steps):
        x, t = batch(step, replicas)
        stage.zero_grad()
        loss = mean_loss(schedule.run(rows(x, layout.dp), rows(t, layout.dp)), layout)
        if loss is not None and not np.isclose(loss, reference["losses"][step], **TOLERANCE):
            problems.append(f"step {step}: loss {loss!r} != {reference['losses'][step]!r}")
        if reduce:
            allreduce_gradients(stage, layout.dp)
        if grads and step == 0:
            problems += worst(stage, reference["grads"], "grad")
        optimizer.step()
        problems += [f"step {step}: {p}" for p in worst(stage, reference["params"][step], "data")]
        if problems:
            break
    agree(not problems, "; ".join(problems[:6]))


def stage_loss(pipeline: Any) -> Any:
    """A loss on the last stage, None elsewhere."""
    return MSELoss() if pipeline.rank == pipeline.size - 1 else None
