"""pympar.checkpoint on hand-built placements over real MPI groups, against a serial model.

Every parameter below carries an explicit Placement made with ``Split.over`` of the groups of
``initialize_parallel`` (a fused column split nested with a data-parallel cut, a row split,
a 3D-like triple cut, replicated and serial layers). The files must equal the serial model's
arrays (and Adam moments) bitwise, and loading under another layout must give every rank its
block of the serial arrays.
"""

from __future__ import annotations

import json
import os
import tracemalloc

import numpy as np
import pytest
import xxhash
from mpi4py import MPI

from mpi_helpers import WORLD, agree, raises_everywhere
from pympar import checkpoint, manager
from pympar.backend import bfloat16
from pympar.checkpoint import api, exchange, files, saving
from pympar.group import Group
from pympar.modules import Linear, Module, Parameter
from pympar.optim import AdamW
from pympar.zero import ZeroRedundancyOptimizer
from pympar.partition import Placement, Split

SHAPES = {"col": (7, 10), "row": (9, 5), "cube": (6, 5, 4), "rep": (11,)}


def full_arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s) for k, s in SHAPES.items()}


def placements(state, variant):
    """Placements of the hand-built parameters; ``variant`` picks one of two layouts."""
    t, c, d = state.tensor, state.context, state.data
    if variant == "serial":
        return {k: Placement(s) for k, s in SHAPES.items()}
    if variant == "a":
        return {"col": Placement(SHAPES["col"], (Split.over(t, 1, stride=2), Split.over(d, 0))),
                "row": Placement(SHAPES["row"], (Split.over(c, 0),)),
                "cube": Placement(SHAPES["cube"], (Split.over(t, 0), Split.over(c, 1),
                                                   Split.over(d, 0))),
                "rep": Placement(SHAPES["rep"])}
    return {"col": Placement(SHAPES["col"], (Split.over(d, 0, stride=3),)),
            "row": Placement(SHAPES["row"], (Split.over(t, 1), Split.over(c, 1))),
            "cube": Placement(SHAPES["cube"], (Split.over(c, 2),)),
            "rep": Placement(SHAPES["rep"], (Split.over(t, 0),))}


class Model(Module):
    def __init__(self, fulls, places):
        super().__init__()
        for name in SHAPES:
            setattr(self, name, Parameter(places[name].take(fulls[name]), placement=places[name]))
        self.lin = Linear(3, 4, dtype=np.float64, seed=5)


def digests_ok(entry, data):
    """Whether the manifest entry's xxHash3-64 digests are those of ``data``'s chunks."""
    size = entry["chunk_bytes"]
    return entry["xxh3_64"] == [xxhash.xxh3_64_hexdigest(data[k:k + size])
                                for k in range(0, len(data), size)]


def layout():
    world = WORLD.size
    tp = 2 if world % 2 == 0 else 1
    cp = 2 if world % 4 == 0 else 1
    return manager.initialize_parallel(tp, cp)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 40 bytes and pieces of 64: every file has many chunks, and chunks and
    pieces begin and end inside the ranks' ranges (their tails are read back)."""
    monkeypatch.setattr(saving, "CHUNK_BYTES", 40)
    monkeypatch.setattr(files, "PIECE_BYTES", 64)


@pytest.fixture
def state():
    st = layout()
    yield st
    manager.destroy_parallel()



def adam_step(model, opt, places, seed):
    """One AdamW step with each rank's block of a seeded full gradient."""
    rng = np.random.default_rng(seed)
    for name, p in model.named_parameters():
        full = rng.standard_normal(p.placement.shape)
        p.grad = p.placement.take(full)
    opt.step()


def trained(state, variant, steps=2):
    places = placements(state, variant)
    model = Model(full_arrays(), places)
    opt = AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for s in range(steps):
        adam_step(model, opt, places, 100 + s)
    return model, opt


def full_of(model, opt, name, key=None):
    p = dict(model.named_parameters())[name]
    if key is None:
        return p.data
    return opt.state_dict()["state"][opt.params.index(p)][key]


