"""checkpoint.save and load with arguments that differ on one rank raise on every rank,
naming them, before anything is written or read."""

import os
import time

import numpy as np
import pytest

from mpi_helpers import WORLD, agree, assert_close, raises_everywhere
from pympar import checkpoint, manager
from pympar.checkpoint import CheckpointError
from pympar.modules import ColumnParallelLinear, Linear

R = WORLD.rank


@pytest.fixture
def tp_world(clean_state):
    manager.initialize_parallel(WORLD.size)


def _quickly(pattern, func, *args, **kwargs):
    start = time.monotonic()
    raises_everywhere(CheckpointError, pattern, func, *args, **kwargs)
    agree(time.monotonic() - start < 10, "the refusal took more than 10 s to raise")


@pytest.mark.mpi(min_size=1)
def test_save_and_load_arguments_differ_on_one_rank(tp_world, shared_dir):
    rows = np.array_split(np.arange(6), WORLD.size)[R]
    ref = Linear(8, 6, dtype=np.float64, seed=1)
    layer = ColumnParallelLinear(8, 6, gather_output=False, dtype=np.float64, seed=1)
    a, b = os.path.join(shared_dir, "a"), os.path.join(shared_dir, "b")
    checkpoint.save(a, layer, step=1)  # the correct case: saved, then loaded back
    layer.weight.data[...] += 1.0
    checkpoint.save(b, layer, step=2)
    agree(checkpoint.load(a, layer) == (1, None), "step of a")
    assert_close(layer.weight.data, ref.weight.data[rows], what="weight loaded from a")
    last = R == WORLD.size - 1
    if WORLD.size > 1:
        c = os.path.join(shared_dir, "c")
        _quickly(r"checkpoint\.save: the ranks pass different arguments.*path=.*/c(x)?'",
                 checkpoint.save, c + "x" if last else c, layer, step=3)
        agree(not os.path.exists(c) and not os.path.exists(c + "x"), "a path was written")
        _quickly(r"checkpoint\.save: .*step=(3|4)", checkpoint.save, c, layer,
                 step=4 if last else 3)
        agree(not os.path.exists(c), "c was written")
        _quickly(r"checkpoint\.load: .*path=.*/(a|b)'", checkpoint.load, b if last else a,
                 layer)
    assert_close(layer.weight.data, ref.weight.data[rows], what="weight untouched")
    agree(checkpoint.load(b, layer) == (2, None), "step of b")
    assert_close(layer.weight.data, ref.weight.data[rows] + 1.0, what="weight loaded from b")
