"""Checkpoints of ZeroRedundancyOptimizer: its shares written in place, read under any sharding.

A checkpoint saved with ZeRO(AdamW) on every rank (DP, and DP x TP=2) loads into a plain AdamW
on one rank with the serial layers, and one saved by that plain AdamW loads into ZeRO: the
next steps equal the uninterrupted run to 1e-12 (float64). The optimizer files equal the
gathered ZeRO state and the unsharded AdamW's moments.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from mpi4py import MPI

from layer_helpers import rng_array, self_group
from mpi_helpers import WORLD, agree, assert_close, raises_everywhere, to_numpy
from pympar import backend, checkpoint, manager
from pympar.group import Group
from pympar.modules import Module, Parameter
from pympar.optim import SGD, AdamW
from pympar.zero import ZeroRedundancyOptimizer
from test_zero import MLP, layout, train

SAVED, MORE = 4, 3  # steps before the checkpoint, steps after it



def files(path):
    """``{tensor name: full array}`` of a checkpoint, read as a serial program would."""
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    return {name: np.load(os.path.join(path, e["file"]), allow_pickle=False)
            for name, e in manifest["tensors"].items()}


def zero_of(model, optimizer_class=AdamW, **kw):
    return ZeroRedundancyOptimizer(model.params, optimizer_class, bucket_bytes=1024, **kw)


def assert_model_matches_serial(model, serial):
    for (name, p), (_, q) in zip(model.net.named_parameters(), serial.net.named_parameters()):
        assert_close(p.data, p.placement.take(q.data), rtol=1e-12, atol=1e-14, what=name)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("tp", [1, 2], ids=["dp", "tp2xdp"])
def test_zero_checkpoint_loads_into_plain_adamw_on_one_rank(tp, shared_dir):
    dp = layout(tp)
    try:
        model, opt, _ = train(True, dp, steps=SAVED)
        path = checkpoint.save(os.path.join(shared_dir, "zero"), model.net, opt, step=SAVED)
        gathered = opt.state_dict()  # collective: the reference for the files
        plain, plain_opt, _ = train(False, dp, steps=SAVED)
        _, _, expected = train(True, dp, steps=MORE, model=model, opt=opt, start=SAVED)
    finally:
        manager.destroy_parallel()
    saved = files(path)
    for i, (name, p) in enumerate(model.net.named_parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            full = saved[f"optimizer/{name}/{key}"]
            # Bitwise the gathered ZeRO state, and the unsharded AdamW's moments to rounding.
            agree(p.placement.take(full).tobytes() == gathered["state"][i][key].tobytes(),
                  f"optimizer/{name}/{key} differs from ZeRO's gathered state")
            assert_close(p.placement.take(full), getattr(plain_opt, key)[i], rtol=1e-12,
                         atol=1e-15, what=f"optimizer/{name}/{key} vs unsharded AdamW")
    # Every rank alone: the serial layers and a plain AdamW continue the ZeRO run.
    serial = MLP(serial=True, seeds=(7, 8))
    serial_opt = AdamW(serial.params, lr=0.5, weight_decay=0.3)
    step, _ = checkpoint.load(path, serial.net, serial_opt, comm=MPI.COMM_SELF)
    agree(step == SAVED and serial_opt.lr == 1e-2 and serial_opt.weight_decay == 0.01
          and serial_opt.steps == [SAVED] * 4,
          f"step {step}, lr {serial_opt.lr}, steps {serial_opt.steps}")
    _, _, got = train(False, self_group(), steps=MORE, model=serial, opt=serial_opt, start=SAVED)
    assert_close(got, expected, rtol=1e-12, atol=0, what="losses after the one-rank load")
    assert_model_matches_serial(model, serial)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("tp", [1, 2], ids=["dp", "tp2xdp"])
def test_zero_optimizer_files_equal_the_serial_adamw_bitwise(tp, shared_dir):
    """Gradients given on data-parallel rank 0 only: every sum is exact, so the shares' moments,
    hence the files, are bitwise those of a serial AdamW fed the same averaged gradients."""
    dp = layout(tp)
    serial = MLP(serial=True)
    serial_opt = AdamW(serial.params, lr=1e-2)
    try:
        model = MLP()
        opt = zero_of(model, lr=1e-2)
        for step in range(SAVED):
            for k, (p, q) in enumerate(zip(model.params, serial.params)):
                full = rng_array(50 * step + k, q.shape, np.float64)
                p.grad = p.placement.take(full) if dp.rank == 0 else np.zeros(p.shape)
                q.grad = full / dp.size
            opt.step()
            serial_opt.step()
        path = checkpoint.save(os.path.join(shared_dir, "zero"), model.net, opt, step=SAVED)
    finally:
        manager.destroy_parallel()
    saved = files(path)
    bad = [f"{name}/{key}" for i, (name, q) in enumerate(serial.net.named_parameters())
           for key in ("exp_avg", "exp_avg_sq")
           if saved[f"optimizer/{name}/{key}"].tobytes() != getattr(serial_opt, key)[i].tobytes()]
    bad += [name for name, q in serial.net.named_parameters()
            if saved[name].tobytes() != q.data.tobytes()]
    agree(not bad, f"files differ from the serial AdamW: {bad}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("tp", [1, 2], ids=["dp", "tp2xdp"])
def test_plain_adamw_checkpoint_on_one_rank_loads_into_zero(tp, shared_dir):
    serial, serial_opt, _ = train(False, self_group(), steps=SAVED, model=MLP(serial=True))
    path, error = os.path.join(shared_dir, "serial"), None
    if WORLD.rank == 0:
        try:
            checkpoint.save(path, serial.net, serial_opt, step=SAVED, comm=MPI.COMM_SELF)
        except Exception as err:  # noqa: BLE001 - reported on every rank below
            error = err
    agree(error is None, f"one-rank save failed: {error!r}")
    _, _, expected = train(False, self_group(), steps=MORE, model=serial, opt=serial_opt,
                           start=SAVED)
    dp = layout(tp)
    try:
        model = MLP(seeds=(7, 8))
        opt = zero_of(model, lr=0.5)
        step, _ = checkpoint.load(path, model.net, opt)
        _, _, got = train(True, dp, steps=MORE, model=model, opt=opt, start=SAVED)
    finally:
        manager.destroy_parallel()
    agree(step == SAVED and opt.lr == 1e-2, f"step {step}, lr {opt.lr}")
    assert_close(got, expected, rtol=1e-12, atol=0, what="losses after the ZeRO load")
    assert_model_matches_serial(model, serial)


@pytest.mark.mpi(min_size=1)
def test_mismatched_optimizer_state_is_refused_everywhere(shared_dir):
    dp = layout(1)
    try:
        model = MLP()
        sgd = zero_of(model, SGD, lr=0.1, momentum=0.9)
        _, _, _ = train(True, dp, steps=1, model=model, opt=sgd)
        path = checkpoint.save(os.path.join(shared_dir, "sgd"), model.net, sgd)
        before = [p.data.copy() for p in model.params]
        adam = AdamW(model.params)
        raises_everywhere(checkpoint.CheckpointError, "state of a 'SGD' optimizer, not of the "
                          "'AdamW' given", checkpoint.load, path, model.net, adam)
        path = checkpoint.save(os.path.join(shared_dir, "adam"), model.net, adam)
        raises_everywhere(checkpoint.CheckpointError, "state of a 'AdamW' optimizer, not of the "
                          "'SGD' given \\(ZeroRedundancyOptimizer\\)", checkpoint.load, path,
                          model.net, sgd)
        agree(all(np.array_equal(p.data, b) for p, b in zip(model.params, before))
              and sgd.optimizer.steps == [1] * 4, "a refused load changed something")
    finally:
        manager.destroy_parallel()


@pytest.mark.mpi(min_size=1)
def test_bfloat16_masters_are_saved_and_reload_under_another_sharding(shared_dir):
    """Half-precision parameters: the float32 masters travel as ``optimizer/<name>/master``."""
    if backend.bfloat16 is None:
        pytest.skip("ml_dtypes (bfloat16) is not installed")
    bf16 = backend.bfloat16
    world = Group(MPI.COMM_WORLD, "world", range(WORLD.size), owns_comm=False)
    model = Module()
    model.w = Parameter(rng_array(0, (7, 3), np.float32).astype(bf16))
    model.b = Parameter(rng_array(1, (5,), np.float32).astype(bf16))
    opt = ZeroRedundancyOptimizer(model, AdamW, group=world, lr=1e-2)
    for step in range(2):
        for i, p in enumerate(model.parameters()):
            p.grad = rng_array(10 * step + i + WORLD.rank, p.shape, np.float32).astype(bf16)
        opt.step()
    path = checkpoint.save(os.path.join(shared_dir, "bf16"), model, opt, comm=world)
    gathered = opt.state_dict()
    saved = files(path)
    agree(all(saved[f"optimizer/{n}/master"].tobytes()
              == to_numpy(gathered["state"][i]["master"]).tobytes()
              for i, n in enumerate(("w", "b"))), "master files differ from the gathered masters")
    # One rank alone, ZeRO over itself: the whole masters and moments come back.
    alone = Module()
    alone.w, alone.b = Parameter(np.zeros((7, 3), bf16)), Parameter(np.zeros(5, bf16))
    single = ZeroRedundancyOptimizer(alone, AdamW, group=self_group())
    checkpoint.load(path, alone, single, comm=MPI.COMM_SELF)
    got = single.state_dict()
    bad = [f"{n}/{key}" for i, n in enumerate(("w", "b"))
           for key in ("master", "exp_avg", "exp_avg_sq")
           if to_numpy(got["state"][i][key]).tobytes() != saved[f"optimizer/{n}/{key}"].tobytes()]
    agree(not bad and single.optimizer.steps == [2, 2], f"differ after reload: {bad}")