def test_files_equal_the_serial_model_bitwise(state, shared_dir, monkeypatch):
    monkeypatch.setattr(saving, "_OPEN_FILES", 2)  # fsync and close early files while writing
    model, opt = trained(state, "a")
    serial, sopt = trained(state, "serial")
    path = checkpoint.save(os.path.join(shared_dir, "c"), model, opt, step=2, extra={"k": [1]})
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    bad = []
    for name, _ in serial.named_parameters():
        for key in (None, "exp_avg", "exp_avg_sq"):
            tname = name if key is None else f"optimizer/{name}/{key}"
            entry = manifest["tensors"][tname]
            got = np.load(os.path.join(path, entry["file"]), allow_pickle=False, mmap_mode="r")
            want = full_of(serial, sopt, name, key)
            if got.tobytes() != want.tobytes() or got.dtype != want.dtype:
                bad.append(tname)
            data = open(os.path.join(path, entry["file"]), "rb").read()[-want.nbytes:]
            if not digests_ok(entry, data):
                bad.append(f"{tname} checksum")
    ok = (manifest["step"] == 2 and manifest["extra"] == {"k": [1]} and manifest["version"] == 2
          and manifest["optimizer"]["steps"]["col"] == 2)
    agree(ok and not bad, f"differ: {bad}, manifest head {str(manifest)[:200]}")


@pytest.mark.parametrize("target", ["b", "serial", "a"])
def test_load_under_another_layout(state, shared_dir, target):
    model, opt = trained(state, "a")
    path = checkpoint.save(os.path.join(shared_dir, "c"), model, opt, step=7, extra=None)
    places = placements(state, target)
    fresh = Model({k: np.zeros(s) for k, s in SHAPES.items()}, places)
    fresh_opt = AdamW(fresh.parameters(), lr=1.0)
    step, extra = checkpoint.load(path, fresh, fresh_opt)
    serial, sopt = trained(state, "serial")
    bad = [name for name, p in fresh.named_parameters()
           for key in (None, "exp_avg", "exp_avg_sq")
           if full_of(fresh, fresh_opt, name, key).tobytes()
           != p.placement.take(full_of(serial, sopt, name, key)).tobytes()]
    ok = step == 7 and extra is None and fresh_opt.lr == 0.01 and fresh_opt.steps == sopt.steps
    # One more step on both: the restored optimizer continues the serial run exactly.
    adam_step(fresh, fresh_opt, places, 999)
    adam_step(serial, sopt, placements(state, "serial"), 999)
    bad += [f"after a step: {name}" for name, p in fresh.named_parameters()
            if p.data.tobytes() != p.placement.take(full_of(serial, sopt, name)).tobytes()]
    agree(ok and not bad, f"step {step}, extra {extra}, lr {fresh_opt.lr}, differ {bad}")


def test_replicas_split_the_bytes(state, shared_dir, monkeypatch):
    written = {}
    real = saving.write_box

    def counting(fd, offset, shape, box, src, dtype, buffer, tally):
        name = os.readlink(f"/proc/self/fd/{fd}")
        size = int(np.prod([s.stop - s.start for s in box])) * dtype.itemsize
        written[os.path.basename(name)] = written.get(os.path.basename(name), 0) + size
        return real(fd, offset, shape, box, src, dtype, buffer, tally)

    monkeypatch.setattr(saving, "write_box", counting)
    model = Model(full_arrays(), placements(state, "serial"))  # every tensor fully replicated
    path = checkpoint.save(os.path.join(shared_dir, "c"), model)
    files = json.load(open(os.path.join(path, "manifest.json")))["tensors"]
    mine = written.get(files["rep"]["file"], 0)
    per_rank = np.array(WORLD.allgather(mine))
    expected = 11 * 8 / WORLD.size
    agree(per_rank.sum() == 88 and per_rank.max() <= np.ceil(expected / 8) * 8,
          f"bytes of 'rep' written per rank: {per_rank}")


