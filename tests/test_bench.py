"""The benchmarks' own logic: volume formulas equal what pympar.stats measures, driver, report.

No timing is asserted here (speed belongs to the benchmarks) and torch is not needed.
"""

from __future__ import annotations

import itertools
import json
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from mpi_helpers import WORLD, agree

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bench_comm_volume as volume  # noqa: E402
from benchmarks import common, report, run  # noqa: E402
from pympar import __main__ as cli  # noqa: E402
from pympar import manager  # noqa: E402

#: (tokens, hidden, ffn): one shape where every split divides, two where none does.
SHAPES = [(16, 8, 32), (13, 9, 35), (11, 10, 21)]


# --------------------------------------------------------------------------- formulas (serial)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("n", [0, 1, 5, 8, 13, 35])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_block_sizes_follow_array_split(n, parts):
    blocks = np.array_split(np.arange(n), parts)
    assert [volume.part(n, parts, i) for i in range(parts)] == [len(b) for b in blocks]
    for i, block in enumerate(blocks):
        subs = np.array_split(block, parts)
        assert [volume.sub(n, parts, i, j) for j in range(parts)] == [len(s) for s in subs]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("d", [2, 3])
def test_3d_counts_add_up_to_the_even_split_formula(d):
    tokens, hidden, ffn = 4 * d * d, 2 * d * d, 8 * d * d  # every split divides
    sizes = {"3d_input": d, "3d_weight": d, "3d_output": d}
    for a, w, c in itertools.product(range(d), repeat=3):
        counts = volume.mlp_3d_counts(tokens, hidden, ffn, d, a, w, c, itemsize=4)
        assert volume.total_exchanged(counts, sizes) == 4 * volume.even_3d_elements(
            tokens, hidden, ffn, d)
        assert sum(calls for calls, _, _ in counts.values()) == 16
    no_bias = volume.mlp_3d_counts(tokens, hidden, ffn, d, 0, 0, 0, itemsize=1, bias=False)
    assert volume.total_exchanged(no_bias, sizes) == volume.even_3d_elements(
        tokens, hidden, ffn, d, bias=False)
    # The layout docs' MLP formula (ffn = 4 hidden, no bias): 2 (d-1)/d^3 (10 T h + 8 h^2).
    h = hidden
    assert volume.even_3d_elements(tokens, h, 4 * h, d, bias=False) == \
        Fraction(2 * (d - 1), d ** 3) * (10 * tokens * h + 8 * h * h)


@pytest.mark.mpi(min_size=1)
def test_exchanged_bytes_rules():
    assert volume.exchanged_bytes("all_gather", 4, 10, 40) == 30
    assert volume.exchanged_bytes("reduce_scatter", 4, 40, 10) == 30
    assert volume.exchanged_bytes("all_reduce", 4, 40, 40) == 60
    assert volume.exchanged_bytes("copy_to_all.backward", 8, 64, 64) == 112
    assert volume.exchanged_bytes("gather_from_sequence.backward", 2, 8, 4) == 4
    with pytest.raises(ValueError, match="no exchange rule"):
        volume.exchanged_bytes("all_to_all", 2, 8, 8)
    assert volume.group_kind("3d_input-1-3") == "3d_input"
    assert volume.group_kind("dp-cp-0-2-4-6") == "dp-cp"


# --------------------------------------------------------------------------- measured = formula


@pytest.fixture
def cube():
    """A 3D parallel state of depth 2 (world size a multiple of 8)."""
    if WORLD.size % 8:
        pytest.skip("needs a world size that is a multiple of 8")
    manager.initialize_parallel(8, tensor_parallel_mode="3d")
    yield
    manager.destroy_parallel()


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_measured_bytes_per_rank_equal_the_formula(cube, shape, dtype):
    tokens, hidden, ffn = shape
    result = volume.compare(tokens, hidden, ffn, dtype)
    for layout in ("3d", "1d"):
        r = result[layout]
        agree(r["equal"], f"{layout} {shape} at coords {result['coords']}: measured "
                          f"{r['measured']} != formula {r['formula']}")
        agree(r["exchanged"] == r["formula_exchanged"] and r["bytes_in"] == r["formula_bytes_in"]
              and r["bytes_out"] == r["formula_bytes_out"], f"{layout} {shape}: totals {r}")
    itemsize = np.dtype(dtype).itemsize
    one_d = float(volume.even_1d_elements(tokens, hidden, 8) * itemsize)
    agree(result["1d"]["exchanged"] == one_d, f"1d exchanged {result['1d']['exchanged']} != {one_d}")
    if all(n % 4 == 0 for n in shape):
        even = float(volume.even_3d_elements(tokens, hidden, ffn, 2) * itemsize)
        agree(result["3d"]["exchanged"] == even,
              f"3d exchanged {result['3d']['exchanged']} != even formula {even}")
    else:
        # Uneven blocks: the ranks differ, and the mean is no longer the even formula's value.
        spread = WORLD.allgather(result["3d"]["bytes_in"])
        agree(len(set(spread[:8])) > 1, f"uneven shape {shape} gave every rank {spread[0]} bytes")


