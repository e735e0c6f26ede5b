"""Report section of ``halo.json``: pympar's halo exchange against raw mpi4py.

:func:`section_halo` takes the job's JSON document and returns markdown lines; its target
line ends in "met" or "missed".
"""

from __future__ import annotations

from typing import Any

from benchmarks.report_format import show_size, table, verdict

#: pympar HaloExchange.exchange time / raw mpi4py Sendrecv of the same faces (issue 22).
HALO_TARGET = 1.05


def section_halo(data: dict[str, Any]) -> list[str]:
    """The halo table and the target line (every case must meet it)."""
    cases = data.get("cases", [])
    lines = ["## Halo exchange", "",
             f"{data.get('ranks')} ranks, float64, periodic along the split axes, ghosts of "
             f"width {data.get('args', {}).get('width')}; median of the slowest rank's time "
             "per exchange (us). *faces* = bytes one rank sends per exchange (largest rank). "
             "The ratios are the median over rounds of the two times in the same round (the "
             "times drift between runs, a round's samples run side by side).",
             ""]
    names = ("pympar", "pympar_packed", "raw_sendrecv", "raw_neighbor", "pympar_adjoint")
    rows = []
    for c in cases:
        t = c["median_us"]
        rows.append(["x".join(map(str, c["shape"])) + f" {c['layout']} "
                     f"({'x'.join(map(str, c['parts']))})", show_size(c["face_bytes_max"]),
                     *(f"{t[n]:.1f}" for n in names), f"{c['ratio']:.3f}",
                     f"{c['neighbor_over_sendrecv']:.3f}"])
    lines += table(["field (parts)", "faces", "pympar", "pympar packed", "raw Sendrecv",
                    "raw Neighbor_alltoallw", "pympar adjoint", "pympar / raw",
                    "neighbor / Sendrecv"], rows)
    if cases:
        worst = max(cases, key=lambda c: c["ratio"])
        missed = [c for c in cases if c["ratio"] > HALO_TARGET]
        lines += ["", f"- target pympar exchange <= {HALO_TARGET} x raw mpi4py Sendrecv of "
                  f"the same faces, every case: worst {worst['ratio']:.3f} "
                  f"({'x'.join(map(str, worst['shape']))} {worst['layout']}), "
                  f"{len(cases) - len(missed)} of {len(cases)} within, "
                  f"{verdict(not missed)}"]
    return lines + [""]
