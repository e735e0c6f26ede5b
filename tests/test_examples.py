"""The examples at small size: they run, and parallel layouts agree with the serial run."""

import contextlib
import importlib.util
import io
import json
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


def widest_context(world):
    """Every rank in use, context parallelism as wide as 4 (hybrid then has a real ring)."""
    cp = 4 if world % 4 == 0 else 2 if world % 2 == 0 else 1
    return ["--tp", "2" if world // cp % 2 == 0 else "1", "--cp", str(cp)]


def data_and_context(world):
    """Every rank in use, with context and (from 4 ranks) data parallelism."""
    if world % 4 == 0:
        return ["--tp", str(world // 4), "--cp", "2"]
    return ["--cp", "2"] if world % 2 == 0 else []


def reduce_size(world, layout):
    """The data x context group's size: ZeRO shards over it."""
    return world // int(layout[layout.index("--tp") + 1]) if "--tp" in layout else world


@pytest.mark.mpi(min_size=1)
def test_burgers_attention_schemes_agree_with_serial():
    burgers = load("burgers")
    serial = burgers.train(burgers.parse_args(TINY), MPI.COMM_SELF)
    layout = widest_context(WORLD.size)
    cp = layout[layout.index("--cp") + 1]
    for flags in (["--attention", "ring"], ["--attention", "hybrid"],
                  ["--attention", "hybrid", "--ulysses-size", cp]):
        metrics = burgers.train(burgers.parse_args(TINY + layout + flags), WORLD)
        agree(metrics["flags"]["attention"] == flags[1]
              and np.allclose(metrics["losses"], serial["losses"], rtol=1e-9, atol=1e-12)
              and np.isclose(metrics["val_rel_l2"], serial["val_rel_l2"], rtol=1e-8),
              f"{layout + flags}: losses {metrics['losses']} vs serial {serial['losses']}")


@pytest.mark.mpi(min_size=1)
def test_burgers_zero_matches_allreduce_and_shards_the_state():
    burgers = load("burgers")
    layout = data_and_context(WORLD.size)
    plain = burgers.train(burgers.parse_args(TINY + layout), WORLD)
    zero = burgers.train(burgers.parse_args(TINY + layout + ["--zero"]), WORLD)
    agree(np.allclose(zero["losses"], plain["losses"], rtol=1e-9, atol=1e-12)
          and np.isclose(zero["val_rel_l2"], plain["val_rel_l2"], rtol=1e-8),
          f"{layout}: --zero losses {zero['losses']} vs {plain['losses']}")
    # The shares partition every parameter: the group's ranks hold one replica's state.
    d = reduce_size(WORLD.size, layout)
    sharded = sum(m["optimizer"] for m in zero["memory"])
    whole = sum(m["optimizer"] for m in plain["memory"])
    agree(sharded * d == whole and len(zero["memory"]) == WORLD.size,
          f"optimizer bytes over all ranks: {sharded} with --zero over {d} ranks, {whole} without")


@pytest.mark.mpi(min_size=1)
def test_burgers_recompute_is_bitwise_and_halves_peak_activations():
    burgers = load("burgers")
    flags = TINY + data_and_context(WORLD.size) + ["--layers", "3"]
    plain = burgers.train(burgers.parse_args(flags), WORLD)
    recomputed = burgers.train(burgers.parse_args(flags + ["--recompute"]), WORLD)
    agree(recomputed["losses"] == plain["losses"]
          and recomputed["val_rel_l2"] == plain["val_rel_l2"],
          f"--recompute losses {recomputed['losses']} vs {plain['losses']}")
    peaks = [(a["activations"], b["activations"])
             for a, b in zip(plain["memory"], recomputed["memory"])]
    agree(all(0 < 2 * on <= off for off, on in peaks),
          f"peak activation bytes per rank without/with --recompute: {peaks}")


#: Big enough to train for a few dozen steps (the full bf16 vs fp32 comparison, 600 steps of
#: the default model, is in benchmarks/bench_memory.py --burgers).
SMALL = ["--batch", "8", "--grid", "16", "--hidden", "16", "--heads", "2", "--layers", "1",
         "--trajectories", "8", "--frames", "10", "--steps", "40", "--lr", "3e-3", "--quiet"]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("precision,dtype", [("bf16", "bfloat16"), ("fp16", "float16")])
def test_burgers_half_precision_tracks_fp32(precision, dtype):
    from pympar import backend

    if precision == "bf16" and backend.bfloat16 is None:
        pytest.skip("ml_dtypes (bfloat16) is not installed")
    burgers = load("burgers")
    full = burgers.train(burgers.parse_args(SMALL), WORLD)
    half = burgers.train(burgers.parse_args(SMALL + ["--precision", precision]), WORLD)
    gap = float(np.max(np.abs(np.subtract(half["losses"], full["losses"])) / full["losses"]))
    halved = all(2 * h["parameters"] == f["parameters"]
                 for h, f in zip(half["memory"], full["memory"]))
    agree(half["dtype"] == dtype and halved and gap < 0.05
          and half["val_rel_l2"] <= 1.5 * full["val_rel_l2"],
          f"{precision}: loss gap {gap:.3g}, validation {half['val_rel_l2']:.4g} vs "
          f"{full['val_rel_l2']:.4g}, parameter bytes halved: {halved}")


@pytest.mark.mpi(min_size=1)
def test_burgers_flags_that_do_not_fit(capsys):
    burgers = load("burgers")
    world = WORLD.size
    bad = [["--tp", str(world + 1)], ["--hidden", "10", "--heads", "3"],
           ["--tp", "4", "--mode", "3d"], ["--ulysses-size", "2"], ["--attention", "hybrid", "--ulysses-size", "3"],
           ["--precision", "fp16", "--dtype", "float64"]]
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
    if WORLD.rank == 0:
        memory = json.loads((out / "metrics.json").read_text())["memory"]
        ok = len(memory) == WORLD.size and all(
            m["parameters"] > 0 and m["gradients"] > 0 and m["optimizer"] > 0
            and m["activations"] > 0 and m["peak_rss"] > 2**20 for m in memory)
    agree(ok, f"memory per rank in metrics.json: {memory if WORLD.rank == 0 else ''}")


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
    names = [n for n in mappings.__all__ if isinstance(getattr(mappings, n), mappings.Mapping)]
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
            WORLD.size > 1 or "`mpiexec -n N python -m mpi4py examples/linear3d.py`" in err)
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
        first_grads = [p.grad is not None for p in scope["fc1"].parameters()]
    finally:
        manager.destroy_parallel()
    loss = float(np.mean((y - x) ** 2))
    mine = f"dp rank {WORLD.rank // 2}, tp rank {WORLD.rank % 2}: loss {loss:.6f}"
    lines = WORLD.gather(mine)
    # Rank 0 prints every rank's line in rank order, as one block; the others print nothing.
    expected = "\n".join(lines) + "\n" if WORLD.rank == 0 else ""
    agree(printed.getvalue() == expected,
          f"the README example printed {printed.getvalue()!r}, expected {expected!r}")
    # Its first layer takes data: no input gradient, but its weight gradients are there.
    agree(scope["fc1"].input_grad is False and first_grads == [True, True],
          f"README fc1: input_grad {scope['fc1'].input_grad}, grads {first_grads}")
    # serial twin of the README's MLP on the same input
    from pympar.modules import GELU, Linear
    fc1, fc2 = Linear(64, 256, seed=1), Linear(256, 64, seed=2)
    expected = fc2(GELU()(fc1(x)))
    agree(np.allclose(y, expected, rtol=1e-5, atol=1e-5), "README MLP differs from serial")


@pytest.mark.mpi(min_size=4)
def test_quickstart_groups_snippet_prints_one_block_from_rank_0():
    if WORLD.size % 4:
        pytest.skip("the snippet uses TP=2 x CP=2")
    import re
    import textwrap

    from pympar import manager

    text = (EXAMPLES.parent / "docs" / "quickstart.rst").read_text()
    block = re.search(r"\.\. code-block:: python\n\n(   # groups\.py.*?)\n\n(?=\S)", text, re.S)
    code = textwrap.dedent(block.group(1))
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            exec(compile(code, "quickstart.rst", "exec"), {})
    finally:
        manager.destroy_parallel()
    lines = printed.getvalue().splitlines()
    if WORLD.rank == 0:
        agree([line.split(":")[0] for line in lines] == [f"world rank {r}" for r in
                                                           range(WORLD.size)],
              f"rank 0 printed {lines!r}")
    else:
        agree(lines == [], f"rank {WORLD.rank} printed {lines!r}")
