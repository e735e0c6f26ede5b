"""The halo benchmark: small cases run and check their variants against each other, the
command line picks boundaries and PETSc's job, and the report judges the target."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from mpi_helpers import WORLD, agree
from benchmarks import bench_halo, halo_petsc, report

ARGS = argparse.Namespace(repeats=3, warmup=0, sample_seconds=1e-4, petsc_variants=False)


@pytest.mark.skipif(WORLD.size < 2, reason="the benchmark needs two ranks")
@pytest.mark.parametrize("boundary", ["all", "none", "split"])
@pytest.mark.parametrize("layout", ["axis0", "last", "grid"])
def test_a_small_case_runs_and_counts_the_faces(layout, boundary):
    sizes = bench_halo.layouts(WORLD.size).get(layout)
    if sizes is None:
        pytest.skip("the grid needs an even number of ranks >= 4")
    case = bench_halo.measure((12, 10, 8), layout, sizes, 1, ARGS, boundary)
    # Every variant but PETSc's: each face of a 3-D field is strided (later axes' blocks).
    agree(set(case["median_us"]) == set(bench_halo.VARIANTS) - set(halo_petsc.VARIANTS),
          str(case))
    # The ratio pairs pympar with the anchor (the faster raw code) round by round (the
    # samples kept are rounded to 0.01 us).
    times = case["samples_us"]
    anchor = case["anchor"]
    paired = np.median(np.array(times["pympar"]) / np.array(times[anchor]))
    medians = case["median_us"]
    agree(len(times["pympar"]) == 3 and np.isclose(case["ratio"], paired, rtol=5e-3)
          and medians[anchor] == min(medians["raw_sendrecv"], medians["raw_packed"]),
          f"{case['ratio']} != {paired}, anchor {anchor} of {medians}")
    periodic = {"all": [True] * 3, "none": [False] * 3,
                "split": [a in {"axis0": [0], "last": [2], "grid": [0, 1]}[layout]
                          for a in range(3)]}[boundary]
    agree(case["periodic"] == periodic, f"{case['periodic']} != {periodic}")
    # Two faces of one float64 cell over the later axes' block extents (axis0), over the
    # earlier axes' padded extents (last); one face at a wall of 2 ranks.
    faces = {"axis0": 8 * 10 * 8 * 2 // (1 + (boundary == "none" and WORLD.size == 2)),
             "last": 8 * 14 * 12 * 2 // (1 + (boundary == "none" and WORLD.size == 2))}
    want = faces.get(layout)
    agree(want is None or case["face_bytes_max"] == want, f"{case['face_bytes_max']} != {want}")


@pytest.mark.skipif(WORLD.size < 2, reason="the benchmark needs two ranks")
def test_a_one_dimensional_field_and_contiguous_faces():
    """A 1-D field: every face is one cell, contiguous, so the strided-only variants (the
    same code as pympar's and raw_sendrecv's there) are left out."""
    case = bench_halo.measure((64,), "axis0", {"x": WORLD.size}, 2, ARGS, "all")
    agree(case["anchor"] == "raw_sendrecv" and not set(bench_halo.STRIDED_ONLY)
          & set(case["median_us"]), str(case["median_us"]))
    agree(case["face_bytes_max"] == 2 * 2 * 8, str(case["face_bytes_max"]))


@pytest.mark.mpi(min_size=1)
def test_the_petsc_job_is_asked_for_only_where_an_interpreter_is_named(tmp_path,
                                                                      monkeypatch):
    """No --petsc-python and no default interpreter: no PETSc job; --no-petsc wins over a
    named one; a job that has petsc4py itself starts none; the argument list of the job
    started drops this job's --json and --petsc-python."""
    parser = argparse.ArgumentParser()
    halo_petsc.add_arguments(parser)
    monkeypatch.setattr(halo_petsc, "DEFAULT_PYTHON", tmp_path / "missing")
    args = parser.parse_args([])
    args.petsc_variants = False
    agree(halo_petsc.spawn(WORLD, args, []) is None)
    started = []
    monkeypatch.setattr(halo_petsc, "_run", lambda python, ranks, argv:
                        started.append((python, ranks, argv)) or {"cases": []})
    for argv, petsc, runs in ((["--petsc-python", "py", "--no-petsc"], False, False),
                              (["--petsc-python", "py"], True, False),
                              (["--petsc-python", "py"], False, True)):
        started.clear()
        args = parser.parse_args(argv)
        args.petsc_variants = petsc
        job = halo_petsc.spawn(WORLD, args, ["--shapes", "8x8", "--json", "x.json", *argv])
        agree((job is not None) == (runs and WORLD.rank == 0) and bool(started) == (
            runs and WORLD.rank == 0), f"{argv}, petsc here {petsc}: {job} {started}")
    line = halo_petsc.command("/env/bin/python", 2, ["--shapes", "8x8", "--json", "x.json",
                                                     "--petsc-python=py", "--repeats", "3",
                                                     "--no-petsc"], tmp_path / "out.json")
    agree(line[:5] == ["/env/bin/mpiexec", "--oversubscribe", "-n", "2", "/env/bin/python"]
          and line[6:] == ["--shapes", "8x8", "--repeats", "3", "--petsc-job", "--json",
                           str(tmp_path / "out.json")], str(line))


