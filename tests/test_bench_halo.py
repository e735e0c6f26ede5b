"""The halo benchmark: one tiny case runs and checks its variants against each other, and the
report judges the target."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from mpi_helpers import WORLD, agree
from benchmarks import bench_halo, report


@pytest.mark.skipif(WORLD.size < 2, reason="the benchmark needs two ranks")
@pytest.mark.parametrize("layout", ["axis0", "last", "grid"])
def test_a_small_case_runs_and_counts_the_faces(layout):
    sizes = bench_halo.layouts(WORLD.size).get(layout)
    if sizes is None:
        pytest.skip("the grid needs an even number of ranks >= 4")
    args = argparse.Namespace(repeats=3, warmup=0, sample_seconds=1e-4)
    case = bench_halo.measure((12, 10, 8), layout, sizes, 1, args)
    agree(set(case["median_us"]) == set(bench_halo.VARIANTS), str(case))
    # The ratio pairs the two variants' samples round by round.
    times = case["samples_us"]
    paired = np.median(np.array(times["pympar"]) / np.array(times["raw_sendrecv"]))
    agree(len(times["pympar"]) == 3 and np.isclose(case["ratio"], paired, rtol=1e-12),
          f"{case['ratio']} != {paired}")
    # Two faces of one float64 cell: over the later axes' block extents (axis0), over the
    # earlier axes' padded extents (last).
    faces = {"axis0": 2 * 8 * 10 * 8, "last": 2 * 8 * 14 * 12}.get(layout)
    agree(faces is None or case["face_bytes_max"] == faces, f"{case['face_bytes_max']} != {faces}")


def _sample(ratios):
    cases = [{"shape": [64, 64], "layout": "axis0", "parts": [2, 1], "width": 1,
              "face_bytes_max": 1024, "ratio": r, "ratio_packed": 1.2,
              "neighbor_over_sendrecv": 0.9,
              "median_us": {"pympar": 10.0 * r, "pympar_packed": 12.0, "raw_sendrecv": 10.0,
                            "raw_neighbor": 9.0, "pympar_adjoint": 11.0}} for r in ratios]
    return {"benchmark": "halo", "ranks": 2, "args": {"width": 1}, "target": 1.05,
            "cases": cases}


@pytest.mark.mpi(min_size=1)
def test_report_judges_the_halo_target(tmp_path):
    for ratios, word in (([1.01, 1.04], "met"), ([1.01, 1.20], "missed")):
        (tmp_path / "halo.json").write_text(json.dumps(_sample(ratios)))
        report.write_report(tmp_path, plots=False)
        text = (tmp_path / "results.md").read_text()
        assert "## Halo exchange" in text
        assert f"worst {max(ratios):.3f} (64x64 axis0), " in text and text.count(word + "\n")
        assert "| 64x64 axis0 (2x1) | 1 KiB | " in text
