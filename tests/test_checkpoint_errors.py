"""Corrupted and untrusted checkpoints: one clear error on every rank, nothing changed.

Each case copies a good checkpoint (one saved now, format 2, and the format-1 checkpoint
``tests/data/checkpoint_v1`` written by the code before format 2), damages the copy on rank
0, and loads it on every rank: ``CheckpointError`` naming the tensor must come back on every
rank within 10 s, and the model and optimizer must be exactly as before (a flipped byte is
found while the data are read: then only the optimizer's steps and hyperparameters must be).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from mpi_helpers import WORLD, agree, raises_everywhere
from pympar import checkpoint, manager
from pympar.modules import Module, Parameter
from pympar.optim import Adam
from pympar.partition import Placement, Split

#: Written by pympar's format-1 code (commit a7a8f63) from ``build()``'s arrays on one rank.
FORMAT_1 = Path(__file__).resolve().parent / "data" / "checkpoint_v1"


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
    checkpoint.save(os.path.join(root, "v2"), model, opt, step=1)
    if WORLD.rank == 0:
        shutil.copytree(FORMAT_1, os.path.join(root, "v1"))
    WORLD.Barrier()
    yield root
    WORLD.Barrier()
    manager.destroy_parallel()
    if WORLD.rank == 0:
        shutil.rmtree(root, ignore_errors=True)


def damaged(root, version, case, damage):
    """A copy of the good checkpoint, damaged by ``damage(path, manifest)`` on rank 0."""
    path = os.path.join(root, f"{version}-{case}")
    if WORLD.rank == 0:
        shutil.copytree(os.path.join(root, version), path)
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
    m["tensors"]["bias"]["file"] = "../v2/" + file_of(m, "bias")


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


def digest_missing(path, m):
    entry = m["tensors"]["bias"]
    if "xxh3_64" in entry:
        entry["xxh3_64"] = []
    else:
        entry["checksum"] = "adler32:12"


def digest_not_hex(path, m):
    entry = m["tensors"]["bias"]
    if "xxh3_64" in entry:
        entry["xxh3_64"] = ["0x" + entry["xxh3_64"][0][2:]]
    else:
        entry["checksum"] = "adler32:0x123456"


#: Damages found only once the data are read (the arrays then hold them).
FOUND_WHILE_READING = {"flip"}

CASES = [
    (truncate, "'weight': .* holds .* bytes, its header needs"),
    (flip, "'optimizer/weight/exp_avg_sq': checksum mismatch"),
    (missing_file, "'bias': file .* is missing"),
    (wrong_shape, "'weight': the checkpoint holds shape \\(8, 6\\).*fits no parameter"),
    (missing_entry, "'optimizer/bias/exp_avg' is missing from the checkpoint"),
    (outside, "'bias': file '../v2/.*' is refused"),
    (absolute, "'bias': file '/.*' is refused"),
    (symlink, "'bias': file .* is not a regular file"),
    (not_npy, "'bias': file 'bias.txt' is refused"),
    (object_dtype, "'bias': dtype 'object' is refused"),
    (structured_dtype, "'bias': dtype .* is not a dtype name|'bias': dtype .* is refused"),
    (header_disagrees, "'weight': the header of .* disagrees with the manifest"),
    (future_version, "format version 99 is not supported"),
    (no_manifest, "is not a complete checkpoint"),
    (digest_missing, "'bias': 'xxh3_64' must be a list of 1 16-digit|'bias': checksum .* is not "
                     "adler32"),
    (digest_not_hex, "'bias': 'xxh3_64' holds a value that is not|'bias': checksum .* is not "
                     "adler32"),
]


@pytest.mark.parametrize("version", ["v2", "v1"])
@pytest.mark.parametrize("damage, match", CASES, ids=[c[0].__name__ for c in CASES])
def test_damaged_checkpoint_is_refused_everywhere(good, version, damage, match):
    path = damaged(good, version, damage.__name__, damage)
    model, opt = build()
    opt.step()  # steps 2, lr 0.5: the checkpoint's are 1 and 0.1
    opt.lr = 0.5
    before = [p.data.copy() for p in model.parameters()] + [m.copy() for m in opt.exp_avg_sq]
    model.weight.data += 1.0  # differs from the checkpoint: a partial load would show
    before[0] += 1.0
    start = time.monotonic()
    raises_everywhere(checkpoint.CheckpointError, match, checkpoint.load, path, model, opt)
    elapsed = time.monotonic() - start
    after = [p.data for p in model.parameters()] + list(opt.exp_avg_sq)
    unchanged = (damage.__name__ in FOUND_WHILE_READING
                 or all(np.array_equal(a, b) for a, b in zip(after, before)))
    agree(unchanged and opt.steps == [2, 2] and opt.lr == 0.5 and elapsed < 10,
          f"changed by a refused load, or slow ({elapsed:.1f} s)")


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_good_checkpoint_loads_under_this_layout(good, version):
    """Both formats load into the split layout of ``build()`` (the data-parallel group cuts
    the weight's columns) and give every rank its block of the saved arrays."""
    model, opt = build()
    for p in model.parameters():
        p.data[...] = 0
    step, extra = checkpoint.load(os.path.join(good, version), model, opt)
    files = json.load(open(os.path.join(good, version, "manifest.json")))["tensors"]
    saved = {n: np.load(os.path.join(good, version, e["file"]), allow_pickle=False)
             for n, e in files.items()}
    ok = step == 1 and all(np.array_equal(p.data, p.placement.take(saved[name]))
                           for name, p in model.named_parameters())
    ok = ok and np.array_equal(opt.exp_avg_sq[0],
                               model.weight.placement.take(saved["optimizer/weight/exp_avg_sq"]))
    agree(ok and opt.steps == [1, 1] and opt.lr == 0.1, f"{version}: step {step}, {extra}")
