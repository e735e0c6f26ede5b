"""examples/fno.py at small size: DP x spatial layouts follow the serial run; resume."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from mpi4py import MPI

from checkpoint_helpers import differing_tensors
from mpi_helpers import WORLD, agree
from test_examples import load

TINY = ["--steps", "4", "--batch", "4", "--grid", "12", "--width", "6", "--modes", "3",
        "--layers", "2", "--samples", "8", "--solver-steps", "10", "--dtype", "float64",
        "--quiet"]


def layouts(world: int) -> list[list[str]]:
    """Spatial only, and DP x spatial where the world allows it."""
    out = [["--spatial", str(world)]]
    if world % 2 == 0 and world > 2:
        out.append(["--spatial", "2"])
    return out


def run(fno, flags, comm=WORLD):
    return fno.train(fno.parse_args(TINY + flags), comm)


@pytest.mark.mpi(min_size=1)
def test_fno_layouts_follow_the_serial_run():
    fno = load("fno")
    serial = run(fno, [], MPI.COMM_SELF)
    agree(np.isfinite(serial["losses"]).all() and serial["losses"][-1] < serial["losses"][0],
          f"the serial run does not learn: {serial['losses']}")
    for layout in layouts(WORLD.size):
        metrics = run(fno, layout)
        agree(np.allclose(metrics["losses"], serial["losses"], rtol=1e-8, atol=0)
              and np.isclose(metrics["val_rel_l2"], serial["val_rel_l2"], rtol=1e-8),
              f"{layout}: losses {metrics['losses']} vs serial {serial['losses']}")


@pytest.mark.mpi(min_size=1)
def test_fno_resume_same_layout_is_bitwise_and_other_layouts_follow(shared_dir):
    fno = load("fno")
    flags = ["--spatial", str(2 if WORLD.size % 2 == 0 else 1), "--steps", "6",
             "--checkpoint-every", "3"]
    straight = run(fno, flags + ["--checkpoint-dir", os.path.join(shared_dir, "a")])
    if WORLD.rank == 0:  # stop after step 3: resume from there
        for name in "bc":
            shutil.copytree(os.path.join(shared_dir, "a", "step_00000003"),
                            os.path.join(shared_dir, name, "step_00000003"))
    WORLD.Barrier()
    resumed = run(fno, flags + ["--checkpoint-dir", os.path.join(shared_dir, "b"), "--resume"])
    a, b = (os.path.join(shared_dir, x, "step_00000006") for x in "ab")
    differ = differing_tensors(a, b)
    agree(resumed["losses"] == straight["losses"] and not differ
          and resumed["val_rel_l2"] == straight["val_rel_l2"],
          f"losses {resumed['losses']} vs {straight['losses']}; differ {differ}")
    # the checkpoint holds the serial weights: another layout resumes from it
    other = ["--spatial", str(WORLD.size), "--steps", "6", "--checkpoint-every", "3"]
    moved = run(fno, other + ["--checkpoint-dir", os.path.join(shared_dir, "c"), "--resume"])
    agree(np.allclose(moved["losses"], straight["losses"], rtol=1e-8, atol=0),
          f"resumed on --spatial {WORLD.size}: {moved['losses']} vs {straight['losses']}")


def test_fno_flags_that_do_not_fit(capsys):
    fno = load("fno")
    for flags, said in ((["--spatial", "3"], "does not divide"),
                        (["--modes", "7"], "at least 14"),
                        (["--resume"], "need --checkpoint-dir")):
        with pytest.raises(ValueError, match=said):
            fno.check_layout(fno.parse_args(TINY + flags), 2)
