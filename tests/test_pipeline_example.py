"""examples/pipeline.py: every pipeline x tensor x data layout of the suite's ranks trains
as the unsplit chain does on one rank (both schedules, micro-batch counts 1, p and p + 1,
uneven replicas and micro-batches); its verdict and its flags; the program as a user runs
it; and the timelines that scripts/draw_pipeline.py draws from the schedules' steps."""

from __future__ import annotations

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
#: A batch that every replica of every layout cuts into p + 1 micro-batches, unevenly.
TINY = ["--steps", "3", "--batch", str(4 * WORLD.size + 5), "--length", "5", "--vocab", "11",
        "--hidden", "8", "--layers", "2"]


def layouts(world: int) -> list[tuple[int, int]]:
    """(pp, tp) pairs that fit ``world``, the rest data-parallel: 2 and 4 stages alone,
    with TP 2, and with DP."""
    return [(pp, tp) for pp, tp in ((1, 1), (2, 1), (2, 2), (4, 1), (4, 2))
            if world % (pp * tp) == 0 and pp * tp <= world]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_every_layout_trains_as_one_rank_does(schedule):
    example = load("pipeline")
    for pp, tp in layouts(WORLD.size):
        dp = WORLD.size // (pp * tp)
        for m in sorted({1, pp, pp + 1}):
            flags = TINY + ["--pp", str(pp), "--tp", str(tp), "--schedule", schedule,
                            "--micro-batches", str(m)]
            args = example.parse_args(flags)
            result = example.train(args, WORLD)
            serial = example.train_serial(args)
            gap = example.difference(result["losses"], serial)
            expected = [(s, m if schedule == "gpipe" else min(pp - s, m)) for s in range(pp)]
            peaks = [(s, peak) for s, peak, _ in result["stages"]]
            agree(len(serial) == 3 and gap <= 1e-10 and peaks == expected
                  and result["layout"] == {"pp": pp, "tp": tp, "dp": dp},
                  f"pp={pp} tp={tp} dp={dp} m={m}: losses {result['losses']} vs {serial} "
                  f"({gap:.2e}); peaks {peaks}, expected {expected}")


@pytest.mark.mpi(min_size=1)
def test_the_model_learns_the_chain():
    """The loss falls from about log(vocab) towards the chain's entropy."""
    example = load("pipeline")
    losses = example.train_serial(example.parse_args(["--steps", "25"]))
    entropy = -(0.6 * np.log(0.6) + 0.3 * np.log(0.3) + 0.1 * np.log(0.1))
    agree(abs(losses[0] - np.log(37)) < 0.5 and entropy < losses[-1] < 0.4 * losses[0],
          f"losses {losses[0]:.3f} -> {losses[-1]:.3f} (log 37 = {np.log(37):.3f}, "
          f"entropy {entropy:.3f})")


@pytest.mark.mpi(min_size=1)
def test_a_run_off_the_one_rank_run_exits_1(monkeypatch, capsys):
    example = load("pipeline")
    serial = example.train_serial

    def shifted(args):  # what a gradient scaled wrong somewhere would give
        return [loss * (1 + 1e-7) for loss in serial(args)]
    monkeypatch.setattr(example, "train_serial", shifted)
    pp = 2 if WORLD.size % 2 == 0 else 1
    status = example.main(TINY + ["--pp", str(pp), "--tp", "1"])
    out = capsys.readouterr().out
    agree(status == 1 and (out.count("DIFFERENT") == 1 and "1.00e-07" in out
                           if WORLD.rank == 0 else out == ""), f"status {status}: {out!r}")
    assert example.difference([1.0, 2.0], [1.0]) == float("inf")


@pytest.mark.mpi(min_size=1)
def test_flags_that_do_not_fit_are_said_once(capsys):
    example = load("pipeline")
    bad = {("--pp", str(WORLD.size + 1)): "does not divide",
           ("--pp", "1", "--tp", "1", "--batch", str(WORLD.size)): "cannot give each",
           ("--pp", "1", "--tp", "1", "--micro-batches", "0"): "at least 1"}
    if WORLD.size % 4 == 0:  # 4 stages fit the ranks, not the 3 layers of no block
        bad[("--pp", "4", "--tp", "1", "--layers", "0")] = "need at least 4 layers"
    for flags, said in bad.items():
        status = example.main(TINY + list(flags))
        err = capsys.readouterr().err
        agree(status == 2 and err.count(said) == (WORLD.rank == 0), f"{flags}: {err!r}")


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1,
                    reason="starts its own jobs of 4 ranks: runs in the pass without a "
                           "launcher")
@pytest.mark.parametrize("flags", [[], ["--pp", "4", "--tp", "1", "--schedule", "gpipe"]])
def test_the_program_runs_on_4_ranks(tmp_path, flags):
    """As the how-to runs it, under python -m mpi4py."""
    command = [str(ROOT / "scripts" / "mpirun.sh"), "4", sys.executable, "-m", "mpi4py",
               str(EXAMPLES / "pipeline.py"), "--steps", "10", *flags]
    env = _without_launcher_environment()
    env.setdefault("MPIEXEC", str(Path(sys.executable).with_name("mpiexec")))
    env.update(PYMPAR_LAUNCH_TIMEOUT="120")
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env,
                          cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and out.count("): same") == 1, out
    assert ("pp=4 x tp=1 x dp=1, gpipe" if flags else "pp=2 x tp=2 x dp=1, 1f1b") in out, out


# ---------------------------------------------------------------- the picture's timelines


def _draw():
    import importlib.util

    spec = importlib.util.spec_from_file_location("draw_pipeline",
                                                  ROOT / "scripts" / "draw_pipeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_the_pictured_timelines_have_the_ideal_bubble(p, m):
    """From the schedules' own steps: the step takes m + p - 1 forward-and-backward times,
    every stage is idle (p - 1) / (m + p - 1) of it, and holds m (GPipe) or at most
    p - s (1F1B) micro-batches."""
    from pympar.pipeline import GPipe, OneFOneB

    draw = _draw()
    for schedule, peak in ((GPipe, lambda s: m), (OneFOneB, lambda s: min(p - s, m))):
        placed = draw.timeline(draw.stage_orders(schedule, p, m), forward=1.0, backward=2.0)
        span = max(step[3] for steps in placed for step in steps)
        assert span == 3 * (m + p - 1), (schedule.name, span)
        assert np.isclose(draw.bubble(placed), (p - 1) / (m + p - 1))
        held = [max(h for _, h in draw.in_flight(steps)) for steps in placed]
        assert held == [peak(s) for s in range(p)], (schedule.name, held)
        assert all(draw.in_flight(steps)[-1][1] == 0 for steps in placed)


@pytest.mark.mpi(min_size=1)
def test_orders_that_deadlock_are_refused():
    draw = _draw()
    # Stage 0 waits for the backward of a micro-batch stage 1 never got forward.
    with pytest.raises(RuntimeError, match="deadlock"):
        draw.timeline([[("backward", 0), ("forward", 0)], [("forward", 0), ("backward", 0)]])
