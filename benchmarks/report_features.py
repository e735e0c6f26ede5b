"""Report sections and plots of ``memory.json``, ``attention.json`` and ``checkpoint.json``.

Each ``section_*`` takes the job's JSON document and returns markdown lines; every target
line ends in "met" or "missed". :func:`plots` draws ``attention_memory.png`` and
``checkpoint.png``.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from benchmarks.report_format import show_size, table, verdict

#: ZeRO step time / unsharded step time at DP=2 (issue 9).
ZERO_STEP_TARGET = 1.1
#: Burgers bf16 validation error / fp32 validation error (issue 10).
BF16_ERROR_TARGET = 1.5
#: Peak cached activations without / with recompute (issue 10).
RECOMPUTE_TARGET = 2.0
#: Zig-zag causal ring at CP=4: (max - min) / mean of the per-rank compute time.
ZIGZAG_SPREAD_TARGET = 0.10
#: pympar save GB/s / disk write GB/s (same bytes, one process, fsync).
SAVE_VS_DISK_TARGET = 0.8
#: pympar save GB/s / torch DCP save GB/s.
SAVE_VS_DCP_TARGET = 1.0
#: Load time under another layout / load time under the layout saved.
OTHER_LAYOUT_TARGET = 1.5
#: Issue 24: a load (either layout) at least as fast as torch DCP's, and at least 0.9x a raw
#: read of this rank's share of the same files into preallocated arrays.
LOAD_VS_DCP_TARGET = 1.0
LOAD_VS_RAW_TARGET = 0.9

KINDS = ("parameters", "gradients", "optimizer", "activations")


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2 ** 20:.2f}"


def _off(measured: dict[str, float], formula: dict[str, float]) -> str:
    """``"equal"``, or the largest difference measured - formula over the kinds."""
    diffs = [measured[k] - formula[k] for k in formula if k in measured]
    worst = max(diffs, key=abs, default=0.0)
    return "equal" if worst == 0 else f"off by {worst:+,.0f} B"


# --------------------------------------------------------------------------- memory


def section_memory(data: dict[str, Any]) -> list[str]:
    """``memory.json``: bytes per rank vs formula, ZeRO step time, the Burgers runs."""
    lines = ["## Memory per rank: ZeRO, bf16, recompute (MLP H -> 4H -> H, AdamW)", "",
             "Largest per-rank bytes that `pympar.memory` counts after one step (activations: "
             "cached after forward), as *measured / formula* in MiB; the formulas are in "
             "benchmarks/bench_memory.py. Step times: median of "
             f"{data.get('repeats')} interleaved rounds, one BLAS thread per rank.", ""]
    if data.get("torch_skipped"):
        lines += [f"torch variants skipped: {data['torch_skipped']}", ""]
    for row in data.get("rows", []):
        lines += [f"### H={row['hidden']}, T={row['tokens']} tokens per rank, "
                  f"DP={row['ranks']}", ""]
        body = [[e["config"], f"{e['params']:,}"]
                + [f"{_mib(e['measured'][k])} / {_mib(e['formula'][k])}" for k in KINDS]
                + [_off(e["measured"], e["formula"])] for e in row["memory"]]
        lines += table(["configuration", "parameters N"] + [f"{k} (MiB)" for k in KINDS]
                       + ["measured vs formula"], body) + [""]
        body = [[name, f"{ms:.2f}"] for name, ms in row["step_ms"].items()]
        lines += table(["step (forward, backward, gradient sync, AdamW)", "median ms"],
                       body) + [""]
        ratio = row["ratio_zero_over_allreduce"]
        lines.append(f"- target ZeRO step <= {ZERO_STEP_TARGET} x unsharded step at "
                     f"DP={row['ranks']}: {ratio:.3f}, {verdict(ratio <= ZERO_STEP_TARGET)}")
        if "ratio_pympar_zero_over_torch_zero" in row:
            lines.append("- pympar ZeRO / torch ZeroRedundancyOptimizer step: "
                         f"{row['ratio_pympar_zero_over_torch_zero']:.3f} (no target)")
        for name, nbytes in row.get("torch_optimizer_bytes", {}).items():
            lines.append(f"- {name} optimizer state: {show_size(nbytes)} per rank")
        lines.append("")
    if data.get("burgers"):
        lines += _burgers(data["burgers"], data.get("burgers_steps"))
    return lines


def _burgers(rows: list[dict[str, Any]], steps: Any) -> list[str]:
    lay = rows[0]["layout"]
    lines = [f"### Burgers example, {steps} steps per configuration, dp={lay['dp']} "
             f"cp={lay['cp']} tp={lay['tp']} ({lay['mode']})", "",
             "Validation relative L2 error, median step time, and the largest per-rank bytes "
             "(*measured / formula* MiB; activations: the peak cached during a step).", ""]
    body = [[r["config"], f"{r['val_rel_l2']:.3e}", f"{r['step_ms']:.2f}"]
            + [f"{_mib(r['measured'][k])} / {_mib(r['formula'][k])}"
               for k in ("parameters", "gradients", "optimizer")]
            + [_mib(r["measured"]["activations"]), f"{r['measured']['peak_rss'] / 2 ** 20:.0f}"]
            for r in rows]
    lines += table(["configuration", "val error", "step ms", "parameters (MiB)",
                    "gradients (MiB)", "optimizer (MiB)", "activations (MiB)",
                    "peak RSS (MiB)"], body) + [""]
    by = {r["config"]: r for r in rows}
    base = by.get("fp32")
    if base and "bf16" in by:
        ratio = by["bf16"]["val_rel_l2"] / base["val_rel_l2"]
        lines.append(f"- target bf16 validation error <= {BF16_ERROR_TARGET} x fp32's: "
                     f"{ratio:.3f}, {verdict(ratio <= BF16_ERROR_TARGET)}")
    if base and "recompute" in by:
        rec = by["recompute"]
        lower = base["measured"]["activations"] / max(rec["measured"]["activations"], 1)
        lines.append(f"- target peak activations with recompute >= {RECOMPUTE_TARGET}x lower: "
                     f"{lower:.3f}x lower, {verdict(lower >= RECOMPUTE_TARGET)}")
        lines.append(f"- recompute step time / fp32 step time: "
                     f"{rec['step_ms'] / base['step_ms']:.3f} (the price; no target)")
    return lines + [""]


# --------------------------------------------------------------------------- attention


def _memory_points(memory: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """``{"ring S=4096": bytes, ...}`` -> ``{"ring": [(4096, bytes), ...]}`` sorted by S."""
    points: dict[str, list[tuple[int, float]]] = {}
    for key, nbytes in memory.get("peak_bytes_max_over_ranks", {}).items():
        match = re.fullmatch(r"(\w+) S=(\d+)", key)
        if match:
            points.setdefault(match[1], []).append((int(match[2]), nbytes))
    return {k: sorted(v) for k, v in points.items()}


def section_attention(data: dict[str, Any]) -> list[str]:
    """``attention.json``: bytes vs formula, time at CP=2, peak memory vs S, zig-zag spread."""
    a = data.get("args", {})
    lines = ["## Context-parallel attention: ring vs Ulysses (float32, forward + backward)", "",
             f"S={a.get('seq')}, batch {a.get('batch')}, hidden {a.get('hidden')}, "
             f"{a.get('heads')} heads; formulas in benchmarks/bench_attention.py.", ""]
    b = data.get("bytes")
    if b and b.get("per_rank"):
        body = [[r["rank"], f"{r['measured']['ring']:,.0f}", f"{r['formula']['ring']:,.0f}",
                 f"{r['measured']['ulysses']:,.0f}", f"{r['formula']['ulysses']:,.0f}"]
                for r in b["per_rank"]]
        lines += [f"Bytes per rank that `pympar.stats` counts at CP={b['cp']}:", ""]
        lines += table(["rank", "ring measured", "ring formula", "Ulysses measured",
                        "Ulysses formula"], body) + [""]
        lines += [f"- measured == formula on every rank, both schemes: "
                  f"{'yes' if b['equal'] else 'NO'}", ""]
    t = data.get("time")
    if t:
        ms = t["median_ms"]
        lines.append(f"- time at CP={t['cp']}, median of {a.get('repeats')}: ring "
                     f"{ms['ring']:.1f} ms, Ulysses {ms['ulysses']:.1f} ms, ring / Ulysses "
                     f"{ms['ring'] / ms['ulysses']:.3f} (no target)")
    points = _memory_points(data.get("memory") or {})
    if points:
        lines += ["", f"Peak NumPy bytes per rank (tracemalloc, largest rank) at "
                      f"CP={data['memory']['cp']}:", ""]
        seqs = sorted({s for pts in points.values() for s, _ in pts})
        body = []
        for scheme, pts in points.items():
            got = dict(pts)
            grow = (f"{pts[-1][1] / pts[0][1]:.2f}x for {pts[-1][0] // pts[0][0]}x S"
                    if len(pts) > 1 and pts[0][1] else "")
            body.append([scheme] + [show_size(got[s]) if s in got else "" for s in seqs] + [grow])
        lines += table(["scheme"] + [f"S={s}" for s in seqs] + ["growth"], body) + [""]
    z = data.get("zigzag")
    if z:
        lines += [f"Causal ring at CP={z['cp']}, per-rank compute time in the block kernels "
                  "(median ms per rank; spread = (max - min) / mean):", ""]
        body = [[layout, " / ".join(f"{v:.1f}" for v in z[layout]["compute_ms"]),
                 f"{100 * z[layout]['spread']:.1f} %"]
                for layout in ("contiguous", "zigzag") if layout in z]
        lines += table(["order", "per-rank ms", "spread"], body) + [""]
        if "zigzag" in z:
            s = z["zigzag"]["spread"]
            lines.append(f"- target zig-zag spread <= {100 * ZIGZAG_SPREAD_TARGET:.0f} % "
                         f"(contiguous: {100 * z['contiguous']['spread']:.1f} %): "
                         f"{100 * s:.1f} %, {verdict(s <= ZIGZAG_SPREAD_TARGET)}")
    elif data.get("bytes"):
        lines.append("- zig-zag spread: not measured (needs 4 ranks)")
    return lines + [""]


# --------------------------------------------------------------------------- checkpoint

CHECKPOINT_VARIANTS = ("disk write", "disk write, a file per rank", "disk read, cold",
                       "raw read into preallocated arrays",
                       "raw copy from a mapping into preallocated arrays",
                       "raw read and hash into preallocated arrays", "pympar save",
                       "pympar load same layout", "pympar load other layout", "torch DCP save",
                       "torch DCP load")

#: The raw reads shown beside the load without a target, and what each does.
_SHOWN_ANCHORS = (
    ("raw_copy", "a raw copy from a mapping into preallocated arrays (no target; the other "
                 "way to read the same bytes, no checksum, no layout)"),
    ("raw_verified", "a raw read and hash into preallocated arrays (no target; the same bytes "
                     "read and hashed as the load's checksum hashes them, no layout)"))


def section_checkpoint(data: dict[str, Any]) -> list[str]:
    """``checkpoint.json``: GB/s per rank count against the disk and torch DCP."""
    results = data.get("results", [])
    lines = ["## Checkpoint save and load (model + AdamW state, float32)", "",
             f"Median of {data.get('repeats')} interleaved rounds; rate = state bytes / seconds "
             "of the slowest rank. *disk write*: one process, same bytes, 8 MiB writes and "
             "fsync. *disk read, cold*: one process reads that file into one array after "
             "dropping it from the page cache (the disk's read). *raw read into preallocated "
             "arrays*: every rank reads its 1/ranks share of each of the checkpoint's files "
             "from the page cache into arrays of those sizes, one `preadv` per file, at once "
             "(no checksum, no layout). *raw copy from a mapping*: the same shares copied with "
             "one `numpy.copyto` each out of a read-only `mmap` of the file; the faster of the "
             "two is what a load must at least do. *raw read and hash*: the same shares "
             "read in 1 MiB pieces, each hashed with xxHash3-64 right after it is read: what "
             "a load that verifies every byte it reads must at least do. The loads read from the "
             "page cache too (right after a save). Every writing variant starts right after "
             "its previous output was deleted and synced; the ratios below are medians over "
             "rounds of the ratio within a round, each against the anchor named.", ""]
    if not results:
        return lines + ["No results.", ""]
    shown = [v for v in CHECKPOINT_VARIANTS if any(v in r["gbps"] for r in results)]
    body = [[v] + [f"{r['gbps'][v]:.2f}" if v in r["gbps"] else "" for r in results]
            for v in shown]
    body.append(["peak extra memory per rank, save / load"]
                + [f"{show_size(r['peak_extra_bytes']['save'])} / "
                   f"{show_size(r['peak_extra_bytes']['load'])}" for r in results])
    lines += table(["GB/s"] + [f"{r['ranks']} rank(s), {show_size(r['state_bytes'])}"
                               for r in results], body) + [""]
    for r in data.get("ratios", []):
        n = r["ranks"]
        lines.append(f"- {n} rank(s): target save >= {SAVE_VS_DISK_TARGET} x disk write (anchor: "
                     "one process writing the same bytes, no layout, no checksum): "
                     f"{r['save_vs_disk_write']:.2f}, "
                     f"{verdict(r['save_vs_disk_write'] >= SAVE_VS_DISK_TARGET)}")
        if "save_vs_disk_every_rank" in r:
            ceiling = f"- {n} rank(s): against a file per rank written at once (no target; " \
                "anchor: each rank writes its share to a file of its own and fsyncs it): " \
                f"pympar save {r['save_vs_disk_every_rank']:.2f}"
            if "torch_dcp_vs_disk_every_rank" in r:
                ceiling += f", torch DCP save {r['torch_dcp_vs_disk_every_rank']:.2f}"
            lines.append(ceiling)
        if "save_vs_torch_dcp" in r:
            lines.append(f"- {n} rank(s): target save >= {SAVE_VS_DCP_TARGET} x torch DCP save "
                         "(anchor: each rank writes its own shards to files of its own, no "
                         "serial layout, no checksum): "
                         f"{r['save_vs_torch_dcp']:.2f}, "
                         f"{verdict(r['save_vs_torch_dcp'] >= SAVE_VS_DCP_TARGET)}")
            for key, layout in (("load_vs_torch_dcp", "same"),
                                ("load_other_vs_torch_dcp", "other")):
                if key in r:
                    lines.append(f"- {n} rank(s): target load, {layout} layout, >= "
                                 f"{LOAD_VS_DCP_TARGET} x torch DCP load (anchor: each rank "
                                 "reads back its own shards, same layout only, no checksum): "
                                 f"{r[key]:.2f}, {verdict(r[key] >= LOAD_VS_DCP_TARGET)}")
        for layout in ("same", "other"):
            key = f"load_{layout}_vs_raw_read"
            if key in r:
                lines.append(f"- {n} rank(s): target load, {layout} layout, >= "
                             f"{LOAD_VS_RAW_TARGET} x raw read into preallocated arrays (anchor: "
                             "the same bytes per rank from the page cache, no checksum, no "
                             f"layout): {r[key]:.2f}, {verdict(r[key] >= LOAD_VS_RAW_TARGET)}")
            for anchor, what in _SHOWN_ANCHORS:
                key = f"load_{layout}_vs_{anchor}"
                if key in r:
                    lines.append(f"- {n} rank(s): load, {layout} layout, against {what}: "
                                 f"{r[key]:.2f}")
        # The JSON's ratio is same-layout GB/s over other-layout GB/s: the time ratio.
        lines.append(f"- {n} rank(s): target load under another layout <= "
                     f"{OTHER_LAYOUT_TARGET} x the time under the saved layout: "
                     f"{r['load_other_vs_same']:.2f}, "
                     f"{verdict(r['load_other_vs_same'] <= OTHER_LAYOUT_TARGET)}")
    if not any("save_vs_torch_dcp" in r for r in data.get("ratios", [])):
        lines.append("- torch DCP: not measured (torch not installed)")
    return lines + [""]


# --------------------------------------------------------------------------- plots


def plots(plt: Any, save: Callable[[Any, str], None], attention: Any, checkpoint: Any) -> None:
    """Draw ``attention_memory.png`` and ``checkpoint.png`` for the documents given.

    Parameters
    ----------
    plt : module
        ``matplotlib.pyplot`` (Agg backend).
    save : callable
        ``save(figure, file_name)``: writes and closes the figure.
    attention, checkpoint : dict or None
        The JSON documents; None skips that plot.
    """
    points = _memory_points((attention or {}).get("memory") or {})
    if points:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for i, (scheme, pts) in enumerate(points.items()):
            s = [p[0] for p in pts]
            ax.plot(s, [p[1] / 2 ** 20 for p in pts], "-o", color=f"C{i}", label=scheme)
            # Where linear growth from the first point would land: activations scale with S.
            ax.plot(s, [pts[0][1] / 2 ** 20 * x / s[0] for x in s], ":", color=f"C{i}",
                    label=f"{scheme}: linear in S from the first point")
        seqs = sorted({p[0] for pts in points.values() for p in pts})
        ax.set_xticks(seqs)
        ax.set_xticklabels([str(s) for s in seqs])
        ax.set_ylim(bottom=0)
        ax.set(xlabel="sequence length S (tokens)", ylabel="peak MiB per rank (tracemalloc)",
               title=f"attention peak memory at CP={attention['memory']['cp']}")
        ax.legend(fontsize=7, loc="upper left")  # the lines rise to the right
        save(fig, "attention_memory.png")
    results = (checkpoint or {}).get("results") or []
    if results:
        fig, ax = plt.subplots(figsize=(8, 4.2))
        ranks = [r["ranks"] for r in results]
        for i, v in enumerate(CHECKPOINT_VARIANTS):
            pts = [(r["ranks"], r["gbps"][v]) for r in results if v in r["gbps"]]
            if pts:
                style = "--" if v.startswith(("disk", "raw")) else (":" if v.startswith("torch") else "-")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o",
                        color=f"C{i}", label=v)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ranks)
        ax.set_xticklabels([str(n) for n in ranks])
        # Log scale: a read from the page cache runs ~10x faster than anything that writes.
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(lambda value, _: f"{value:g}")
        ax.set(xlabel="ranks", ylabel="GB/s (state bytes / slowest rank's seconds, log)",
               title=f"checkpoint of {show_size(results[0]['state_bytes'])} "
                     "(dashed: disk and raw reads, dotted: torch DCP)")
        fig.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
        save(fig, "checkpoint.png")