# --------------------------------------------------------------------------- driver and report


@pytest.mark.mpi(min_size=1)
def test_plans_and_launch_command(monkeypatch):
    quick, full = run.plan(True), run.plan(False)
    assert {j.name for j in quick} == {"mappings", "torch_comm", "mlp", "comm_volume_8",
                                         "memory", "attention", "checkpoint"}
    assert {j.name for j in full} == {j.name for j in quick} | {"comm_volume_27"}
    assert all((run.HERE / j.script).is_file() for j in full)
    # scripts/mpirun.sh exports these when the suite itself runs under Open MPI
    for name in ("OMP_NUM_THREADS", "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"):
        monkeypatch.delenv(name, raising=False)
    cmd, env = run.launch_command("/x/mpiexec", 8, ["python", "s.py"], open_mpi=True)
    assert cmd == ["/x/mpiexec", "--oversubscribe", "-n", "8", "python", "s.py"]
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1" and env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["OMP_NUM_THREADS"] == "1" and str(run.REPO) in env["PYTHONPATH"]
    cmd, env = run.launch_command("/x/mpiexec", 2, ["python"], open_mpi=False)
    assert cmd == ["/x/mpiexec", "-n", "2", "python"] and "OMPI_ALLOW_RUN_AS_ROOT" not in env
    monkeypatch.setenv("MPIEXEC", "/no/such/mpiexec")
    with pytest.raises(FileNotFoundError, match="not found"):
        run.find_mpiexec()


@pytest.mark.mpi(min_size=1)
def test_bench_command_needs_a_checkout_and_no_launcher(tmp_path, capsys):
    with pytest.raises(RuntimeError, match="benchmarks are not installed"):
        cli._benchmarks_driver(tmp_path)
    out = tmp_path / f"rank{WORLD.rank}"
    status = cli.main(["bench", "--report-only", "--out", str(out)])
    if WORLD.size > 1:
        # The CLI prints an error once, from rank 0.
        agree(status == 2 and (WORLD.rank != 0 or "without a launcher" in capsys.readouterr().err),
              f"status {status}")
    else:
        agree(status == 0 and (out / "results.md").is_file(), f"status {status}")


@pytest.mark.mpi(min_size=1)
def test_report_from_sample_results(tmp_path):
    sample = {
        "mappings.json": {"ranks": 2, "dtype": "float32", "repeats": 3, "mpi": "MPI",
                          "rows": [{"op": "all_reduce", "bytes": 1024, "raw_us": 4.0,
                                    "mpi_us": 4.0, "pympar_us": 5.0, "ratio": 1.25,
                                    "extra_us": 1.0}]},
        "torch_comm.json": {"skipped": "torch is not installed", "rows": [],
                            "machine": {"date": "2026-01-01 00:00 UTC", "blas": [], "env": {}}},
        "mlp.json": {"repeats": 3, "warmup": 1, "torch_skipped": "--no-torch given", "rows": [{
            "hidden": 256, "tokens": 8192, "step_ms": {"pympar serial 1 thread": 200.0,
                                                       "pympar TP=2": 105.0},
            "max_rel_error": {"pympar TP=2": 0.0}, "efficiency_pympar": 200 / 210}]},
    }
    for name, data in sample.items():
        (tmp_path / name).write_text(json.dumps(data))
    written = report.write_report(tmp_path, plots=False)
    text = (tmp_path / "results.md").read_text()
    assert written == [tmp_path / "results.md"]
    assert "| all_reduce | 4.0 / 5.0 / 1.25 |" in text
    assert "Skipped: torch is not installed" in text
    assert "target parallel efficiency >= 0.95: 0.952, met" in text
    assert "2026-01-01" in text


@pytest.mark.mpi(min_size=1)
def test_torch_is_optional():
    torch, reason = common.import_torch_distributed()
    assert (torch is None) == (reason is not None)
    if torch is None:
        assert "torch" in reason
    assert common.median([3.0, 1.0, 2.0]) == 2.0 and np.isnan(common.median([]))
