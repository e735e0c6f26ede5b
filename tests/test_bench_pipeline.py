"""The pipeline benchmark: a tiny run writes every figure it documents (each bubble derived
from its samples as the docstring says, the micro-batches held equal to the formulas), its
command line refuses what it cannot run, the driver plans it, and the report judges the
target. No timing is asserted (speed belongs to the benchmark)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from mpi_helpers import WORLD, agree

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bench_pipeline, report, run  # noqa: E402
from benchmarks.report_pipeline import off_ideal  # noqa: E402

TINY = ["--micro", "1,p", "--repeats", "2", "--warmup", "1", "--width", "16", "--rows", "4",
        "--layers", "1", "--sleep-ms", "3"]


@pytest.mark.mpi(min_size=1)
def test_a_tiny_run_writes_every_figure(tmp_path):
    stages = [p for p in (1, 2, 4) if p <= WORLD.size]
    out = Path(WORLD.bcast(str(tmp_path / "pipeline.json")))
    status = bench_pipeline.main(TINY + ["--stages", ",".join(map(str, stages)),
                                         "--json", str(out)])
    WORLD.Barrier()
    doc = json.loads(out.read_text())
    cases = {(c["work"], c["stages"], c["micro_batches"]): c for c in doc["cases"]}
    expected = {(w, p, m) for w in ("compute", "sleep") for p in stages for m in {1, p}}
    problems = [] if status == 0 and set(cases) == expected else [f"{status}, {set(cases)}"]
    for (work, p, m), case in cases.items():
        if case["ideal"] != (p - 1) / (m + p - 1) or len(case["alone_ms"]) != 2 \
                or any(len(a) != p for a in case["alone_ms"]) or len(case["stage_ms"]) != p:
            problems.append(f"{work} p={p} m={m}: {case['ideal']}, {case['alone_ms']}")
        for name, figures in case["schedules"].items():
            steps = figures["samples_ms"]
            # Against the slowest stage of each round.
            bubble = np.median([1 - m * max(a) / s for a, s in zip(case["alone_ms"], steps)])
            idle = np.array(figures["idle_samples"])  # (rounds, stages)
            if not (np.isclose(figures["bubble"], bubble) and len(steps) == 2
                    and idle.shape == (2, p) and ((0 <= idle) & (idle < 1)).all()
                    and np.allclose(figures["idle_per_stage"], np.median(idle, axis=0))
                    and np.isclose(figures["idle"], np.median(idle.mean(axis=1)))
                    and np.isclose(figures["paced"], np.median(idle.min(axis=1)))):
                problems.append(f"{work} p={p} m={m} {name}: {figures}")
    memory = {(r["schedule"], r["stages"], r["micro_batches"]): r for r in doc["memory"]}
    if set(memory) != {(n, p, m) for n in ("gpipe", "1f1b") for _, p, m in expected}:
        problems.append(f"memory runs {set(memory)}")
    for (name, p, m), row in memory.items():
        held = [s["in_flight"] for s in row["per_stage"]]
        formula = [m if name == "gpipe" else min(p - s, m) for s in range(p)]
        cached = [s["cached_bytes"] for s in row["per_stage"]]
        if held != formula or cached != [h * row["micro_batch_bytes"] for h in held] \
                or row["micro_batch_bytes"] <= 0:
            problems.append(f"{name} p={p} m={m}: held {held}, formula {formula}, {cached}")
    agree(not problems, "; ".join(problems[:4]))


@pytest.mark.mpi(min_size=1)
def test_micro_batch_counts_follow_the_stage_count():
    assert bench_pipeline.micro_batch_counts("1,p,2p,4p", 4) == [1, 4, 8, 16]
    assert bench_pipeline.micro_batch_counts("p,4", 4) == [4]
    with pytest.raises(ValueError, match="gives 0"):
        bench_pipeline.micro_batch_counts("0p", 2)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("flags", [["--work", "compute,idle"], ["--stages", "0"],
                                   ["--stages", str(WORLD.size + 1)], ["--micro", "0"]])
def test_what_it_cannot_run_exits_2(flags, capsys):
    status = bench_pipeline.main(flags)
    said = capsys.readouterr().out
    agree(status == 2 and (said.startswith("bench_pipeline: ") if WORLD.rank == 0
                           else said == ""), f"{flags}: {status} {said!r}")


@pytest.mark.mpi(min_size=1)
def test_the_driver_runs_it_on_4_ranks():
    for quick in (True, False):
        job = next(j for j in run.plan(quick) if j.name == "pipeline")
        assert (job.script, job.ranks, job.output) == ("bench_pipeline.py", 4, "pipeline.json")
        assert (run.HERE / job.script).is_file()
    small = [j for j in run.plan(False) if j.name == "pipeline_small"]
    assert [(j.script, j.ranks, j.output) for j in small] == [
        ("bench_pipeline.py", 4, "pipeline_small.json")]
    assert "pipeline_small" not in [j.name for j in run.plan(True)]


def _case(work: str, p: int, m: int, bubble: float, oversubscribed: bool = False) -> dict:
    figures = {"step_ms": 100.0, "samples_ms": [100.0], "bubble": bubble, "idle": bubble,
               "paced": bubble - 0.001, "idle_per_stage": [bubble] * p}
    return {"work": work, "stages": p, "micro_batches": m, "ideal": (p - 1) / (m + p - 1),
            "oversubscribed": oversubscribed, "micro_batch_ms": 10.0, "alone_ms": [[10.0] * p],
            "schedules": {"gpipe": figures, "1f1b": dict(figures)}}


def _memory(held: list[int], formula: list[int]) -> dict:
    return {"schedule": "1f1b", "stages": len(held), "micro_batches": 8,
            "micro_batch_bytes": 2 ** 20,
            "per_stage": [{"stage": s, "in_flight": h, "formula": f, "cached_bytes": h * 2 ** 20,
                           "traced_peak_bytes": h * 2 ** 20 + 1024}
                          for s, (h, f) in enumerate(zip(held, formula))]}


@pytest.mark.mpi(min_size=1)
def test_report_judges_the_bubble_target(tmp_path):
    assert np.isclose(off_ideal(0.12, 0.1), 0.2) and off_ideal(0.05, 0.0) == 0.05
    doc = {"benchmark": "pipeline", "ranks": 4, "cores": 2,
           "args": {"layers": 4, "width": 512, "rows": 128, "sleep_ms": 30.0, "repeats": 9},
           "cases": [_case("compute", 2, 2, 0.5), _case("compute", 2, 8, 0.114),
                     _case("sleep", 4, 16, 0.19, True), _case("compute", 4, 16, 0.6, True)],
           "memory": [_memory([4, 3, 2, 1], [4, 3, 2, 1])]}
    (tmp_path / "pipeline.json").write_text(json.dumps(doc))
    report.write_report(tmp_path, plots=False)
    text = (tmp_path / "results.md").read_text()
    assert "## Pipeline schedules: bubble and memory" in text
    assert "| compute | 2 | 8 | 10.0 | 0.111 | 0.114 / 0.113 / 0.114 | 0.114 / 0.113 / 0.114 " \
           "| 100.0 | 100.0 |  |" in text, text
    assert "ideal 0.111 at m = 4p, compute, 2 stages: GPipe 0.114 (3% off), 1F1B 0.114 " \
           "(3% off), met" in text, text
    assert "ideal 0.158 at m = 4p, sleep, 4 stages: GPipe 0.190 (20% off), 1F1B 0.190 " \
           "(20% off), missed" in text, text
    assert "compute, 4 stages: not judged (4 stages on 2 cores" in text, text
    assert "m = 4p, compute, 2 stages: GPipe 0.500" not in text  # m = p: no target
    assert "| 1F1B | 4 | 8 | 4 (4) 3 (3) 2 (2) 1 (1) | 4.0 3.0 2.0 1.0 | 4.0 3.0 2.0 1.0 |" \
        in text, text
    assert "1F1B min(p - s, m)), 1 runs: met" in text
    assert "The same at half the compute" not in text
    small = {"benchmark": "pipeline", "ranks": 4, "cores": 2,
             "args": {"layers": 4, "width": 512, "rows": 384, "sleep_ms": 30.0, "repeats": 9},
             "cases": [_case("sleep", 2, 8, 0.13)]}
    (tmp_path / "pipeline_small.json").write_text(json.dumps(small))
    report.write_report(tmp_path, plots=False)
    text = (tmp_path / "results.md").read_text()
    assert "The same at half the compute for the same bytes, so that the transfers weigh " \
           "twice as much (*compute* = 4 x (Linear 512 -> 512, GELU) on 384 rows" in text, text
    assert "each micro-batch sends 768 KiB forward and back" in text, text
    assert "ideal 0.111 at m = 4p, sleep, 2 stages: GPipe 0.130 (17% off), 1F1B 0.130 " \
           "(17% off), missed" in text, text
    doc["memory"] = [_memory([4, 3, 3, 1], [4, 3, 2, 1])]
    (tmp_path / "pipeline.json").write_text(json.dumps(doc))
    report.write_report(tmp_path, plots=False)
    assert "1 runs: missed" in (tmp_path / "results.md").read_text()
