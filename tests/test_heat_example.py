"""examples/heat.py: each rank's block of the field equals the serial NumPy run's, both
methods, on every rank count (in-process on the suite's ranks; as a program on 1-4 ranks).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import WORLD, agree
from test_docs import _without_launcher_environment
from test_examples import EXAMPLES, load

ROOT = EXAMPLES.parent
SMALL = ["--grid", "23", "17", "--steps", "30"]
METHODS = ("explicit", "spectral")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("method", METHODS)
def test_every_rank_holds_its_block_of_the_serial_field(method):
    heat = load("heat")
    args = heat.parse_args(SMALL + ["--method", method])
    result = heat.run(args, WORLD)
    serial = {"explicit": heat.serial_explicit, "spectral": heat.serial_spectral}[method]
    expected = serial(args)[result["where"]]
    difference = float(np.abs(result["block"] - expected).max()) if expected.size else 0.0
    moved = float(np.abs(expected - heat.initial_field(*result["where"], (23, 17))).max()) \
        if expected.size else 1.0
    # The field has changed (the check is not of the initial field), and each block is the
    # serial run's to rounding; rank 0's gathered verdict agrees.
    agree(result["block"].shape == expected.shape and difference <= 1e-12 and moved > 1e-3,
          f"{method} on {WORLD.size} ranks: block {result['block'].shape} at "
          f"{result['where']}, difference {difference:.3g}, change {moved:.3g}")
    agree(WORLD.rank != 0 or result["error"] <= 1e-12, f"rank 0's error {result.get('error')}")


@pytest.mark.mpi(min_size=1)
def test_a_result_off_the_serial_run_exits_1(monkeypatch, tmp_path, capsys):
    heat = load("heat")
    off = heat.serial_explicit

    def shifted(args):  # what a wrong halo (or a wrong block) would give
        return off(args) + 1e-6
    monkeypatch.setattr(heat, "serial_explicit", shifted)
    out = Path(WORLD.bcast(str(tmp_path)))
    status = heat.main(SMALL + ["--out", str(out)])
    printed = capsys.readouterr().out
    agree(status == 1 and (WORLD.rank != 0 or "TOO LARGE" in printed),
          f"status {status}: {printed!r}")


@pytest.mark.mpi(min_size=1)
def test_flags_that_do_not_fit_are_said_once(capsys):
    heat = load("heat")
    with pytest.raises(SystemExit) as stop:
        heat.main(SMALL + ["--dt", "1"])
    err = capsys.readouterr().err
    said = err.count("above the explicit scheme's stability limit")
    agree(stop.value.code == 2 and said == (1 if WORLD.rank == 0 else 0), err)
    if WORLD.size > 1:  # one row over several blocks: a halo wider than a block
        status = heat.main(["--grid", "1", "40", "--steps", "1"])
        err = capsys.readouterr().err
        agree(status == 2 and err.count("wider than block") == (WORLD.rank == 0), err)
        # the spectral scheme's slabs: fewer rows than ranks
        status = heat.main(["--method", "spectral", "--grid", "1", "40", "--steps", "1"])
        err = capsys.readouterr().err
        agree(status == 2 and err.count("need at least as many") == (WORLD.rank == 0), err)


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1,
                    reason="starts its own jobs of 1-4 ranks: runs in the pass without a "
                           "launcher")
@pytest.mark.parametrize("ranks,method", [(1, "explicit"), (2, "explicit"), (3, "explicit"),
                                          (4, "explicit"), (2, "spectral"), (3, "spectral")])
def test_the_program_runs_on_any_rank_count(tmp_path, ranks, method):
    """As a user runs it, under python -m mpi4py: 3 ranks give uneven blocks (the in-process
    tests above run both methods on the suite's rank counts)."""
    command = [str(ROOT / "scripts" / "mpirun.sh"), str(ranks), sys.executable, "-m",
               "mpi4py", str(EXAMPLES / "heat.py"), "--method", method,
               "--out", str(tmp_path)]
    env = _without_launcher_environment()
    env.setdefault("MPIEXEC", str(Path(sys.executable).with_name("mpiexec")))
    env.update(PYMPAR_LAUNCH_TIMEOUT="120", MPLBACKEND="Agg")
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env,
                          cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and f"on {ranks} rank" in out and "): ok" in out, out
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed: no picture" in out, out
    else:
        assert (tmp_path / "heat.png").stat().st_size > 10_000, out