def test_extra_memory_is_bounded(state, shared_dir, monkeypatch):
    """Peak traced allocations of a save/load stay under one shard + the staging buffer."""
    monkeypatch.setattr(api, "BUFFER_BYTES", 64 * 1024)
    monkeypatch.setattr(saving, "CHUNK_BYTES", checkpoint.format.CHUNK_BYTES)  # as shipped
    monkeypatch.setattr(files, "PIECE_BYTES", 2**20)
    shape = (256, 64 * WORLD.size)
    place = Placement(shape, (Split(1, WORLD.size, WORLD.rank),))  # column blocks: strided
    big = Parameter(np.random.default_rng(WORLD.rank).standard_normal(place.local_shape),
                    placement=place)
    model = Module()
    model.big = big
    shard = big.data.nbytes
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        path = checkpoint.save(os.path.join(shared_dir, "c"), model)
        save_peak = tracemalloc.get_traced_memory()[1] - base
        before = big.data.copy()
        big.data[...] = 0
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        checkpoint.load(path, model)
        load_peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    limit = shard + 64 * 1024
    agree(save_peak < limit and load_peak < limit and np.array_equal(big.data, before),
          f"shard {shard} B, buffer 64 KiB: peak extra save {save_peak} B, load {load_peak} B")


def test_zero_state_is_saved_and_loaded_without_gathering(state, shared_dir, monkeypatch):
    """ZeRO's moments go straight from each rank's share to the files and back: the peak extra
    memory stays under one share + the staging buffer (a gathered moment would be d shares)."""
    monkeypatch.setattr(api, "BUFFER_BYTES", 64 * 1024)
    monkeypatch.setattr(saving, "CHUNK_BYTES", checkpoint.format.CHUNK_BYTES)  # as shipped
    monkeypatch.setattr(files, "PIECE_BYTES", 2**20)
    world = Group(MPI.COMM_WORLD, "world", range(WORLD.size), owns_comm=False)
    model = Module()
    model.big = Parameter(np.random.default_rng(0).standard_normal((512, 64)))
    opt = ZeroRedundancyOptimizer(model, AdamW, group=world)
    model.big.grad = np.random.default_rng(1).standard_normal((512, 64))
    opt.step()
    moments = [m.copy() for m in (opt.optimizer.exp_avg[0], opt.optimizer.exp_avg_sq[0])]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        path = checkpoint.save(os.path.join(shared_dir, "c"), model, opt)
        save_peak = tracemalloc.get_traced_memory()[1] - base
        opt.optimizer.exp_avg[0][...] = 0
        opt.optimizer.exp_avg_sq[0][...] = 0
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        checkpoint.load(path, model, opt)
        load_peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    limit = moments[0].nbytes + 64 * 1024
    restored = all(np.array_equal(a, b) for a, b in
                   zip(moments, (opt.optimizer.exp_avg[0], opt.optimizer.exp_avg_sq[0])))
    agree(save_peak < limit and load_peak < limit and restored,
          f"share {moments[0].nbytes} B, buffer 64 KiB: peak extra save {save_peak} B, load "
          f"{load_peak} B; moments restored: {restored}")


def test_latest_keep_and_no_overwrite(state, shared_dir):
    model, opt = trained(state, "a", steps=1)
    for step in (1, 2, 3, 4):
        checkpoint.save(os.path.join(shared_dir, f"s{step}"), model, opt, step=step, keep=2)
    if WORLD.rank == 0:  # a partial (uncommitted) directory and a stray one are never picked
        os.makedirs(os.path.join(shared_dir, ".s9.tmp-1-2"))
        os.makedirs(os.path.join(shared_dir, "s9"))
    WORLD.Barrier()
    names = sorted(n for n in os.listdir(shared_dir) if not n.startswith("."))
    agree(checkpoint.latest(shared_dir) == os.path.join(shared_dir, "s4")
          and names == ["s3", "s4", "s9"], f"latest {checkpoint.latest(shared_dir)}, {names}")
    raises_everywhere(checkpoint.CheckpointError, "exists; a checkpoint is never overwritten",
                      checkpoint.save, os.path.join(shared_dir, "s4"), model, opt)
    raises_everywhere(checkpoint.CheckpointError, "not a complete checkpoint",
                      checkpoint.load, os.path.join(shared_dir, "s9"), model, opt)
    agree(checkpoint.latest(os.path.join(shared_dir, "nothing-here")) is None, "empty dir")