def _sample(ratios, petsc_job=None):
    cases = [{"shape": [64, 64], "layout": "axis0", "parts": [2, 1], "width": 1,
              "boundary": "all", "face_bytes_max": 1024, "ratio": r, "ratio_packed": 1.2,
              "neighbor_over_sendrecv": 0.9, "anchor": "raw_sendrecv",
              "median_us": {"pympar": 10.0 * r, "raw_sendrecv": 10.0,
                            "raw_neighbor": 9.0, "pympar_adjoint": 11.0}} for r in ratios]
    return {"benchmark": "halo", "ranks": 2, "args": {"width": 1}, "target": 1.05,
            "cases": cases, "petsc_job": petsc_job}


@pytest.mark.mpi(min_size=1)
def test_report_judges_the_halo_target(tmp_path):
    for ratios, word in (([1.01, 1.04], "met"), ([1.01, 1.20], "missed")):
        (tmp_path / "halo.json").write_text(json.dumps(_sample(ratios)))
        report.write_report(tmp_path, plots=False)
        text = (tmp_path / "results.md").read_text()
        assert "## Halo exchange" in text
        assert f"worst {max(ratios):.3f} (64x64 axis0 (2x1) periodic), " in text
        assert text.count(word + "\n")
        assert "| 64x64 axis0 (2x1) periodic | 1 KiB | " in text
        assert "Beside PETSc" not in text


@pytest.mark.mpi(min_size=1)
def test_report_shows_the_petsc_job_beside(tmp_path):
    job = _sample([0.98])
    job.update(petsc=True, machine={"mpi": "Open MPI v4.1.4"})
    job["cases"][0]["median_us"].update(petsc_global_to_local=30.0, petsc_local_to_local=12.5)
    job["cases"][0].update(petsc_global_to_local_over_raw=3.0, petsc_local_to_local_over_raw=1.25)
    (tmp_path / "halo.json").write_text(json.dumps(_sample([1.01], job)))
    report.write_report(tmp_path, plots=False)
    text = (tmp_path / "results.md").read_text()
    assert "### Beside PETSc" in text and "Open MPI v4.1.4" in text
    assert "| 64x64 axis0 (2x1) periodic | 1 KiB | 9.8 | 10.0 | - | 30.0 | 12.5 | 0.980 | " \
           "3.000 | 1.250 |" in text
    (tmp_path / "halo.json").write_text(json.dumps(_sample([1.01], {"skipped": "why"})))
    report.write_report(tmp_path, plots=False)
    assert "PETSc: no figures (why)." in (tmp_path / "results.md").read_text()
