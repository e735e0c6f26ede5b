"""Report section of ``mappings.json``: pympar's collectives and mappings against raw mpi4py.

:func:`section_mappings` returns markdown lines: the times at a few sizes, the ratio at
every size, the cost of the default agreement check beside its floor, and the target
lines (each ends in "met" or "missed").
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.report_format import show_size, table, verdict

#: Sizes shown in the compact table.
KEY_SIZES = (2 ** 10, 2 ** 20, 16 * 2 ** 20)
#: pympar / raw at every size from 1 MiB up (issue 9).
RATIO_TARGET, RATIO_FROM = 1.03, 2 ** 20
#: Microseconds over raw at 1 KiB (issue 9).
EXTRA_TARGET_US = 5.0
#: The default agreement check: at most 2 % of the call at 1 MiB, 5 us at 1 KiB (issue 12).
CHECK_SHARE_TARGET, CHECK_TARGET_US = 0.02, 5.0


def _share(row: dict[str, Any], key: str) -> float:
    return row[key] / row["pympar_us"]


def _over(rows: list[dict[str, Any]], bad: Any, show: Any) -> str:
    """``"none"`` or the rows for which ``bad(row)`` holds, each as ``show(row)``."""
    hits = [f"{r['op']} at {show_size(r['bytes'])} ({show(r)})" for r in rows if bad(r)]
    return "; ".join(hits) if hits else "none"


def _targets(rows: list[dict[str, Any]]) -> list[str]:
    moving = [r for r in rows if r.get("communicates", True)]
    big = [r for r in moving if r["bytes"] >= RATIO_FROM]
    small = [r for r in rows if r["bytes"] == 2 ** 10]
    slow = [r for r in big if r["ratio"] > RATIO_TARGET]
    local = [r for r in rows if not r.get("communicates", True) and r["bytes"] >= RATIO_FROM]
    lines = []
    if big:
        lines.append(f"- target pympar <= {RATIO_TARGET} x raw from {show_size(RATIO_FROM)} up, "
                     f"rows that communicate: {len(big) - len(slow)} of {len(big)} rows within, "
                     f"{verdict(not slow)}; over: "
                     + _over(big, lambda r: r["ratio"] > RATIO_TARGET,
                             lambda r: f"{r['ratio']:.2f}"))
    if local:
        within = sum(r["ratio"] <= RATIO_TARGET for r in local)
        lines.append(f"- the same for the rows that move nothing (a block kept or the input "
                     f"returned; raw is the bare NumPy slice): {within} of {len(local)} rows "
                     f"within, {verdict(within == len(local))}")
    if small:
        lines.append(f"- target at most {EXTRA_TARGET_US:.0f} us over raw at 1 KiB: largest "
                     f"{max(r['extra_us'] for r in small):.2f} us, "
                     f"{verdict(all(r['extra_us'] <= EXTRA_TARGET_US for r in small))}")
    checked_small = [r for r in moving if r["bytes"] == 2 ** 10 and "check_us" in r]
    checked_mib = [r for r in moving if r["bytes"] == 2 ** 20 and "check_us" in r]
    if checked_small:
        lines.append(f"- target agreement check at most {CHECK_TARGET_US:.0f} us at 1 KiB: largest "
                     f"{max(r['check_us'] for r in checked_small):.2f} us, "
                     f"{verdict(all(r['check_us'] <= CHECK_TARGET_US for r in checked_small))}")
    if checked_mib:
        worst = max(_share(r, "check_us") for r in checked_mib)
        lines.append(
            f"- target agreement check at most {CHECK_SHARE_TARGET:.0%} of the call at 1 MiB: "
            f"median {statistics.median([_share(r, 'check_us') for r in checked_mib]):.2%}, largest "
            f"{worst:.2%}, {verdict(worst <= CHECK_SHARE_TARGET)}; over: "
            + _over(checked_mib, lambda r: _share(r, "check_us") > CHECK_SHARE_TARGET,
                    lambda r: f"{_share(r, 'check_us'):.2%}"))
        floors = [_share(r, "floor_us") for r in checked_mib if r.get("floor_us") is not None]
        if floors:
            lines.append(f"- floor of any check made before the data call, at 1 MiB: median "
                         f"{statistics.median(floors):.2%} of the call, largest {max(floors):.2%} (no target)")
    return lines


def _check_cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return ""
    parts = []
    for key in ("check_us", "floor_us"):
        value = row.get(key)
        text = "n/a" if value is None else f"{value:.2f}"
        if value is not None and row["bytes"] >= RATIO_FROM:
            text += f" ({_share(row, key):.1%})"
        parts.append(text)
    return " / ".join(parts)


def section_mappings(data: dict[str, Any]) -> list[str]:
    """Markdown lines of the mappings job.

    Parameters
    ----------
    data : dict
        The document ``benchmarks/bench_mappings.py --json`` writes.
    """
    rows = data["rows"]
    sizes = sorted({r["bytes"] for r in rows})
    ops = list(dict.fromkeys(r["op"] for r in rows))
    cell = {(r["op"], r["bytes"]): r for r in rows}
    lines = ["## Mappings and collectives vs raw mpi4py",
             "",
             f"{data.get('ranks')} ranks, {data.get('dtype')}, median of {data.get('repeats')} "
             f"interleaved samples; {data.get('mpi')}. *raw* is the same operation written by "
             "hand on the same buffers (mpi4py uppercase call plus any NumPy packing the layout "
             "needs); ratio = pympar / raw.",
             ""]
    key = [s for s in KEY_SIZES if s in sizes]
    if key:
        header = ["operation"] + [f"{show_size(s)}: raw us / pympar us / ratio" for s in key]
        body = []
        for op in ops:
            line = [op]
            for s in key:
                r = cell.get((op, s))
                line.append("" if r is None else
                            f"{r['raw_us']:.1f} / {r['pympar_us']:.1f} / {r['ratio']:.2f}")
            body.append(line)
        lines += table(header, body) + [""]
    lines += ["Ratio pympar / raw at every size:", ""]
    body = [[op] + [f"{cell[(op, s)]['ratio']:.2f}" if (op, s) in cell else "" for s in sizes]
            for op in ops]
    lines += table(["operation"] + [show_size(s) for s in sizes], body) + [""]
    check_sizes = [s for s in (2 ** 10, 2 ** 20) if s in sizes]
    checked = [op for op in ops
               if all(cell.get((op, s), {}).get("communicates", True) for s in check_sizes)]
    if check_sizes and checked and any(r.get("floor_us") is not None for r in rows):
        lines += ["The default agreement check: *check* = pympar with it minus pympar without "
                  "it; *floor* = raw code after a bare handshake (one word per rank in shared "
                  "memory, written then polled, no pympar code) minus raw code alone: the least "
                  "any check made before the data call costs. Medians of paired samples, in "
                  "microseconds; at 1 MiB also as a share of the pympar call.", ""]
        body = [[op] + [_check_cell(cell.get((op, s))) for s in check_sizes] for op in checked]
        lines += table(["operation"] + [f"{show_size(s)}: check / floor" for s in check_sizes],
                       body) + [""]
    return lines + _targets(rows) + [""]


def section_mappings_ab(data: dict[str, Any]) -> list[str]:
    """Markdown lines of ``benchmarks/bench_mappings_ab.py --json``: before and after.

    Parameters
    ----------
    data : dict
        The document ``bench_mappings_ab.py`` writes (rows with ``before_*``/``after_*``).
    """
    rows = [r for r in data["rows"] if r.get("after_check_us") is not None]
    lines = ["## Mappings before and after (A/B in one window)", "",
             f"{data.get('ranks')} ranks, {data.get('dtype')}; *before* is commit "
             f"`{data.get('base')}`, *after* this tree, each running its own "
             f"`bench_mappings.py` in its own job, alternating over {data.get('rounds')} rounds "
             f"(medians over rounds of medians of {data.get('repeats')}; "
             f"{data.get('seconds')} s). *extra* = pympar - raw, *check* = the agreement "
             "check's cost, *floor* = the bare handshake; microseconds.", ""]
    sides = ("before", "after")

    def cell(row: dict[str, Any], name: str) -> str:
        return " / ".join("n/a" if row[f"{s}_{name}"] is None else f"{row[f'{s}_{name}']:.2f}"
                          for s in sides)
    body = [[r["op"], show_size(r["bytes"])] + [cell(r, n) for n in ("extra_us", "check_us",
                                                                        "floor_us")]
            for r in rows]
    lines += table(["operation", "size", "extra before / after", "check before / after",
                    "floor before / after"], body) + [""]
    for nbytes in sorted({r["bytes"] for r in rows}):
        at = [r for r in rows if r["bytes"] == nbytes and r.get("communicates", True)]
        for name, what in (("extra_us", "pympar - raw"), ("check_us", "the check's cost")):
            paired = [r for r in at if r[f"before_{name}"] is not None]
            diffs = [r[f"after_{name}"] - r[f"before_{name}"] for r in paired]
            spreads = [r[f"after_{name}_spread"] for r in paired
                       if r.get(f"after_{name}_spread") is not None]
            if diffs:
                noise = (f"; a row's spread over rounds: median "
                         f"{statistics.median(spreads):.2f} us" if spreads else "")
                lines.append(f"- target {what} no worse than before at {show_size(nbytes)}: "
                             f"median change {statistics.median(diffs):+.2f} us over "
                             f"{len(diffs)} rows ({sum(d > 0 for d in diffs)} higher{noise}), "
                             f"{verdict(statistics.median(diffs) <= 0)}")
    return lines + [""]