def test_keep_never_deletes_the_checkpoint_it_saved(state, shared_dir):
    """A save with no step, or a lower one than those in the folder (a run started again),
    is among the ``keep`` that remain."""
    model, opt = trained(state, "a", steps=1)
    for name, step in (("s10", 10), ("s11", 11), ("final", None), ("again", 0)):
        checkpoint.save(os.path.join(shared_dir, name), model, opt, step=step, keep=2)
    names = sorted(n for n in os.listdir(shared_dir) if not n.startswith("."))
    agree(names == ["again", "s11"], f"left {names}")


def test_a_directory_named_beyond_ascii(state, shared_dir):
    """Rank 0 names the temporary directory for every rank in bytes, not characters."""
    model, opt = trained(state, "a", steps=1)
    path = os.path.join(shared_dir, "contrôle-é")
    checkpoint.save(path, model, opt, step=3)
    step, _ = checkpoint.load(path, model, opt)
    agree(step == 3 and checkpoint.latest(shared_dir) == path, f"step {step}")


def test_a_path_that_is_none_on_one_rank_raises_on_every_rank(state, shared_dir):
    """As when one rank's ``latest`` found nothing: every rank raises, none waits."""
    model, opt = trained(state, "a", steps=1)
    path = os.path.join(shared_dir, "c")
    mine = None if WORLD.rank == WORLD.size - 1 else path
    for call in (checkpoint.save, checkpoint.load):
        raises_everywhere(checkpoint.CheckpointError, "TypeError", call, mine, model, opt)


def test_ranks_that_disagree_or_do_not_tile_are_refused(state, shared_dir):
    model = Module()
    shape = (4 * WORLD.size,)
    # Every rank claims block 0: the blocks do not tile the full array.
    model.p = Parameter(np.zeros(4), placement=Placement(shape, (Split(0, WORLD.size, 0),)))
    if WORLD.size > 1:
        raises_everywhere(checkpoint.CheckpointError, "'p': the ranks' blocks do not tile",
                          checkpoint.save, os.path.join(shared_dir, "c"), model)
    model = Module()
    model.p = Parameter(np.zeros(3 + (WORLD.rank == 1)))
    if WORLD.size > 1:
        raises_everywhere(checkpoint.CheckpointError, "ranks disagree on the model's tensors",
                          checkpoint.save, os.path.join(shared_dir, "d"), model)
    agree(not os.path.exists(os.path.join(shared_dir, "c")), "a refused save left its target")


@pytest.mark.skipif(bfloat16 is None, reason="ml_dtypes (bfloat16) is not installed")
def test_bfloat16_is_stored_as_uint16(state, shared_dir):
    model = Module()
    values = np.linspace(-2, 2, 12).astype(bfloat16)
    place = Placement((12,), (Split.over(state.tensor, 0),))
    model.w = Parameter(place.take(values), placement=place)
    path = checkpoint.save(os.path.join(shared_dir, "c"), model)
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    raw = np.load(os.path.join(path, manifest["tensors"]["w"]["file"]), allow_pickle=False)
    model.w.data[...] = 0
    checkpoint.load(path, model)
    agree(manifest["tensors"]["w"]["dtype"] == "bfloat16" and raw.dtype == np.uint16
          and raw.tobytes() == values.view(np.uint16).tobytes()
          and model.w.data.tobytes() == place.take(values).tobytes(), "bfloat16 round trip")


