"""Checkpoints of a model cut into pipeline stages: the serial checkpoint whatever the cut,
and a run saved under one cut resumes under others (fewer stages, down to one, with data
parallelism and ZeRO) and continues as the serial run does (float64, 1e-10)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from mpi4py import MPI

from layer_helpers import self_group
from mpi_helpers import WORLD, agree, raises_everywhere
from pipeline_helpers import TOLERANCE, layers, stage_loss
from pympar.checkpoint import CheckpointError, load, save
from pympar.mesh import Mesh
from pympar.modules import Linear, MSELoss, Sequential
from pympar.optim import AdamW, allreduce_gradients
from pympar.pipeline import GPipe, OneFOneB, split_stages
from pympar.zero import ZeroRedundancyOptimizer

P = WORLD.Get_size()
BATCH = 24  # rows of the whole batch: every data-parallel split of it is even
SAVED_AT, STEPS = 2, 4

#: (sizes, order, ZeRO over dp) saved under, then loaded under, by world size.
SAVE = {2: ({"pp": 2}, "pp", False), 4: ({"pp": 4}, "pp", False),
        8: ({"pp": 4, "dp": 2}, "dp-pp", True)}
LOADS = {2: [({"pp": 1, "dp": 2}, "pp-dp", True), ({"pp": 2}, "pp", False)],
         4: [({"pp": 2, "dp": 2}, "pp-dp", True), ({"pp": 1, "dp": 4}, "dp-pp", False)],
         8: [({"pp": 2, "dp": 4}, "dp-pp", False), ({"pp": 1, "dp": 8}, "pp-dp", True)]}

pytestmark = pytest.mark.skipif(P not in SAVE, reason=f"the cuts are laid out for 2, 4 and 8 "
                                                      f"ranks, not {P}")


def whole_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(500 + step)
    x = rng.standard_normal((BATCH, 5))
    return x, np.sin(x[:, :3]) + 0.1 * rng.standard_normal((BATCH, 3))


def serial() -> tuple[list[float], dict, dict]:
    """The serial run: its losses, and its parameters after SAVED_AT and STEPS steps."""
    model = Sequential(*layers(self_group(), False))
    optimizer, loss, losses, params = AdamW(model, lr=1e-2), MSELoss(), [], {}
    for step in range(STEPS):
        x, t = whole_batch(step)
        model.zero_grad()
        losses.append(loss.forward(model.forward(x), t))
        model.backward(loss.backward(1.0))
        optimizer.step()
        params[step + 1] = {n: p.data.copy() for n, p in model.named_parameters()}
    return losses, params[SAVED_AT], params[STEPS]


class Cut:
    """A layout: its stage of the chain, a schedule and an optimizer (ZeRO over dp)."""

    def __init__(self, sizes: dict, order: str, zero: bool) -> None:
        mesh = Mesh(WORLD, sizes, order=order)
        self.pp = mesh.group("pp")
        self.dp = mesh.group("dp") if "dp" in sizes else None
        self.stage = split_stages(layers(self_group(), False), self.pp)
        schedule = OneFOneB if self.pp.size % 2 == 0 else GPipe
        self.run = schedule(self.stage, self.pp, 3, stage_loss(self.pp))
        self.zero = zero
        self.optimizer = (ZeroRedundancyOptimizer(self.stage, AdamW, group=self.dp, lr=1e-2)
                          if zero else AdamW(self.stage, lr=1e-2))

    def train(self, steps: range) -> list[float | None]:
        """Train ``steps``; the losses (the replicas' mean) on the last stage."""
        d, r = (1, 0) if self.dp is None else (self.dp.size, self.dp.rank)
        losses = []
        for step in steps:
            x, t = (a[r * BATCH // d:(r + 1) * BATCH // d] for a in whole_batch(step))
            self.stage.zero_grad()
            value = self.run.run(x, t)
            if value is not None and self.dp is not None:
                value = float(self.dp.all_reduce(np.array([value]))[0]) / d
            losses.append(value)
            if not self.zero:
                allreduce_gradients(self.stage, self.dp)
            self.optimizer.step()
        return losses

    def free(self) -> None:
        for group in (self.pp, self.dp):
            if group is not None:
                group.free()


def differences(losses: list, expected: list, stage, params: dict) -> list[str]:
    """Losses (where known) and this stage's parameters that differ from the serial run's."""
    bad = [f"loss {a!r} != {b!r}" for a, b in zip(losses, expected)
           if a is not None and not np.isclose(a, b, **TOLERANCE)]
    return bad + [name for name, p in stage.named_parameters()
                  if not np.allclose(p.data, params[name], **TOLERANCE)]


def test_a_run_resumes_under_other_cuts_as_the_serial_run_goes_on(shared_dir):
    losses, at_save, at_end = serial()
    path = os.path.join(shared_dir, "saved")
    cut = Cut(*SAVE[P])
    try:
        trained = cut.train(range(SAVED_AT))
        agree(not differences(trained, losses, cut.stage, at_save), "before the save")
        save(path, cut.stage, cut.optimizer, step=SAVED_AT)
    finally:
        cut.free()
    for sizes, order, zero in LOADS[P]:
        cut = Cut(sizes, order, zero)
        try:
            step, _ = load(path, cut.stage, cut.optimizer)
            resumed = cut.train(range(step, STEPS))
            bad = differences(resumed, losses[SAVED_AT:], cut.stage, at_end)
            agree(step == SAVED_AT and not bad, f"resumed under {sizes}: {bad[:4]}")
        finally:
            cut.free()


def test_the_checkpoint_is_the_serial_models(shared_dir):
    """The tensors, their order and their values are those a serial run saves."""
    losses, at_save, _ = serial()
    cut = Cut(*SAVE[P])
    try:
        cut.train(range(SAVED_AT))
        save(os.path.join(shared_dir, "cut"), cut.stage, cut.optimizer, step=SAVED_AT)
    finally:
        cut.free()
    problems = []
    if WORLD.rank == 0:
        model = Sequential(*layers(self_group(), False))
        optimizer = AdamW(model, lr=1e-2)
        for step in range(SAVED_AT):  # the serial run again, saved by this rank alone
            x, t = whole_batch(step)
            model.zero_grad()
            loss = MSELoss()
            loss.forward(model.forward(x), t)
            model.backward(loss.backward(1.0))
            optimizer.step()
        save(os.path.join(shared_dir, "serial"), model, optimizer, step=SAVED_AT,
             comm=MPI.COMM_SELF)
        manifests = {}
        for name in ("cut", "serial"):
            with open(os.path.join(shared_dir, name, "manifest.json")) as f:
                manifests[name] = json.load(f)
        cut_entries, serial_entries = (manifests[n]["tensors"] for n in ("cut", "serial"))
        if list(cut_entries) != list(serial_entries):
            problems.append(f"tensors {list(cut_entries)} != {list(serial_entries)}")
        for name, entry in serial_entries.items():
            mine = np.load(os.path.join(shared_dir, "cut", cut_entries[name]["file"]))
            theirs = np.load(os.path.join(shared_dir, "serial", entry["file"]))
            if entry["file"] != cut_entries[name]["file"] or \
                    not np.allclose(mine, theirs, **TOLERANCE):
                problems.append(f"{name} differs")
        if manifests["cut"]["optimizer"] != manifests["serial"]["optimizer"]:
            problems.append("optimizer steps or hyperparameters differ")
    agree(not problems, "; ".join(problems[:6]))


def test_parts_that_disagree_raise_everywhere(shared_dir):
    """Replicas of a stage whose parameters have other shapes under the same names, and a
    rank holding a whole model that lacks the other stages' parameters: CheckpointError on
    every rank, before anything is written."""
    mesh = Mesh(WORLD, {"pp": P // 2, "dp": 2}, order="pp-dp")
    pp = mesh.group("pp")
    try:
        wider = mesh.coords["dp"]  # the second replica's layers are wider
        stage = split_stages([Linear(4, 4 + wider, dtype=np.float64) for _ in range(P)], pp)
        raises_everywhere(CheckpointError, r"is .* on rank 0 but .* on rank \d+: the ranks "
                          "disagree", save, os.path.join(shared_dir, "a"), stage)
    finally:
        pp.free()
    pp = Mesh(WORLD, {"pp": P}).group("pp")
    try:
        stage = split_stages([Linear(4, 4, dtype=np.float64) for _ in range(P)], pp)
        whole = Sequential(Linear(4, 4, dtype=np.float64))
        raises_everywhere(CheckpointError, "rank 0 holds a whole model without",
                          save, os.path.join(shared_dir, "b"), stage if pp.rank else whole)
    finally:
        pp.free()
    agree(not any(os.path.exists(os.path.join(shared_dir, n)) for n in "ab"), "written")
