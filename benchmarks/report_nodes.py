"""The section of ``results.md`` on the jobs across two emulated nodes (private to
:mod:`benchmarks.report`): the all-reduce's and the halo exchange's ratios to raw mpi4py in
the same job, with the targets of a crossing."""

from __future__ import annotations

from typing import Any

from benchmarks.report_format import show_size, table

#: pympar / raw mpi4py at most, across two nodes: all_reduce at 1 KiB on 2 ranks (one a
#: node), at 1 MiB, and at 1 KiB on 4 ranks sharing 2 cores; a halo exchange.
ALL_REDUCE_TARGETS = {(2, 1024): 2.0, (2, 1 << 20): 1.05, (4, 1024): 3.0}
HALO_TARGET = 1.10


def section_nodes(mappings: list[dict[str, Any]], halo: dict[str, Any] | None) -> list[str]:
    """Markdown lines of ``mappings_2nodes*.json`` (``mappings``) and ``halo_2nodes.json``."""
    lines = ["## Across two emulated nodes", "",
             "MPICH's `MPIR_CVAR_ODD_EVEN_CLIQUES=1`: even and odd ranks on two \"nodes\" of "
             "this machine, so every group spanning both checks with the hierarchical board "
             "(each node's shared words, one 8-byte exchange among the nodes' leaders) and "
             "the halo exchange with its neighbours by messages. Ratios to raw mpi4py on the "
             "same buffers, in the same job (medians of interleaved pairs).", ""]
    rows, missed = [], []
    for data in mappings:
        for r in data["rows"]:
            if r["op"] not in ("all_reduce", "all_gather axis 0", "reduce_scatter axis 0",
                               "gather_from_sequence", "reduce_from_all"):
                continue
            target = ALL_REDUCE_TARGETS.get((data["ranks"], r["bytes"])) \
                if r["op"] == "all_reduce" else None
            if target is not None and r["ratio"] > target:
                missed.append(f"all_reduce {show_size(r['bytes'])} on {data['ranks']} ranks")
            rows.append([f"{data['ranks']} ranks, {data.get('nodes')} nodes", r["op"],
                         show_size(r["bytes"]), f"{r['raw_us']:.1f}", f"{r['pympar_us']:.1f}",
                         f"{r['ratio']:.2f}", "" if target is None else f"<= {target:g}",
                         f"{r['check_us']:.1f}"])
    if rows:
        lines += table(["job", "operation", "per rank", "raw us", "pympar us", "ratio",
                        "target", "check us"], rows) + [""]
    if halo:
        cases = halo.get("cases", [])
        # The anchor is the faster of the raw codes (Sendrecv of datatypes, or packed).
        lines += table(["field (parts)", "boundary", "faces", "pympar us", "raw us",
                        "raw code", "pympar / raw", "target"],
                       [["x".join(map(str, c["shape"])) + f" {c['layout']} "
                         f"({'x'.join(map(str, c['parts']))})",
                         "periodic" if c["boundary"] == "all" else "walls",
                         show_size(c["face_bytes_max"]), f"{c['median_us']['pympar']:.1f}",
                         f"{c['median_us'][c['anchor']]:.1f}",
                         c["anchor"].removeprefix("raw_"), f"{c['ratio']:.3f}",
                         f"<= {HALO_TARGET:g}"] for c in cases]) + [""]
        missed += [f"halo {'x'.join(map(str, c['shape']))} {c['layout']}" for c in cases
                   if c["ratio"] > HALO_TARGET]
    lines += [f"Targets: {'met' if not missed else 'missed by ' + ', '.join(missed)}.", ""]
    return lines
