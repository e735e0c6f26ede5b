"""The examples at small size: they run, and parallel layouts agree with the serial run."""

import contextlib
import importlib.util
import io
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
def test_mapping_tour_shows_every_mapping(capsys):
    from pympar import mappings

    status = load("mapping_tour").main([])
    out = capsys.readouterr().out
    names = [name for name in mappings.__all__ if name != "Mapping"]
    missing = [name for name in names if f"\n{name}: " not in out]
    agree(status == 0 and (WORLD.rank != 0 or (not missing and len(names) == 10
                                              and "round trip exact on every rank: True" in out)),
          f"status {status}, missing {missing}")


@pytest.mark.mpi(min_size=1)
def test_linear3d_flags_that_do_not_fit_are_said_once_with_a_launcher_hint(capsys):
    status = load("linear3d").main(["--tp", "3"])  # never a cube
    err = capsys.readouterr().err
    if WORLD.rank == 0:
        ok = err.count("linear3d.py: error: ") == 1 and (
            WORLD.size > 1 or "start the example under a launcher, e.g. `mpiexec -n 8" in err)
    else:
        ok = err == ""
    agree(status == 2 and ok, f"status {status}: {err!r}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", ["linear3d", "mapping_tour"])
def test_example_flag_errors_are_said_once(capsys, name):
    with pytest.raises(SystemExit) as exit_info:
        load(name).main(["--bogus"])
    err = capsys.readouterr().err
    ok = exit_info.value.code == 2 and (
        err.startswith(f"usage: {name}.py") and err.count("error: unrecognized arguments: --bogus") == 1
        if WORLD.rank == 0 else err == "")
    agree(ok, f"exit {exit_info.value.code}: {err!r}")


@pytest.mark.skipif(WORLD.size != 1, reason="launches its own 2-rank jobs; runs in the pass "
                    "without a launcher")
@pytest.mark.parametrize("flags,expected", [
    (["--tp", "3"], "linear3d.py: error: world size 2 is not divisible by tensor_parallel_size 3"),
    (["--bogus"], "linear3d.py: error: unrecognized arguments: --bogus"),
])
def test_example_errors_are_printed_before_mpi4py_aborts(flags, expected):
    """Under python -m mpi4py a non-zero exit aborts the job: the message must be out first."""
    import os
    import subprocess

    repo = EXAMPLES.parent
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "PYMPAR_"))}
    env.update(PYMPAR_LAUNCH_TIMEOUT="60",
               PYTHONPATH=os.pathsep.join([str(repo), env.get("PYTHONPATH", "")]))
    mpiexec = Path(sys.executable).with_name("mpiexec")
    if mpiexec.exists():
        env.setdefault("MPIEXEC", str(mpiexec))
    for _ in range(3):  # the lost message was a race: try it more than once
        done = subprocess.run([str(repo / "scripts" / "mpirun.sh"), "2", sys.executable, "-m",
                               "mpi4py", str(EXAMPLES / "linear3d.py"), *flags],
                              capture_output=True, text=True, timeout=90, env=env)
        assert done.returncode != 0 and (done.stdout + done.stderr).count(expected) == 1, \
            done.stdout + done.stderr


@pytest.mark.mpi(min_size=2)
def test_readme_example_runs_and_matches_serial():
    if WORLD.size % 2:
        pytest.skip("the README example uses TP=2")
    import re

    from pympar import manager

    text = (EXAMPLES.parent / "README.md").read_text()
    code = re.search(r"## A short example\n\n```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            exec(compile(code, "README.md", "exec"), scope)
        y, x = scope["y"], scope["x"]
    finally:
        manager.destroy_parallel()
    loss = float(np.mean((y - x) ** 2))
    agree(printed.getvalue().endswith(f" loss {loss:.6f}\n") and "tp rank" in printed.getvalue(),
          f"the README example printed {printed.getvalue()!r}")
    # serial twin of the README's MLP on the same input
    from pympar.modules import GELU, Linear
    fc1, fc2 = Linear(64, 256, seed=1), Linear(256, 64, seed=2)
    expected = fc2(GELU()(fc1(x)))
    agree(np.allclose(y, expected, rtol=1e-5, atol=1e-5), "README MLP differs from serial")