def test_scalars_empty_and_integer_tensors(state, shared_dir):
    model = Module()
    model.s = Parameter(np.array(3.5))  # 0-d: one replica writes it
    model.e = Parameter(np.zeros((0, 4)))
    place = Placement((5, 3), (Split.over(state.data, 0),))  # uneven rows
    full = np.arange(15, dtype=np.int32).reshape(5, 3)
    model.i = Parameter(place.take(full), placement=place)
    path = checkpoint.save(os.path.join(shared_dir, "c"), model, step=0)
    files = json.load(open(os.path.join(path, "manifest.json")))["tensors"]
    on_disk = [np.load(os.path.join(path, files[k]["file"]), allow_pickle=False) for k in "sei"]
    model.s.data[...] = 0
    model.i.data[...] = 0
    step, _ = checkpoint.load(path, model)
    agree(step == 0 and on_disk[0] == 3.5 and on_disk[1].shape == (0, 4)
          and np.array_equal(on_disk[2], full) and float(model.s.data) == 3.5
          and np.array_equal(model.i.data, place.take(full)), f"{on_disk}, {model.s.data}")


def test_trailing_axis_blocks_are_traded_for_row_slabs(state, shared_dir, monkeypatch):
    """Blocks cut along a trailing axis (short runs in the file) go through the exchange in
    several rounds (a slab of a few rows here), including ranks with no rows to write, and
    the files and checksums equal the serial arrays'."""
    monkeypatch.setattr(api, "BUFFER_BYTES", 2 * 23 * 8)
    traded = []
    real = exchange.write_slabs

    def counting(comm, fd, offset, t, boxes, *rest):
        traded.append(t.name)
        return real(comm, fd, offset, t, boxes, *rest)

    monkeypatch.setattr(exchange, "write_slabs", counting)
    rng = np.random.default_rng(11)
    fulls = {"wide": rng.standard_normal((5, 23)), "tp": rng.standard_normal((13, 17)),
             "cube": rng.standard_normal((6, 5, 4)).astype(np.float32),
             "fused": rng.standard_normal((4, 12)), "grid": rng.standard_normal((10, 14)),
             "long": rng.standard_normal((2, 60))}
    places = {"wide": Placement((5, 23), (Split(1, WORLD.size, WORLD.rank),)),
              "tp": Placement((13, 17), (Split.over(state.tensor, 1),)),
              "cube": Placement((6, 5, 4), (Split.over(state.tensor, 2),
                                            Split.over(state.context, 1))),
              "fused": Placement((4, 12), (Split.over(state.tensor, 1, stride=3),)),
              # Row blocks too: at 4 ranks a block starts inside a 3-row round.
              "grid": Placement((10, 14), (Split.over(state.context, 0),
                                           Split.over(state.tensor, 1))),
              # One row is more than the buffer: written in place, never exchanged.
              "long": Placement((2, 60), (Split(1, WORLD.size, WORLD.rank),))}
    model = Module()
    for name, place in places.items():
        setattr(model, name, Parameter(place.take(fulls[name]), placement=place))
    path = checkpoint.save(os.path.join(shared_dir, "c"), model)
    files = json.load(open(os.path.join(path, "manifest.json")))["tensors"]
    bad = []
    for name, full in fulls.items():
        raw = open(os.path.join(path, files[name]["file"]), "rb").read()[-full.nbytes:]
        if raw != full.tobytes() or not digests_ok(files[name], raw):
            bad.append(name)
    # Which tensors are traded follows from the layout: a trailing-axis cut over > 1 rank.
    expected = {"wide"} if WORLD.size > 1 else set()
    expected |= {"tp", "cube", "grid"} if state.tensor.size > 1 else set()
    agree(not bad and set(traded) == expected, f"files differ: {bad}; traded {sorted(traded)}, "
          f"expected {sorted(expected)}")


def test_a_failed_write_during_the_exchange_fails_every_rank(state, shared_dir, monkeypatch):
    if WORLD.size == 1:
        pytest.skip("the exchange needs more than one rank")
    real = files.pwrite_all

    def full_disk(fd, data, offset):
        if WORLD.rank == WORLD.size - 1:
            raise OSError(28, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(files, "pwrite_all", full_disk)  # the exchange writes through it
    model = Module()
    place = Placement((8, 30), (Split(1, WORLD.size, WORLD.rank),))
    model.w = Parameter(place.take(np.ones((8, 30))), placement=place)
    target = os.path.join(shared_dir, "c")
    raises_everywhere(checkpoint.CheckpointError, "No space left on device", checkpoint.save,
                      target, model)
    agree(not os.path.exists(target), "a failed save left its target")
