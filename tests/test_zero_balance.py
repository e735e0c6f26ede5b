"""ZeRO shares balanced over the whole state: every rank within one row of 1/d.

Many small parameters used to land every remainder row on rank 0 (shapes 9, 7, 5, 3 x 8 on
8 ranks: rank 0 held 5 of the 24 rows, 21%). The shares now tile each parameter, every rank
holds within one row of the mean, and the updates stay those of the plain optimizers and of
a serial NumPy reference; a checkpoint of the new shares holds the serial arrays.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

from layer_helpers import rng_array, self_group
from mpi_helpers import WORLD, agree, assert_close
from pympar import checkpoint
from pympar.group import Group
from pympar.memory import optimizer_bytes
from pympar.modules import Module, Parameter
from pympar.optim import SGD, Adam, AdamW
from pympar.partition import Split
from pympar.zero import ZeroRedundancyOptimizer, share_rows
from test_zero_checkpoint import files

SMALL = [(9, 8), (7, 8), (5, 8), (3, 8)]
STEPS = 6


def world():
    return Group(MPI.COMM_WORLD, "world", range(WORLD.size), owns_comm=False)


def share_elements(shapes, parts):
    """Per rank, the elements of its shares under :func:`share_rows`."""
    sizes = share_rows(shapes, parts)
    return [sum(s[k] * int(np.prod(shape[1:])) for s, shape in zip(sizes, shapes))
            for k in range(parts)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5, 8, 16])
def test_share_rows_tile_and_stay_within_one_row_of_the_mean(parts):
    rng = np.random.default_rng(parts)
    cases = [SMALL, [(1, 3)] * 11, [(40, 1), (2, 100), (3, 7, 2)],
             [tuple(int(n) for n in rng.integers(1, 12, size=rng.integers(1, 4)))
              for _ in range(30)]]
    for shapes in cases:
        sizes = share_rows(shapes, parts)
        agree(all(len(s) == parts and sum(s) == shape[0] and min(s) >= 0
                  for s, shape in zip(sizes, shapes)), f"{shapes}: rows {sizes} do not tile")
        widest = max(int(np.prod(shape[1:])) for shape in shapes)
        mean = sum(int(np.prod(shape)) for shape in shapes) / parts
        held = share_elements(shapes, parts)
        agree(max(abs(h - mean) for h in held) <= widest,
              f"{shapes} on {parts}: elements {held}, mean {mean:.2f}, widest row {widest}")


@pytest.mark.mpi(min_size=1)
def test_small_parameters_give_every_rank_its_share():
    """[9, 7, 5, 3] x 8: 24 rows of 8, so on 8 ranks every rank holds 3 rows (24 elements)."""
    d, r = WORLD.size, WORLD.rank
    params = [Parameter(rng_array(i, s, np.float64)) for i, s in enumerate(SMALL)]
    opt = ZeroRedundancyOptimizer(params, AdamW, group=world(), lr=1e-2)
    mine = sum(s.data.size for s in opt.shares)
    every = WORLD.allgather(mine)
    total = sum(p.size for p in params)
    agree(sum(every) == total, f"shares hold {every}, {sum(every)} elements of {total}")
    agree(max(abs(n - total / d) for n in every) <= 8,
          f"shares {every}: not within one row (8) of {total / d:.2f}")
    if d == 8:
        agree(every == [24] * 8, f"on 8 ranks each rank must hold 24 elements, got {every}")
    # Adam's two float64 moments: 16 bytes per element of the share, not of rank 0's rows.
    agree(optimizer_bytes(opt) == 16 * mine, f"optimizer bytes {optimizer_bytes(opt)}")
    for i, (p, share) in enumerate(zip(params, opt.shares)):
        rows = share_rows(SMALL, d)[i]
        start = sum(rows[:r])
        agree(share.placement == p.placement.then(Split(0, d, r, sizes=rows))
              and share.placement.local_shape == share.shape
              and (rows[r] == 0 or np.shares_memory(share.data, p.data))
              and np.array_equal(share.data, p.data[start:start + rows[r]]),
              f"share {i} is not rows {start}..{start + rows[r]} of its parameter")


def reference_step(kind, p, g, state, t, lr=0.05):
    """One update written out in NumPy (torch's formulas), on the full serial arrays."""
    if kind == "SGD":  # momentum 0.9, weight decay 0.01
        g = g + 0.01 * p
        state["buf"] = g.copy() if t == 1 else 0.9 * state["buf"] + g
        return p - lr * state["buf"]
    b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.01
    if kind == "AdamW":
        p = p * (1.0 - lr * wd)
    else:
        g = g + wd * p
    state["m"] = b1 * state.get("m", 0.0) + (1 - b1) * g
    state["v"] = b2 * state.get("v", 0.0) + (1 - b2) * g * g
    return p - lr / (1 - b1**t) * state["m"] / (np.sqrt(state["v"]) / np.sqrt(1 - b2**t) + eps)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", ["SGD", "Adam", "AdamW"])
def test_balanced_shares_follow_the_plain_optimizer_and_numpy(kind):
    shapes = SMALL + [(5,), (2, 3, 4)]
    cls = {"SGD": SGD, "Adam": Adam, "AdamW": AdamW}[kind]
    kw = {"lr": 0.05, "weight_decay": 0.01, **({"momentum": 0.9} if kind == "SGD" else {})}
    init = [rng_array(i, s, np.float64) for i, s in enumerate(shapes)]
    params = [Parameter(a.copy(), name=f"p{i}") for i, a in enumerate(init)]
    opt = ZeroRedundancyOptimizer(params, cls, group=world(), bucket_bytes=512, **kw)
    agree(len(opt._buckets) > 1, f"one bucket only: {len(opt._buckets)}")
    plain = [Parameter(a.copy()) for a in init]
    plain_opt = cls(plain, **kw)
    numpy_params, states = [a.copy() for a in init], [{} for _ in init]
    for step in range(1, STEPS + 1):
        for i, (p, q) in enumerate(zip(params, plain)):
            grads = [rng_array(1000 * step + 10 * i + k, p.shape, np.float64)
                     for k in range(WORLD.size)]
            p.grad = grads[WORLD.rank].copy()
            q.grad = sum(grads) / WORLD.size
            numpy_params[i] = reference_step(kind, numpy_params[i], q.grad, states[i], step)
        opt.step()
        plain_opt.step()
    for i, (p, q, ref) in enumerate(zip(params, plain, numpy_params)):
        assert_close(p.data, q.data, rtol=1e-12, atol=1e-14, what=f"{kind} p{i} vs plain")
        assert_close(p.data, ref, rtol=1e-10, atol=1e-12, what=f"{kind} p{i} vs NumPy")


@pytest.mark.mpi(min_size=1)
def test_balanced_shares_checkpoint_as_the_serial_state(shared_dir):
    """The shares' files are the serial AdamW's arrays, so any layout reads them back."""
    model, serial = Module(), Module()
    for i, s in enumerate(SMALL):
        setattr(model, f"w{i}", Parameter(rng_array(i, s, np.float64)))
        setattr(serial, f"w{i}", Parameter(rng_array(i, s, np.float64)))
    opt = ZeroRedundancyOptimizer(model, AdamW, group=world(), lr=1e-2)
    ref = AdamW(serial, lr=1e-2)
    for step in range(2):
        for i, (p, q) in enumerate(zip(model.parameters(), serial.parameters())):
            q.grad = rng_array(100 * step + i, p.shape, np.float64)
            p.grad = q.grad.copy()
        opt.step()
        ref.step()
    path = checkpoint.save(os.path.join(shared_dir, "balanced"), model, opt, comm=world())
    saved = files(path)
    bad = [f"w{i}/{key}" for i in range(len(SMALL)) for key in ("exp_avg", "exp_avg_sq")
           if not np.allclose(saved[f"optimizer/w{i}/{key}"], getattr(ref, key)[i],
                              rtol=1e-12, atol=1e-15)]
    agree(not bad, f"files differ from the serial AdamW: {bad}")
    alone = Module()
    for i, s in enumerate(SMALL):
        setattr(alone, f"w{i}", Parameter(np.zeros(s)))
    single = ZeroRedundancyOptimizer(alone, AdamW, group=self_group())
    checkpoint.load(path, alone, single, comm=MPI.COMM_SELF)
    for i, (p, q) in enumerate(zip(alone.parameters(), serial.parameters())):
        assert_close(p.data, q.data, rtol=1e-12, atol=1e-14, what=f"w{i} reloaded")
        assert_close(single.optimizer.exp_avg[i], ref.exp_avg[i], rtol=1e-12, atol=1e-15,
                     what=f"w{i} exp_avg reloaded")
