"""Corrupted and untrusted checkpoints: one clear error on every rank, nothing changed.

Each case copies a good checkpoint, damages the copy on rank 0, and loads it on every rank:
``CheckpointError`` naming the tensor must come back on every rank within 10 s, and the
model and optimizer must be exactly as before.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import numpy as np
import pytest

from mpi_helpers import WORLD, agree, raises_everywhere
from pympar import checkpoint, manager
from pympar.modules import Module, Parameter
from pympar.optim import Adam
from pympar.partition import Placement, Split


def build():
    state = manager.get_parallel_state()
    model = Module()
    rng = np.random.default_rng(3)
    wfull, bfull = rng.standard_normal((6, 8)), rng.standard_normal(5)
    place = Placement(wfull.shape, (Split.over(state.data, 1),))
    model.weight = Parameter(place.take(wfull), placement=place)
    model.bias = Parameter(bfull)
    opt = Adam(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = np.ones(p.shape)
    opt.step()
    return model, opt


@pytest.fixture(scope="module")
def good():
    manager.initialize_parallel(1, 1)
    root = WORLD.bcast(tempfile.mkdtemp(prefix="pympar-ckpt-err-") if WORLD.rank == 0 else None)
    model, opt = build()
    checkpoint.save(os.path.join(root, "good"), model, opt, step=1)
    yield root
    WORLD.Barrier()
    manager.destroy_parallel()
    if WORLD.rank == 0:
        shutil.rmtree(root, ignore_errors=True)


def damaged(root, case, damage):
    """A copy of the good checkpoint, damaged by ``damage(path, manifest)`` on rank 0."""
    path = os.path.join(root, case)
    if WORLD.rank == 0:
        shutil.copytree(os.path.join(root, "good"), path)
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
        if damage(path, manifest) is not False:
            with open(os.path.join(path, "manifest.json"), "w") as f:
                json.dump(manifest, f)
    WORLD.Barrier()
    return path


def file_of(manifest, name):
    return manifest["tensors"][name]["file"]


def truncate(path, m):
    f = os.path.join(path, file_of(m, "weight"))
    os.truncate(f, os.path.getsize(f) - 8)
    return False


def flip(path, m):
    f = os.path.join(path, file_of(m, "optimizer/weight/exp_avg_sq"))
    with open(f, "r+b") as fh:
        fh.seek(-13, 2)
        byte = fh.read(1)
        fh.seek(-13, 2)
        fh.write(bytes([byte[0] ^ 0x10]))
    return False


def missing_file(path, m):
    os.remove(os.path.join(path, file_of(m, "bias")))
    return False


def wrong_shape(path, m):
    m["tensors"]["weight"]["shape"] = [8, 6]


def missing_entry(path, m):
    del m["tensors"]["optimizer/bias/exp_avg"]


def outside(path, m):
    m["tensors"]["bias"]["file"] = "../good/" + file_of(m, "bias")


def absolute(path, m):
    m["tensors"]["bias"]["file"] = os.path.join(path, file_of(m, "bias"))


def symlink(path, m):
    f = os.path.join(path, file_of(m, "bias"))
    os.replace(f, os.path.join(path, "elsewhere.bin"))
    os.symlink(os.path.join(path, "elsewhere.bin"), f)
    return False


def not_npy(path, m):
    os.rename(os.path.join(path, file_of(m, "bias")), os.path.join(path, "bias.txt"))
    m["tensors"]["bias"]["file"] = "bias.txt"


def object_dtype(path, m):
    m["tensors"]["bias"]["dtype"] = "object"


def structured_dtype(path, m):
    m["tensors"]["bias"]["dtype"] = "[('a', '<f8')]"


def header_disagrees(path, m):
    # Same byte count, other shape: the manifest (and the model) say (6, 8).
    f = os.path.join(path, file_of(m, "weight"))
    data = np.load(f)
    np.save(f, data.reshape(8, 6))
    return False


def future_version(path, m):
    m["version"] = 99


def no_manifest(path, m):
    os.remove(os.path.join(path, "manifest.json"))
    return False


CASES = [
    (truncate, "'weight': .* holds .* bytes, its header needs"),
    (flip, "'optimizer/weight/exp_avg_sq': checksum mismatch"),
    (missing_file, "'bias': file .* is missing"),
    (wrong_shape, "'weight': the checkpoint holds shape \\(8, 6\\).*fits no parameter"),
    (missing_entry, "'optimizer/bias/exp_avg' is missing from the checkpoint"),
    (outside, "'bias': file '../good/.*' is refused"),
    (absolute, "'bias': file '/.*' is refused"),
    (symlink, "'bias': file .* is not a regular file"),
    (not_npy, "'bias': file 'bias.txt' is refused"),
    (object_dtype, "'bias': dtype 'object' is refused"),
    (structured_dtype, "'bias': dtype .* is not a dtype name|'bias': dtype .* is refused"),
    (header_disagrees, "'weight': the header of .* disagrees with the manifest"),
    (future_version, "format version 99 is not supported"),
    (no_manifest, "is not a complete checkpoint"),
]


@pytest.mark.parametrize("damage, match", CASES, ids=[c[0].__name__ for c in CASES])
def test_damaged_checkpoint_is_refused_everywhere(good, damage, match):
    path = damaged(good, damage.__name__, damage)
    model, opt = build()
    before = [p.data.copy() for p in model.parameters()] + [m.copy() for m in opt.exp_avg_sq]
    model.weight.data += 1.0  # differs from the checkpoint: a partial load would show
    before[0] += 1.0
    start = time.monotonic()
    raises_everywhere(checkpoint.CheckpointError, match, checkpoint.load, path, model, opt)
    elapsed = time.monotonic() - start
    after = [p.data for p in model.parameters()] + list(opt.exp_avg_sq)
    agree(all(np.array_equal(a, b) for a, b in zip(after, before)) and opt.steps == [1, 1]
          and elapsed < 10, f"changed by a refused load, or slow ({elapsed:.1f} s)")
