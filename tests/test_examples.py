"""The examples at small size: they run, and parallel layouts agree with the serial run."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import WORLD, agree

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


TINY = ["--steps", "4", "--batch", "8", "--grid", "10", "--hidden", "8", "--heads", "2",
        "--layers", "1", "--trajectories", "4", "--frames", "3", "--dtype", "float64", "--quiet"]


def burgers_layouts(world):
    for tp, cp in [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (4, 1)]:
        if world % (tp * cp) == 0:
            yield ["--tp", str(tp), "--cp", str(cp)]
    if world % 8 == 0:
        yield ["--tp", "8", "--mode", "3d"]


@pytest.mark.mpi(min_size=1)
def test_burgers_final_loss_agrees_across_layouts():
    burgers = load("burgers")
    serial = burgers.train(burgers.parse_args(TINY), MPI.COMM_SELF)
    agree(np.isfinite(serial["losses"]).all() and serial["losses"][0] > 0, str(serial["losses"]))
    for layout in burgers_layouts(WORLD.size):
        metrics = burgers.train(burgers.parse_args(TINY + layout), WORLD)
        agree(np.allclose(metrics["losses"], serial["losses"], rtol=1e-9, atol=1e-12)
              and np.isclose(metrics["val_rel_l2"], serial["val_rel_l2"], rtol=1e-8),
              f"{layout}: losses {metrics['losses']} vs serial {serial['losses']}")


@pytest.mark.mpi(min_size=1)
def test_burgers_flags_that_do_not_fit(capsys):
    burgers = load("burgers")
    world = WORLD.size
    bad = [["--tp", str(world + 1)], ["--hidden", "10", "--heads", "3"], ["--tp", "4", "--mode", "3d"]]
    for flags in bad:
        status = burgers.main(TINY + flags)
        agree(status == 2, f"{flags} exited {status}")
    err = capsys.readouterr().err
    agree(WORLD.rank != 0 or err.count("burgers.py: error:") == len(bad), err)


@pytest.mark.mpi(min_size=1)
def test_burgers_writes_metrics_and_plot(tmp_path):
    burgers = load("burgers")
    out = Path(WORLD.bcast(str(tmp_path)))
    status = burgers.main(TINY + ["--out", str(out)])
    ok = status == 0 and (WORLD.rank != 0 or ((out / "metrics.json").exists()
                                             and (out / "loss.png").stat().st_size > 1000))
    agree(ok, f"status {status}, files {list(out.iterdir()) if out.exists() else None}")


@pytest.mark.mpi(min_size=8)
def test_linear3d_example_matches_serial():
    if WORLD.size % 8:
        pytest.skip("needs a multiple of 8 ranks")
    result = load("linear3d").run(load("linear3d").argparse.Namespace(
        tp=8, features=8, hidden=16, batch=8, steps=5, lr=0.1))
    agree(result["max_weight_difference"] < 1e-10, str(result["max_weight_difference"]))


@pytest.mark.mpi(min_size=1)
def test_mapping_tour_runs(capsys):
    status = load("mapping_tour").main([])
    out = capsys.readouterr().out
    agree(status == 0 and (WORLD.rank != 0 or "all_to_all_from_sequence_to_hidden" in out), out[-500:])


@pytest.mark.mpi(min_size=2)
def test_readme_example_runs_and_matches_serial():
    if WORLD.size % 2:
        pytest.skip("the README example uses TP=2")
    import re

    from pympar import manager

    text = (EXAMPLES.parent / "README.md").read_text()
    code = re.search(r"## Fifteen lines\n\n```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    try:
        exec(compile(code, "README.md", "exec"), scope)
        y, x = scope["y"], scope["x"]
    finally:
        manager.destroy_parallel()
    # serial twin of the README's MLP on the same input
    from pympar.modules import GELU, Linear
    fc1, fc2 = Linear(64, 256, seed=1), Linear(256, 64, seed=2)
    expected = fc2(GELU()(fc1(x)))
    agree(np.allclose(y, expected, rtol=1e-5, atol=1e-5), "README MLP differs from serial")
