"""The planner's benchmark: its cases, its verdicts and its report section (no jobs run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mpi_helpers import WORLD

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import bench_plan, report_plan, run  # noqa: E402
from pympar.plan.models import Layout  # noqa: E402

pytestmark = pytest.mark.skipif(WORLD.size > 1, reason="no jobs; one rank is enough")


def row(model, ranks, layout, place, predicted, measured):
    return {"model": model, "ranks": ranks, "layout": layout, "predicted_rank": place,
            "predicted_ms": predicted, "measured_ms": measured, "rounds_ms": [measured],
            "error": (predicted - measured) / measured}


def test_cases_cover_every_small_layout_and_the_top_three_on_eight_ranks(monkeypatch):
    from pympar.plan.machines import REFERENCE_FILE
    monkeypatch.setenv("PYMPAR_PLAN_MACHINE", str(REFERENCE_FILE))  # 'this', calibrated
    cases = bench_plan.cases(8, 0)
    small = [c for c in cases if c["ranks"] <= 2]
    assert {(c["model"], c["ranks"]) for c in small} == {("burgers", 1), ("burgers", 2),
                                                          ("fno", 1), ("fno", 2)}
    assert len([c for c in small if c["model"] == "burgers" and c["ranks"] == 2]) == 16
    eight = [c for c in cases if c["model"] == "burgers" and c["ranks"] == 8]
    assert [c["predicted_rank"] for c in eight] == [1, 2, 3]
    assert all(c["predicted_ms"] > 0 and "--steps" not in c["flags"] for c in cases)
    flags = bench_plan.example_flags("burgers", Layout(cp=4, attention="hybrid", zero=True))
    assert flags[-3:] == ["--ulysses-size", "2", "--zero"]
    assert bench_plan.example_flags("fno", Layout(cp=4, dp=2)) == ["--spatial", "4"]


def test_verdicts_judge_the_tolerance_and_the_order():
    rows = [row("burgers", 1, "a", 1, 10.0, 12.0), row("fno", 2, "b", 1, 10.0, 8.5),
            row("burgers", 8, "x", 1, 5.0, 6.0), row("burgers", 8, "y", 2, 6.0, 6.5),
            row("burgers", 8, "z", 3, 7.0, 9.0)]
    found = bench_plan.verdicts(rows)
    assert found["within_tolerance"] and found["top3_order_kept"]
    assert found["worst"]["layout"] == "b"
    rows[3]["measured_ms"] = 5.5
    rows[0]["error"] = -0.3
    found = bench_plan.verdicts(rows)
    assert not found["within_tolerance"] and not found["top3_order_kept"]
    assert found["top3_measured"] == ["y", "x", "z"]


def test_the_report_section_says_met_or_missed():
    rows = [row("burgers", 1, "a", 1, 10.0, 12.0), row("burgers", 8, "x", 1, 5.0, 6.0),
            row("burgers", 8, "y", 2, 6.0, 6.5), row("burgers", 8, "z", 3, 7.0, 9.0)]
    data = {"steps": 40, "rounds": 3, "cores": 2, "calibration": {"date": "d",
                                                                  "load_average": 0.1},
            "load_average_before": [0.1, 0, 0], "load_average_after": [0.2, 0, 0],
            "rows": rows, "verdicts": bench_plan.verdicts(rows)}
    text = "\n".join(report_plan.section_plan(data))
    assert "### 8 ranks (sharing the cores)" in text and "### 1 rank\n" in text
    assert text.count(": met") == 2 and "-16.7 %" in text


def test_the_job_runs_only_when_named():
    jobs = {j.name: j for j in run.named_only(False)}
    assert jobs["plan"].launches and jobs["plan"].script == "bench_plan.py"
    assert "plan" not in {j.name for j in run.plan(False)}


class _Predicted:
    """What paired_rows reads of a Prediction: the step and its parts, in seconds."""

    def __init__(self, ms: float) -> None:
        self.step, self.seconds = ms / 1e3, {"compute": ms / 1e3}


def test_each_round_is_compared_with_its_own_prediction():
    todo = [{"model": "burgers", "ranks": 8, "layout": "x", "predicted_rank": 1},
            {"model": "burgers", "ranks": 8, "layout": "y", "predicted_rank": 2}]
    predicted = [[_Predicted(v) for v in (10, 20, 12)], [_Predicted(9)] * 3]
    measured = [[10.0, 16.0, 12.0], [10.0, 10.0, 10.0]]
    rows = bench_plan.paired_rows(todo, predicted, measured)
    # x: errors 0, +25 %, 0 (the median of the medians would say 12 against 12 too, but
    # a slow second round predicted slow is no error); y: -10 % every round.
    assert rows[0]["error"] == pytest.approx(0.0) and rows[0]["predicted_ms"] == pytest.approx(12)
    assert rows[1]["error"] == pytest.approx(-0.1) and rows[1]["measured_ms"] == 10.0
    assert [r["predicted_rank"] for r in rows] == [2, 1]  # by the median predictions
    assert rows[0]["rounds_predicted_ms"] == pytest.approx([10, 20, 12])
    assert rows[0]["predicted"] == {"compute": pytest.approx(12)}
    data = {"steps": 40, "rounds": 3, "cores": 2, "recalibrated": True,
            "calibrations": [{"load_average": 0.1}, {"load_average": 0.3}],
            "load_average_before": [0.1, 0, 0], "load_average_after": [0.2, 0, 0],
            "rows": rows, "verdicts": bench_plan.verdicts(rows)}
    text = "\n".join(report_plan.section_plan(data))
    assert "calibrated again before each round" in text and "0.1, 0.3" in text
    assert "10.0/10.0 20.0/16.0 12.0/12.0" in text
