"""Report section of ``fft_1.json``, ``fft_2.json`` and ``fft_4.json`` (bench_fft.py).

:func:`section_fft` takes the documents by rank count and returns markdown lines; every
target line ends in "met" or "missed".
"""

from __future__ import annotations

from typing import Any

from benchmarks.report_format import show_size, table, verdict

#: pympar round trip / mpi4py-fft's best backend, per rank count (issue 22).
ROUNDTRIP_TARGETS = {1: 1.0, 2: 1.0, 4: 1.1}
#: FNO layer peak bytes per rank on 2 ranks / on 1 rank.
FNO_MEMORY_TARGET = 0.55


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _roundtrip(docs: dict[int, dict[str, Any]]) -> list[str]:
    rows, notes = [], set()
    for ranks, doc in sorted(docs.items()):
        for entry in doc.get("roundtrip", []):
            s = entry["seconds"]
            anchors = {k: v for k, v in s.items() if k.startswith("mpi4py-fft")}
            notes.update(entry.get("notes", []))
            best = min(anchors.values()) if anchors else None
            ratio = s["pympar"] / best if best else None
            target = ROUNDTRIP_TARGETS.get(ranks)
            judged = ("-" if ratio is None or target is None else
                      f"{ratio:.2f} <= {target} {verdict(ratio <= target)}")
            rows.append(["x".join(map(str, entry["shape"])), ranks,
                         f"{_ms(s['pympar'])} ({doc.get('local_library', '?')})",
                         _ms(s.get("pympar scipy.fft")), _ms(s.get("mpi4py-fft fftw")),
                         _ms(s.get("mpi4py-fft numpy")), judged])
    lines = ["### FFT round trip (r2c + c2r, float64 slab), ms", ""]
    lines += table(["shape", "ranks", "pympar (local library)", "pympar with scipy.fft",
                    "mpi4py-fft fftw", "mpi4py-fft numpy", "pympar / best anchor"], rows)
    return lines + [f"- {note}" for note in sorted(notes)] + [""]


def _bytes(docs: dict[int, dict[str, Any]]) -> list[str]:
    rows = []
    for ranks, doc in sorted(docs.items()):
        for entry in doc.get("bytes", []):
            first = entry["per_rank"][0]
            rows.append(["x".join(map(str, entry["shape"])), ranks,
                         show_size(first["measured"]["bytes_in"]),
                         show_size(first["formula"]["bytes_in"]),
                         show_size(first["formula"]["off_rank"]),
                         f"equal on every rank: {verdict(entry['equal'])}"])
    return (["### Bytes per rank of a round trip's two exchanges (rank 0 shown)", ""]
            + table(["shape", "ranks", "recorded", "formula", "leaving the rank", "target"],
                    rows) + [""])


def _transpose(docs: dict[int, dict[str, Any]]) -> list[str]:
    rows = []
    for ranks, doc in sorted(docs.items()):
        for entry in doc.get("transpose", []):
            s = entry["seconds"]
            rows.append(["x".join(map(str, entry["shape"])), ranks,
                         _ms(s.get("pympar all_to_all")), _ms(s.get("raw Alltoallw subarrays")),
                         _ms(s.get("raw pack + Alltoall")),
                         "yes" if entry.get("alltoallw_equals_pympar") else "NO"])
    return (["### The exchange alone (the forward transpose), ms", ""]
            + table(["shape", "ranks", "pympar all_to_all", "Alltoallw subarrays",
                     "pack + Alltoall", "same result"], rows) + [""])


def _local(docs: dict[int, dict[str, Any]]) -> list[str]:
    rows = []
    for ranks, doc in sorted(docs.items()):
        for entry in doc.get("local", []):
            s = entry["seconds"]
            rows.append(["x".join(map(str, entry["shape"])), ranks]
                        + [_ms(s.get(f"{lib} {what}")) for what in ("rfftn(1,2)", "fft(0)")
                           for lib in ("numpy", "scipy", "fftw")])
    return (["### Local transforms of one rank's slab, one thread, ms", ""]
            + table(["shape", "ranks", "numpy rfftn", "scipy rfftn", "fftw rfftn",
                     "numpy fft", "scipy fft", "fftw fft"], rows) + [""])


def _fno(docs: dict[int, dict[str, Any]]) -> list[str]:
    fno = {ranks: doc["fno"] for ranks, doc in docs.items() if "fno" in doc}
    if not fno:
        return []
    rows = [[ranks, _ms(f["seconds"]), show_size(f["peak_step_bytes"]),
             show_size(f["parameter_bytes"]), show_size(f["cached_activation_bytes"]),
             show_size(f["split_weight_bytes"]), show_size(f["replicated_weight_bytes"])]
            for ranks, f in sorted(fno.items())]
    any_ = next(iter(fno.values()))
    lines = [f"### FNO layer (SpectralBlock) step, batch {any_['batch']}, grid "
             f"{'x'.join(map(str, any_['grid']))}, width {any_['width']}, "
             f"{any_['modes']} modes", ""]
    lines += table(["ranks", "step ms", "peak bytes", "parameters", "cached activations",
                    "spectral weights (split by mode)", "if replicated"], rows)
    if 1 in fno and 2 in fno:
        ratio = fno[2]["peak_step_bytes"] / fno[1]["peak_step_bytes"]
        lines += ["", f"- peak bytes per rank on 2 ranks / on 1 rank: {ratio:.3f} <= "
                  f"{FNO_MEMORY_TARGET} {verdict(ratio <= FNO_MEMORY_TARGET)}"]
    return lines + [""]


def section_fft(docs: dict[int, dict[str, Any]]) -> list[str]:
    """Markdown lines of the FFT jobs, ``docs`` mapping rank counts to their JSON."""
    if not docs:
        return []
    return (["## Distributed FFT and FNO layer (bench_fft.py)", ""] + _roundtrip(docs)
            + _bytes(docs) + _transpose(docs) + _local(docs) + _fno(docs))
