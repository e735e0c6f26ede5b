"""Errors that are right and easy to use: one line, said once, naming what differs between
which ranks and what must hold, with the valid choices where there are some."""

from __future__ import annotations

import os
import re
import sys
import textwrap

import numpy as np
import pytest
from mpi4py import MPI

from jobs import run_job
from mpi_helpers import WORLD, agree, raises_everywhere
from pympar import Mesh, checkpoint, debug, manager
from pympar.checkpoint import CheckpointError
from pympar.debug import CollectiveMismatchError
from pympar.modules import ColumnParallelLinear, Linear, Sequential
from pympar.optim import AdamW

P = WORLD.size


# --------------------------------------------------------------------------- 31 vs 32 rows


@pytest.mark.mpi(min_size=2)
def test_a_tp_partner_passing_31_rows_gets_one_line_naming_both_ranks(clean_state):
    manager.initialize_parallel(P)
    layer = ColumnParallelLinear(16, 32)
    x = np.ones((31 if WORLD.rank == 1 else 32, 16), np.float32)
    for enabled in (False, True):
        with debug.debug_mode(enabled, timeout=30.0):
            err = raises_everywhere(CollectiveMismatchError, "ColumnParallelLinear", layer.forward,
                                    x)
        text = str(err)
        others = "rank 0 (global 0)" if P == 2 else f"ranks 0, 2{'-' if P > 3 else ''}"
        agree("\n" not in text and len(text) < 600
              and text.count("ColumnParallelLinear") == 1  # the layer named once
              and re.search(r"ColumnParallelLinear\(16->32, .*\)\.forward: ", text) is not None
              and f"{others}" in text and "input (32, 16) float32" in text
              and "rank 1 (global 1): input (31, 16) float32" in text
              and text.count("(32, 16)") == 1 and text.count("(31, 16)") == 1
              and "every rank must pass an input of the same shape and dtype" in text
              and ("at mpi_helpers.py:" in text) == enabled, text)  # where it was called
        # The same message on every rank: printed once, it says everything.
        texts = WORLD.allgather(text)
        agree(len(set(texts)) == 1, f"the ranks' messages differ: {texts}")


@pytest.mark.mpi(min_size=2)
def test_a_sequence_split_input_names_the_axes_that_may_differ(clean_state):
    manager.initialize_parallel(P)
    layer = ColumnParallelLinear(16, 8, use_sequence_parallel=True, dtype=np.float64)
    x = np.ones((2 + WORLD.rank, 3 + (WORLD.rank == 1), 16))
    err = raises_everywhere(CollectiveMismatchError, r"except along axis 0 \(split over the group\)",
                            layer.forward, x)
    agree("rank 1 (global 1): input (3, 4, 16) float64" in str(err), str(err))


THIRTY_ONE_ROWS = """
import numpy as np
from mpi4py import MPI
import pympar
from pympar.modules import ColumnParallelLinear

pympar.initialize_parallel(2)
layer = ColumnParallelLinear(16, 32)
layer(np.ones((31 if MPI.COMM_WORLD.rank == 1 else 32, 16), np.float32))
print("rank", MPI.COMM_WORLD.rank, "went on", flush=True)
"""

single_process = pytest.mark.skipif(P != 1, reason="launches its own 2-rank jobs; runs in the "
                                    "pass without a launcher")


@single_process
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mpi4py_main", [False, True], ids=["python", "python -m mpi4py"])
def test_the_31_rows_job_prints_at_most_five_lines_and_fails(tmp_path, mpi4py_main):
    """Passes once the excepthook that prints an error raised alike once is in (issue 23)."""
    script = tmp_path / "rows.py"
    script.write_text(textwrap.dedent(THIRTY_ONE_ROWS))
    job = run_job(tmp_path, 2, [sys.executable, *(["-m", "mpi4py"] if mpi4py_main else []),
                                str(script)])
    # What the ranks printed: a launcher's own report of the failed job (Open MPI's framed
    # block, srun's lines) is the launcher's, and kept apart (tests/jobs.py).
    assert job.status != 0, str(job)
    assert "went on" not in job.printed, str(job)
    assert len(job.lines) <= 5, f"{len(job.lines)} lines:\n{job}"
    assert "rank 1 (global 1): input (31, 16) float32" in job.printed, str(job)
    assert sum("ColumnParallelLinear(16->32" in line for line in job.lines) == 1, str(job)


# --------------------------------------------------------------------------- layouts


@pytest.mark.mpi(min_size=1)
def test_a_layout_that_does_not_fit_names_the_rank_counts_that_do(clean_state):
    assert manager.rank_counts_that_fit(2, 3) == (
        "run it on a multiple of 2 ranks (mpiexec -n 2 or -n 4), or use sizes whose product "
        "divides 3 (1 or 3)")
    assert manager.rank_counts_that_fit(4, 2) == (
        "run it on a multiple of 4 ranks (mpiexec -n 4), or use sizes whose product divides 2 "
        "(1 or 2)")
    assert "(1, 2, 3 or 6)" in manager.rank_counts_that_fit(4, 6)
    assert "divides 1 (1)" in manager.rank_counts_that_fit(2, 1)
    tp = P + 1
    below = P // tp * tp
    counts = " or ".join(f"-n {n}" for n in (below, below + tp) if n)
    err = raises_everywhere(ValueError, rf"world size {P} is not divisible by "
                            rf"tensor_parallel_size {tp}.*mpiexec {counts}\)",
                            manager.initialize_parallel, tp)
    agree("\n" not in str(err), str(err))


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.mpi(min_size=1)
def test_loading_into_an_optimizer_over_other_parameters_names_them(clean_state, shared_dir):
    model = Sequential(Linear(4, 3, dtype=np.float64, seed=1),
                       Linear(3, 2, dtype=np.float64, seed=2))
    opt = AdamW(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = np.ones_like(p.data)
    opt.step()
    path = checkpoint.save(os.path.join(shared_dir, "ckpt"), model, opt, step=1)
    fewer = AdamW(model[0].parameters(), lr=0.1)
    err = raises_everywhere(CheckpointError, r"\[\] not in the checkpoint's optimizer state, "
                            r"\['1\.bias', '1\.weight'\] saved but not in the optimizer given",
                            checkpoint.load, path, model, fewer)
    agree("\n" not in str(err), str(err))


# --------------------------------------------------------------------------- communicators


@pytest.mark.mpi(min_size=1)
def test_running_out_of_communicators_says_so_and_how_to_recover():
    mesh = Mesh(WORLD, {"x": P})
    # Use up this process's communicators cheaply (COMM_SELF duplicates are local), as a
    # job that creates groups without freeing them does after ~2,000 (MPICH).
    held = []
    try:
        while len(held) < 100_000:
            held.append(MPI.COMM_SELF.Dup())
    except MPI.Exception:
        pass
    try:
        assert len(held) < 100_000, "MPI never ran out of communicators"
        with pytest.raises(RuntimeError, match=r"Mesh.group\('x'\): MPI could not create a "
                           r"communicator .*run out of them.*Group\.free.*destroy_parallel"):
            mesh.group("x")
    finally:
        for comm in held:
            comm.Free()
    group = mesh.group("x")  # freed, they are there again
    agree(group.size == P)
    group.free()
