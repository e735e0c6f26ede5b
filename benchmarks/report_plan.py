"""Report section of ``plan.json``: the planner's predicted step times beside the measured ones.

:func:`section_plan` takes the job's JSON document (``benchmarks/bench_plan.py``) and returns
markdown lines: one table per rank count (predicted and measured medians, the error, each
round), and the two target lines of issue 34, ending in "met" or "missed".
"""

from __future__ import annotations

from typing import Any

from benchmarks.report_format import table, verdict


def _rounds(r: dict[str, Any]) -> str:
    """Each round's measured step, after its round's prediction where there is one."""
    if "rounds_predicted_ms" not in r:
        return " ".join(f"{v:.1f}" for v in r["rounds_ms"])
    return " ".join(f"{p:.1f}/{v:.1f}" for p, v in zip(r["rounds_predicted_ms"], r["rounds_ms"]))


def _rows(rows: list[dict[str, Any]]) -> list[list[Any]]:
    return [[r["model"], r["layout"], r["predicted_rank"], f"{r['predicted_ms']:.2f}",
             f"{r['measured_ms']:.2f}", f"{100 * r['error']:+.1f} %", _rounds(r),
             " ".join(f"{b:.2f}" for b in r.get("busy_before", []))] for r in rows]


def section_plan(data: dict[str, Any]) -> list[str]:
    """Markdown lines of the planner's section.

    Parameters
    ----------
    data : dict
        ``plan.json``.
    """
    calibration = data.get("calibration", {})
    if data.get("recalibrated"):
        loads = ", ".join(str(c.get("load_average")) for c in data.get("calibrations", []))
        predicted = ("The planner's predictions, calibrated again before each round (`python "
                     "-m pympar plan --calibrate`, at load averages " + loads + "), each job "
                     "against its round's prediction (error: the median over rounds of "
                     "(predicted - measured) / measured), against")
    else:
        predicted = (f"`python -m pympar plan --machine this` (calibrated "
                     f"{calibration.get('date')} at load average "
                     f"{calibration.get('load_average')}) against")
    lines = ["## The planner against measured steps (issue 34)", "",
             f"{predicted} the examples' own "
             f"`median_step_seconds`, default sizes, {data['steps']} steps a job, the median "
             f"of {data['rounds']} jobs a layout in shuffled rounds; load average "
             f"{data['load_average_before'][0]:.2f} before, "
             f"{data['load_average_after'][0]:.2f} after, on {data['cores']} cores. With more "
             f"ranks than cores the model multiplies the compute by ranks/cores, adds the "
             f"measured wait for a core to every synchronizing call and check, and prices "
             f"the lateness of ranks meeting after work as measured with that many ranks a "
             f"core.", ""]
    header = ["model", "layout", "predicted place", "predicted (ms)", "measured (ms)",
              "error", "each job (ms; its round's prediction/measured)",
              "machine busy before each"]
    for ranks in sorted({r["ranks"] for r in data["rows"]}):
        mine = [r for r in data["rows"] if r["ranks"] == ranks]
        shared = ranks > data["cores"]
        lines += [f"### {ranks} rank{'s' if ranks > 1 else ''}"
                  + (" (sharing the cores)" if shared else ""), ""]
        lines += table(header, _rows(mine)) + [""]
    found = data["verdicts"]
    worst = found.get("worst") or {}
    lines += [f"- target every prediction on 1 and 2 ranks within "
              f"{100 * found['tolerance']:.0f} % of the measured median "
              f"({found['cases_1_2']} layouts; worst {worst.get('model')} "
              f"{worst.get('layout')} on {worst.get('ranks')} ranks, "
              f"{100 * worst.get('error', 0):+.1f} %): {verdict(found['within_tolerance'])}",
              f"- target the measured order of the predicted top 3 Burgers layouts on 8 ranks "
              f"(predicted {', '.join(found['top3_predicted'])}; measured "
              f"{', '.join(found['top3_measured'])}): {verdict(found['top3_order_kept'])}", ""]
    return lines
