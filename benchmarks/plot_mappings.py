"""``mappings.png``: pympar's collectives and mappings against raw mpi4py, from ``mappings.json``.

Four panels: time per call and bandwidth of the main collectives (pympar solid, raw dashed,
one colour per operation, with a legend), the ratio pympar / raw over every operation that
communicates, and the absolute extra time of the local mappings. A local mapping (one whose
row says ``"communicates": false``: ``copy_to_all``, ``scatter_to_*``) is a NumPy slice or an
identity whose raw time is a fraction of a microsecond, so its ratio measures nothing but that
denominator (0.1 us raw against 1 us reads as "10x"): it is left out of the ratio band and
shown in microseconds instead.
"""

from __future__ import annotations

from typing import Any, Callable

from benchmarks.report_format import show_size

__all__ = ["SHOWN", "communicating", "plot_mappings"]

#: The collectives of the time and bandwidth panels.
SHOWN = ("all_reduce", "all_gather axis 0", "all_gather axis -1", "reduce_scatter axis 0",
         "reduce_scatter axis -1", "all_to_all seq->hidden")


def communicating(row: dict[str, Any]) -> bool:
    """Whether a row of ``mappings.json`` moves data between ranks (rows without the field do)."""
    return bool(row.get("communicates", True))


def plot_mappings(plt: Any, save: Callable[[Any, str], None], data: dict[str, Any]) -> None:
    """Draw ``mappings.png`` from the ``mappings.json`` document ``data``.

    Parameters
    ----------
    plt : module
        ``matplotlib.pyplot`` (Agg backend).
    save : callable
        ``save(figure, file_name)``: writes and closes the figure.
    data : dict
        The document; its ``rows`` have ``op``, ``bytes``, ``raw_us``, ``pympar_us``,
        ``ratio`` and optionally ``communicates``.
    """
    from matplotlib.lines import Line2D

    rows = data["rows"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.4))
    (time_ax, bw_ax), (ratio_ax, extra_ax) = axes
    drawn = []
    for i, op in enumerate(SHOWN):
        pts = sorted((r["bytes"], r["raw_us"], r["pympar_us"]) for r in rows if r["op"] == op)
        if not pts:
            continue
        b, color = [p[0] for p in pts], f"C{i}"
        drawn.append((op, color))
        time_ax.loglog(b, [p[2] for p in pts], "-o", color=color, ms=3)
        time_ax.loglog(b, [p[1] for p in pts], "--", color=color)
        bw_ax.semilogx(b, [p[0] / p[2] / 1e3 for p in pts], "-o", color=color, ms=3)
        bw_ax.semilogx(b, [p[0] / p[1] / 1e3 for p in pts], "--", color=color)
    # Colour = operation, style = pympar or raw: one legend for both top panels.
    handles = ([Line2D([], [], color=c, lw=2, label=op) for op, c in drawn]
               + [Line2D([], [], color="k", marker="o", ms=3, label="pympar"),
                  Line2D([], [], color="k", ls="--", label="raw mpi4py")])
    time_ax.legend(handles=handles, fontsize=7, loc="upper left")
    time_ax.set(xlabel="bytes per rank", ylabel="time per call (us)",
                title="time per call (solid pympar, dashed raw mpi4py)")
    bw_ax.set(xlabel="bytes per rank", ylabel="GB/s (input bytes / time)",
              title="bandwidth (colours and styles as on the left)")
    _ratio_panel(ratio_ax, [r for r in rows if communicating(r)])
    _extra_panel(extra_ax, [r for r in rows if not communicating(r)])
    save(fig, "mappings.png")


def _ratio_panel(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Median and range of pympar / raw over the operations that communicate, worst named."""
    ops = list(dict.fromkeys(r["op"] for r in rows))
    ax.set(xlabel="bytes per rank", ylabel="pympar time / raw time",
           title=f"ratio over the {len(ops)} operations that communicate (log scale)")
    if not rows:
        return
    sizes = sorted({r["bytes"] for r in rows})
    ratios = [sorted(r["ratio"] for r in rows if r["bytes"] == b) for b in sizes]
    ax.fill_between(sizes, [v[0] for v in ratios], [v[-1] for v in ratios], color="C0",
                    alpha=0.25, label=f"range over the {len(ops)} operations")
    ax.semilogx(sizes, [v[len(v) // 2] for v in ratios], "-o", color="C0", ms=3,
                label="median operation")
    worst = max(rows, key=lambda r: r["ratio"])
    ax.annotate(f"worst: {worst['op']}\n{show_size(worst['bytes'])}, {worst['ratio']:.2f}x",
                (worst["bytes"], worst["ratio"]), xytext=(0.35, 0.92),
                textcoords="axes fraction", fontsize=7, va="top",
                arrowprops={"arrowstyle": "->", "lw": 0.8})
    ax.axhline(1.0, color="k", lw=1, label="as fast as raw mpi4py")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(lambda value, _: f"{value:g}")
    ax.yaxis.set_minor_formatter(lambda value, _: f"{value:g}" if value in (2, 3, 5) else "")
    ax.legend(fontsize=7, loc="lower left")


def _extra_panel(ax: Any, rows: list[dict[str, Any]]) -> None:
    """pympar minus raw, in microseconds, for each local mapping (no communication)."""
    ax.set(xlabel="bytes per rank", ylabel="pympar time - raw time (us)",
           title="local mappings (no communication): extra time (symlog)")
    ops = list(dict.fromkeys(r["op"] for r in rows))
    if not ops:
        ax.text(0.5, 0.5, "no local mappings in this run", ha="center", transform=ax.transAxes)
        return
    for i, op in enumerate(ops):
        pts = sorted((r["bytes"], r["pympar_us"] - r["raw_us"]) for r in rows if r["op"] == op)
        ax.semilogx([p[0] for p in pts], [p[1] for p in pts], "-o", color=f"C{i + len(SHOWN)}",
                    ms=3, label=op)
    ax.axhline(0.0, color="k", lw=1)
    # Linear within 1 us, logarithmic beyond: a large copy does not flatten the others.
    ax.set_yscale("symlog", linthresh=1.0)
    ax.yaxis.set_major_formatter(lambda value, _: f"{value:g}")
    ax.legend(fontsize=7, loc="upper left")
