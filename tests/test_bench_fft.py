"""benchmarks/bench_fft.py at a tiny size, and the report's judgement of its targets."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mpi_helpers import WORLD, agree

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bench_fft, report  # noqa: E402


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("anchor", ["installed", "missing"])
def test_bench_fft_runs_and_counts_the_formula_bytes(tmp_path, monkeypatch, anchor):
    if anchor == "missing":
        monkeypatch.setattr(bench_fft, "_mpi4py_fft", lambda: None)
    elif bench_fft._mpi4py_fft() is None:
        pytest.skip("mpi4py-fft is not installed (pip install -e .[bench])")
    out = WORLD.bcast(str(tmp_path / "fft.json"))
    bench_fft.main(["--shapes", "16x16x10", "--repeats", "1", "--warmup", "0",
                    "--fno", "1x8x6x2x2", "--json", out])
    WORLD.Barrier()
    doc = json.loads(Path(out).read_text())
    trip = doc["roundtrip"][0]
    agree(doc["bytes"][0]["equal"], f"bytes {doc['bytes'][0]}")
    agree(max(trip["max_round_trip_error"].values()) < 1e-12, str(trip["max_round_trip_error"]))
    if anchor == "missing":
        agree(set(trip["seconds"]) <= {"pympar", "pympar scipy.fft"} and "pympar" in
              trip["seconds"] and "anchors skipped" in trip["notes"][0],
              str(trip))
    else:
        agree({"mpi4py-fft fftw", "mpi4py-fft numpy"} <= set(trip["seconds"]), str(trip))


def _fft_doc(ranks: int, pympar: float, fftw: float, peak: int) -> dict:
    shape = [8, 8, 8]
    bytes_row = {"measured": {"bytes_in": 10, "bytes_out": 10, "calls": 2},
                 "formula": {"bytes_in": 10, "bytes_out": 10, "off_rank": 5}}
    return {"ranks": ranks, "local_library": "pyfftw",
            "roundtrip": [{"shape": shape, "seconds": {"pympar": pympar,
                                                        "mpi4py-fft fftw": fftw,
                                                        "mpi4py-fft numpy": 2 * fftw},
                           "notes": []}],
            "bytes": [{"shape": shape, "per_rank": [bytes_row] * ranks, "equal": True}],
            "transpose": [], "local": [],
            "fno": {"grid": [8, 8], "batch": 1, "width": 2, "modes": 2, "ranks": ranks,
                    "seconds": 0.1, "peak_step_bytes": peak, "parameter_bytes": 1,
                    "cached_activation_bytes": 1, "split_weight_bytes": 1,
                    "replicated_weight_bytes": 2}}


def test_report_judges_the_fft_targets(tmp_path):
    for ranks, (mine, theirs, peak) in {1: (0.9, 1.0, 1000), 2: (1.2, 1.0, 500),
                                        4: (1.05, 1.0, 300)}.items():
        (tmp_path / f"fft_{ranks}.json").write_text(json.dumps(_fft_doc(ranks, mine, theirs,
                                                                         peak)))
    report.write_report(tmp_path, plots=False)
    text = (tmp_path / "results.md").read_text()
    assert "| 8x8x8 | 1 | 900.00 (pyfftw) | - | 1000.00 | 2000.00 | 0.90 <= 1.0 met |" in text
    assert "| 8x8x8 | 2 | 1200.00 (pyfftw) | - | 1000.00 | 2000.00 | 1.20 <= 1.0 missed |" in text
    assert "| 8x8x8 | 4 | 1050.00 (pyfftw) | - | 1000.00 | 2000.00 | 1.05 <= 1.1 met |" in text
    assert "on 2 ranks / on 1 rank: 0.500 <= 0.55 met" in text
    assert text.count("equal on every rank: met") == 3
