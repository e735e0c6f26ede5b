"""Report section of ``halo.json``: pympar's halo exchange against raw mpi4py, and PETSc.

:func:`section_halo` takes the job's JSON document and returns markdown lines; its target
line ends in "met" or "missed". The PETSc job that ``bench_halo.py`` runs under another MPI
(``petsc_job`` in the document) gets a table of its own, beside: its ratios pair variants of
that job only.
"""

from __future__ import annotations

from typing import Any

from benchmarks.report_format import show_size, table, verdict

#: pympar HaloExchange.exchange time / the faster raw mpi4py Sendrecv code of the same
#: faces (issues 22 and 39).
HALO_TARGET = 1.05
_BOUNDARY = {"all": "periodic", "none": "walls", "split": "periodic split axes"}


def case_name(c: dict[str, Any]) -> str:
    """``"1024x1024 last (1x2) periodic"``: shape, layout, parts, boundary."""
    return ("x".join(map(str, c["shape"])) + f" {c['layout']} "
            f"({'x'.join(map(str, c['parts']))}) {_BOUNDARY.get(c.get('boundary'), '')}"
            ).rstrip()


def mpi_name(machine: dict[str, Any]) -> str:
    """The MPI library in a few words: ``"MPICH Version: 5.0.2"``, ``"Open MPI v4.1.4"``."""
    return " ".join(str(machine.get("mpi", "")).split(",")[0].split())


def _us(t: dict[str, float], name: str) -> str:
    return f"{t[name]:.1f}" if name in t else "-"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _main_table(cases: list[dict[str, Any]]) -> list[str]:
    rows = []
    for c in cases:
        t = c["median_us"]
        rows.append([case_name(c), show_size(c["face_bytes_max"]),
                     *(_us(t, n) for n in ("pympar", "raw_sendrecv", "raw_packed",
                                           "pympar_subarray", "pympar_packed", "raw_neighbor",
                                           "pympar_adjoint")),
                     c.get("anchor", "raw_sendrecv").removeprefix("raw_"),
                     _ratio(c["ratio"]), _ratio(c.get("neighbor_over_sendrecv"))])
    return table(["field (parts) boundary", "faces", "pympar", "raw Sendrecv",
                  "raw packed", "pympar subarray", "pympar packed", "raw Neighbor_alltoallw",
                  "pympar adjoint", "anchor", "pympar / anchor", "neighbor / Sendrecv"], rows)


def _petsc_lines(job: dict[str, Any] | None) -> list[str]:
    """The PETSc job's table, or the line saying why there is none."""
    if not job:
        return []
    if "skipped" in job or not job.get("petsc"):
        return ["", f"PETSc: no figures ({job.get('skipped', 'petsc4py did not import')})."]
    machine = job.get("machine", {})
    petsc = f"PETSc {job['petsc']}" if isinstance(job.get("petsc"), str) else "PETSc"
    lines = ["", "### Beside PETSc", "",
             f"The same cases in a job of their own under {mpi_name(machine) or 'another MPI'} "
             f"(Python {machine.get('python')}, NumPy {machine.get('numpy')}, mpi4py "
             f"{machine.get('mpi4py')}), where petsc4py imports: {petsc}'s DMDA of the same "
             "shape, split, boundaries and stencil width (box stencil), its ghost update "
             "`globalToLocal` (the local vector from the global one: the interior is "
             "copied too) and `localToLocal` in place (from local vectors into the same "
             "one, as pympar's exchange; where its time grows with the block rather than "
             "the faces it moves the interior too). Ratios pair variants of that job only.", ""]
    rows = []
    for c in job.get("cases", []):
        t = c["median_us"]
        rows.append([case_name(c), show_size(c["face_bytes_max"]),
                     *(_us(t, n) for n in ("pympar", "raw_sendrecv", "raw_packed",
                                           "petsc_global_to_local", "petsc_local_to_local")),
                     _ratio(c["ratio"]), _ratio(c.get("petsc_global_to_local_over_raw")),
                     _ratio(c.get("petsc_local_to_local_over_raw"))])
    lines += table(["field (parts) boundary", "faces", "pympar", "raw Sendrecv",
                    "raw packed", "PETSc globalToLocal", "PETSc localToLocal",
                    "pympar / anchor", "globalToLocal / anchor", "localToLocal / anchor"],
                   rows)
    cases = job.get("cases", [])
    if cases:
        worst = max(cases, key=lambda c: c["ratio"])
        lines += ["", f"- under this MPI (not judged): pympar / anchor worst "
                  f"{worst['ratio']:.3f} ({case_name(worst)}), "
                  f"{sum(c['ratio'] <= HALO_TARGET for c in cases)} of {len(cases)} "
                  f"within {HALO_TARGET}"]
    return lines


def section_halo(data: dict[str, Any]) -> list[str]:
    """The halo table, the target line (every case must meet it) and PETSc's table."""
    cases = data.get("cases", [])
    lines = ["## Halo exchange", "",
             f"{data.get('ranks')} ranks, {mpi_name(data.get('machine', {}))}, float64, "
             f"ghosts of width {data.get('args', {}).get('width')}, corners included; "
             "*periodic*: every axis wraps (an axis not split wraps onto the rank itself), "
             "*walls*: none does. Median of the slowest rank's time per exchange (us). "
             "*faces* = bytes one rank sends per exchange (largest rank). *raw Sendrecv*: "
             "plain mpi4py, a strided face as a subarray datatype; *raw packed*: the same "
             "with strided faces copied through reused buffers (shown where some face is "
             "strided); both wrap an axis that is not split with two slice copies. The "
             "*anchor* is the faster of the two; the ratios are the median over rounds of "
             "the two times in the same round (the times drift between runs, a round's "
             "samples run side by side).", ""]
    lines += _main_table(cases)
    if cases:
        worst = max(cases, key=lambda c: c["ratio"])
        missed = [c for c in cases if c["ratio"] > HALO_TARGET]
        lines += ["", f"- target pympar exchange <= {HALO_TARGET} x the faster raw mpi4py "
                  f"Sendrecv code of the same faces, every case: worst {worst['ratio']:.3f} "
                  f"({case_name(worst)}), {len(cases) - len(missed)} of {len(cases)} "
                  f"within, {verdict(not missed)}"]
    return lines + _petsc_lines(data.get("petsc_job")) + [""]
