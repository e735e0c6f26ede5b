#!/usr/bin/env python3
"""Draw the layout pictures of the documentation into ``docs/_static``.

    python scripts/draw_layouts.py [OUTDIR]

Every rank number in the pictures comes from :func:`pympar.mesh.group_ranks`,
the function that ``Mesh.group`` itself uses, so a picture cannot disagree with
the code. The pure functions (:func:`grid_layout`, :func:`cube_layout`,
:func:`split_blocks`) need no matplotlib; drawing imports it lazily and uses the
Agg backend. PNG files are rewritten only when their bytes change, so the docs
build (``docs/conf.py`` calls :func:`main`) leaves committed pictures untouched
when nothing moved.
"""

from __future__ import annotations

import io
import os
import sys
from typing import Mapping

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from pympar.initializer_3d import AXES_3D, MODE_AXES, ParallelMode  # noqa: E402
from pympar.mesh import group_ranks  # noqa: E402
from pympar.modules.blockwise import sequence_segments  # noqa: E402

DEFAULT_OUTDIR = os.path.join(os.path.dirname(HERE), "docs", "_static")

#: Groups shown for a DP x CP x TP layout: title -> axes the group spans.
GRID_GROUPS = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "dp-cp": ("dp", "cp")}

# Colour-blind friendly palette (Okabe and Ito), one colour per group.
PALETTE = ["#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00",
           "#CC79A7", "#999999"]


def coordinates(sizes: Mapping[str, int], order: str) -> dict[int, dict[str, int]]:
    """Return every rank's coordinate on every axis, derived from ``group_ranks``.

    A rank's coordinate on an axis is its position in its group along that
    axis, which is how :class:`pympar.mesh.Mesh` numbers group members.
    """
    coords: dict[int, dict[str, int]] = {}
    for axis in sizes:
        for row in group_ranks(sizes, order, axis):
            for position, rank in enumerate(row.tolist()):
                coords.setdefault(rank, {})[axis] = position
    return coords


def grid_layout(tp: int = 2, cp: int = 2, dp: int = 2,
                order: str = "tp-cp-dp") -> dict[str, object]:
    """Return the groups and coordinates of a DP x CP x TP layout.

    Returns
    -------
    dict
        ``"sizes"``: the axis sizes; ``"groups"``: for each of ``tp``, ``cp``,
        ``dp`` and ``dp-cp`` the list of groups, each a list of global ranks;
        ``"coords"``: rank -> {axis: coordinate}.
    """
    sizes = {"tp": tp, "cp": cp, "dp": dp}
    groups = {title: group_ranks(sizes, order, *axes).tolist()
              for title, axes in GRID_GROUPS.items()}
    return {"sizes": sizes, "order": order, "groups": groups,
            "coords": coordinates(sizes, order)}


def cube_layout(depth: int = 2) -> dict[str, object]:
    """Return the five 3D groups and the (i, j, k) of every rank of one cube.

    Returns
    -------
    dict
        ``"groups"``: mode value (e.g. ``"3d_input"``) -> list of groups;
        ``"coords"``: rank -> (i, j, k).
    """
    sizes = {axis: depth for axis in AXES_3D}
    order = "-".join(AXES_3D)
    groups = {mode.value: group_ranks(sizes, order, *axes).tolist()
              for mode, axes in MODE_AXES.items()}
    coords = {rank: tuple(c[a] for a in AXES_3D)
              for rank, c in coordinates(sizes, order).items()}
    return {"depth": depth, "groups": groups, "coords": coords}


def rank_formula(order: str) -> str:
    """The global rank in terms of the coordinates, e.g. ``tp + TP*(cp + CP*dp)``."""
    axes = order.split("-")
    formula = axes[-1]
    for axis in reversed(axes[:-1]):
        formula = f"{axis} + {axis.upper()}*({formula})"
    return formula.replace(f"({axes[-1]})", axes[-1])


def split_blocks(n: int, parts: int) -> list[range]:
    """Index ranges of the balanced split of ``n`` items over ``parts`` ranks.

    The first ``n % parts`` ranks hold one item more, as ``numpy.array_split``.
    """
    return [range(int(b[0]), int(b[-1]) + 1) if len(b) else range(0)
            for b in np.array_split(np.arange(n), parts)]


# --------------------------------------------------------------------------- drawing

def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, with the pictures' font size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": 9, "svg.hashsalt": "pympar"})
    return plt


def save_png(fig, path: str, dpi: float | None = 90) -> bool:
    """Lay out and close ``fig``; write it as PNG (at ``dpi``; None: the figure's own)
    unless ``path`` already holds these bytes. No software tag: the bytes depend only on
    the picture, so an unchanged picture leaves its file alone."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi or fig.dpi, metadata={"Software": None})
    plt.close(fig)
    data = buffer.getvalue()
    try:
        with open(path, "rb") as old:
            if old.read() == data:
                return False
    except OSError:
        pass
    with open(path, "wb") as out:
        out.write(data)
    return True


def draw_grid(path: str, tp: int = 2, cp: int = 2, dp: int = 2,
              order: str = "tp-cp-dp") -> bool:
    """Draw the ranks of a DP x CP x TP layout, one panel per kind of group."""
    plt = pyplot()
    from matplotlib.patches import FancyBboxPatch

    layout = grid_layout(tp, cp, dp, order)
    groups, coords = layout["groups"], layout["coords"]
    fig, axes = plt.subplots(1, len(groups), figsize=(3.0 * len(groups), 2.9))
    for ax, (title, members) in zip(axes, groups.items()):
        colour = {rank: PALETTE[g % len(PALETTE)]
                  for g, row in enumerate(members) for rank in row}
        for rank, c in coords.items():
            # tp across, cp up, one block per dp index with a gap between blocks.
            x = c["tp"] + (tp + 0.6) * c["dp"]
            y = cp - 1 - c["cp"]
            ax.add_patch(FancyBboxPatch((x + 0.06, y + 0.06), 0.88, 0.88,
                                        boxstyle="round,pad=0,rounding_size=0.12",
                                        facecolor=colour[rank], edgecolor="black", lw=0.8))
            ax.text(x + 0.5, y + 0.58, str(rank), ha="center", va="center",
                    fontsize=13, weight="bold")
            ax.text(x + 0.5, y + 0.22, f"({c['tp']},{c['cp']},{c['dp']})",
                    ha="center", va="center", fontsize=7)
        for d in range(dp):
            ax.text((tp + 0.6) * d + tp / 2, cp + 0.15, f"dp = {d}", ha="center",
                    va="bottom", fontsize=8, color="0.3")
        listing = " ".join("[" + ",".join(map(str, row)) + "]" for row in members)
        ax.set_title(f"{title} groups\n{listing}", fontsize=9)
        ax.set_xlim(-0.2, (tp + 0.6) * dp - 0.4)
        ax.set_ylim(-0.55, cp + 0.6)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.annotate("", xy=(tp - 0.05, -0.35), xytext=(0.05, -0.35),
                    arrowprops={"arrowstyle": "->", "color": "0.3"})
        ax.text(tp / 2, -0.5, "tp", ha="center", va="top", fontsize=8, color="0.3")
    fig.suptitle(f"{tp * cp * dp} ranks, tp={tp} cp={cp} dp={dp}, order \"{order}\": "
                 f"global rank = {rank_formula(order)}; (tp, cp, dp) under each rank",
                 fontsize=10)
    return save_png(fig, path)


def _project(i: float, j: float, k: float) -> tuple[float, float]:
    """Oblique projection of cube coordinates: i right, j up, k into the page."""
    return i + 0.55 * k, j + 0.4 * k


def draw_cube(path: str, depth: int = 2) -> bool:
    """Draw one 3D tensor-parallel cube and its five kinds of groups."""
    plt = pyplot()
    layout = cube_layout(depth)
    coords = layout["coords"]
    titles = {
        ParallelMode.PARALLEL_3D_INPUT.value: "input: j varies",
        ParallelMode.PARALLEL_3D_WEIGHT.value: "weight: i varies",
        ParallelMode.PARALLEL_3D_OUTPUT.value: "output: k varies",
        ParallelMode.PARALLEL_3D_INPUT_X_WEIGHT.value: "input x weight: (i, j)",
        ParallelMode.PARALLEL_3D_OUTPUT_X_WEIGHT.value: "output x weight: (i, k)",
    }
    fig, axes = plt.subplots(1, len(titles), figsize=(2.55 * len(titles), 3.1))
    span = depth - 1
    for ax, (mode, title) in zip(axes, titles.items()):
        members = layout["groups"][mode]
        # Cube edges in light grey.
        for a in range(depth):
            for b in range(depth):
                for line in (((0, a, b), (span, a, b)), ((a, 0, b), (a, span, b)),
                             ((a, b, 0), (a, b, span))):
                    (x0, y0), (x1, y1) = (_project(*p) for p in line)
                    ax.plot([x0, x1], [y0, y1], color="0.85", lw=0.8, zorder=1)
        for g, row in enumerate(members):
            colour = PALETTE[g % len(PALETTE)]
            points = [_project(*coords[r]) for r in row]
            if len(row) == depth:   # a line: join its ends
                ax.plot([points[0][0], points[-1][0]], [points[0][1], points[-1][1]],
                        color=colour, lw=4, alpha=0.8, zorder=2, solid_capstyle="round")
            else:                   # a plane: fill its outline
                corners = [row[0], row[depth - 1], row[-1], row[-depth]]
                outline = [_project(*coords[r]) for r in corners]
                ax.fill([p[0] for p in outline], [p[1] for p in outline], color=colour,
                        alpha=0.35, zorder=2, lw=0)
            for r, (x, y) in zip(row, points):
                ax.scatter([x], [y], s=260, color=colour, edgecolor="black", lw=0.8, zorder=3)
                ax.text(x, y, str(r), ha="center", va="center", fontsize=9, weight="bold",
                        zorder=4)
        listing = " ".join("[" + ",".join(map(str, row)) + "]" for row in members)
        ax.set_title(f"{title}\n{listing}", fontsize=8.5)
        # Axis arrows from the origin corner.
        ox, oy = _project(-0.7, -0.55, 0)
        for (di, dj, dk), label in (((0.4, 0, 0), "i"), ((0, 0.4, 0), "j"),
                                    ((0, 0, 0.55), "k")):
            x1, y1 = _project(-0.7 + di, -0.55 + dj, dk)
            ax.annotate("", xy=(x1, y1), xytext=(ox, oy),
                        arrowprops={"arrowstyle": "->", "color": "0.35"})
            ax.text(x1 + 0.03, y1 + 0.03, label, fontsize=8, color="0.25", style="italic")
        ax.set_xlim(-0.85, span + 0.55 * span + 0.45)
        ax.set_ylim(-0.7, span + 0.4 * span + 0.45)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.suptitle(f"3D tensor parallelism, depth d={depth} ({depth ** 3} ranks): "
                 "rank = i + d*(j + d*k)", fontsize=10)
    return save_png(fig, path)


def _draw_cells(ax, x0: float, y0: float, rows: range, cols: range, owner, label: str,
                n_cols: int) -> None:
    """Draw cells (s, h) of a global array as a small grid at (x0, y0), top row first."""
    from matplotlib.patches import Rectangle

    for r_i, s in enumerate(rows):
        for c_i, h in enumerate(cols):
            ax.add_patch(Rectangle((x0 + c_i, y0 - r_i - 1), 1, 1, facecolor=owner(s, h),
                                   edgecolor="white", lw=1.2))
            ax.text(x0 + c_i + 0.5, y0 - r_i - 0.5, f"{s},{h}", ha="center", va="center",
                    fontsize=6.5)
    ax.text(x0 + n_cols / 2, y0 + 0.25, label, ha="center", va="bottom", fontsize=8)


def draw_mappings(path: str, seq: int = 5, hidden: int = 4, ranks: int = 2) -> bool:
    """Draw how an array [S, H] is split on the hidden and sequence axes, and Ulysses."""
    plt = pyplot()
    rows_of = split_blocks(seq, ranks)
    cols_of = split_blocks(hidden, ranks)
    colours = PALETTE[:ranks]
    seq_owner = {s: r for r, block in enumerate(rows_of) for s in block}
    hid_owner = {h: r for r, block in enumerate(cols_of) for h in block}
    grey = "#DDDDDD"
    panels = [
        ("hidden (last) axis",
         [("every rank: x [S, H]", range(seq), range(hidden), lambda s, h: grey)],
         [(f"rank {r}: x[:, {c.start}:{c.stop}]", range(seq), c,
           lambda s, h: colours[hid_owner[h]]) for r, c in enumerate(cols_of)],
         ("scatter_to_hidden", "gather_from_hidden")),
        ("sequence axis (axis 0)",
         [("every rank: x [S, H]", range(seq), range(hidden), lambda s, h: grey)],
         [(f"rank {r}: x[{b.start}:{b.stop}]", b, range(hidden),
           lambda s, h: colours[seq_owner[s]]) for r, b in enumerate(rows_of)],
         ("scatter_to_sequence", "gather_from_sequence")),
        ("Ulysses all-to-all: sequence-sharded <-> hidden-sharded",
         [(f"rank {r}: x[{b.start}:{b.stop}]", b, range(hidden),
           lambda s, h: colours[seq_owner[s]]) for r, b in enumerate(rows_of)],
         [(f"rank {r}: x[:, {c.start}:{c.stop}]", range(seq), c,
           lambda s, h: colours[seq_owner[s]]) for r, c in enumerate(cols_of)],
         ("all_to_all_from_sequence_to_hidden", "all_to_all_from_hidden_to_sequence")),
    ]
    arrow_length, gap = 4.6, 0.8
    fig, axes = plt.subplots(len(panels), 1, figsize=(9.0, 3.0 * len(panels)))
    for ax, (title, left, right, (rightwards, leftwards)) in zip(axes, panels):
        x = 0.0
        for label, rows, cols, owner in left:
            _draw_cells(ax, x, seq, rows, cols, owner, label, len(cols))
            x += len(cols) + gap
        x0, x1, y = x + 0.1, x + 0.1 + arrow_length, seq / 2
        ax.annotate("", xy=(x1, y + 0.3), xytext=(x0, y + 0.3),
                    arrowprops={"arrowstyle": "->", "lw": 1.3})
        ax.annotate("", xy=(x0, y - 0.3), xytext=(x1, y - 0.3),
                    arrowprops={"arrowstyle": "->", "lw": 1.3})
        ax.text((x0 + x1) / 2, y + 0.5, rightwards, ha="center", va="bottom", fontsize=7.5,
                family="monospace")
        ax.text((x0 + x1) / 2, y - 0.5, leftwards, ha="center", va="top", fontsize=7.5,
                family="monospace")
        x = x1 + gap
        for label, rows, cols, owner in right:
            _draw_cells(ax, x, seq, rows, cols, owner, label, len(cols))
            x += len(cols) + gap
        ax.set_title(title, fontsize=9.5, loc="left")
        ax.set_xlim(-0.2, 2 * hidden + 2 * gap + arrow_length + 2 * hidden + 2 * gap)
        ax.set_ylim(-0.3, seq + 1.0)
        ax.set_aspect("equal")
        ax.axis("off")
    legend = ", ".join(f"rank {r}" for r in range(ranks))
    fig.suptitle(f"x of shape [S={seq}, H={hidden}] on {ranks} ranks (balanced split: "
                 f"rows {[len(b) for b in rows_of]}, columns {[len(c) for c in cols_of]}); "
                 f"cell \"s,h\" is x[s, h]. Grey: replicated on every rank; colours "
                 f"({legend} in order): the rank that holds the block, or in the all-to-all "
                 "the rank that sent it. Each arrow is the forward of the mapping named on it.",
                 fontsize=8.5, wrap=True)
    return save_png(fig, path)


def query_owners(seq: int, ranks: int, layout: str) -> list[int]:
    """The context rank that holds each query row under ``layout`` (ring attention)."""
    owner = [0] * seq
    for r in range(ranks):
        for a, b in sequence_segments(seq, ranks, r, layout):
            owner[a:b] = [r] * (b - a)
    return owner


def causal_work(seq: int, ranks: int, layout: str) -> list[int]:
    """Causal score entries (query, key <= query) each rank computes: its query rows'."""
    work = [0] * ranks
    for q, r in enumerate(query_owners(seq, ranks, layout)):
        work[r] += q + 1
    return work


def draw_ring(path: str, ranks: int = 4, seq: int = 16) -> bool:
    """Draw the ring schedule and the causal work per rank in contiguous and zig-zag order."""
    plt = pyplot()
    from matplotlib.patches import Rectangle

    fig, axes = plt.subplots(1, 3, figsize=(12.0, 4.2),
                             gridspec_kw={"width_ratios": [1.25, 1, 1]})
    ax = axes[0]
    for step in range(ranks):
        for r in range(ranks):
            src = (r - step) % ranks
            ax.add_patch(Rectangle((step * 1.6, ranks - 1 - r), 1.0, 0.8,
                                   facecolor=PALETTE[src], edgecolor="black", lw=0.8))
            ax.text(step * 1.6 + 0.5, ranks - 1 - r + 0.4, f"K,V {src}", ha="center",
                    va="center", fontsize=8)
            if step < ranks - 1:
                y0, y1 = ranks - 1 - r + 0.4, ranks - 1 - (r + 1) % ranks + 0.4
                if (r + 1) % ranks:
                    ax.annotate("", xy=(step * 1.6 + 1.6, y1), xytext=(step * 1.6 + 1.0, y0),
                                arrowprops={"arrowstyle": "->", "color": "0.3", "lw": 0.9})
        ax.text(step * 1.6 + 0.5, ranks + 0.05, f"step {step}", ha="center", va="bottom",
                fontsize=8)
    for r in range(ranks):
        ax.text(-0.15, ranks - 1 - r + 0.4, f"rank {r}", ha="right", va="center", fontsize=8)
    # Short lines: the panel is narrow (equal aspect), and a wider title is clipped.
    ax.set_title(f"Ring schedule, {ranks} ranks: rank r keeps Q of its rows;\n"
                 f"at step t it works on the K,V block of rank (r - t) mod {ranks},\n"
                 "then sends it to r + 1 (the last rank to rank 0);\n"
                 "backward sends dK,dV one step behind", fontsize=8.5)
    ax.set_xlim(-1.1, ranks * 1.6)
    ax.set_ylim(-0.7, ranks + 0.5)
    ax.set_aspect("equal")
    ax.axis("off")
    for ax, layout in zip(axes[1:], ("contiguous", "zigzag")):
        owner = query_owners(seq, ranks, layout)
        for q in range(seq):
            for k in range(q + 1):
                ax.add_patch(Rectangle((k, seq - 1 - q), 1, 1, facecolor=PALETTE[owner[q]],
                                       edgecolor="white", lw=0.5))
        ax.set_xlim(0, seq)
        ax.set_ylim(0, seq)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_xlabel("key position", fontsize=8)
        ax.set_ylabel("query position (top: 0)", fontsize=8)
        ax.set_title(f"causal scores by computing rank, {layout}\nS={seq}: entries per rank "
                     f"{causal_work(seq, ranks, layout)}", fontsize=8.5)
    axes[0].text(ranks * 0.8 - 0.5, -0.25, "colours: rank 0 orange, 1 sky blue, 2 green, "
                 "3 yellow", ha="center", va="top", fontsize=8)
    return save_png(fig, path)


PICTURES = {
    "layout_tp_cp_dp.png": draw_grid,
    "cube_3d.png": draw_cube,
    "mappings.png": draw_mappings,
    "ring.png": draw_ring,
}


def main(outdir: str = DEFAULT_OUTDIR) -> list[str]:
    """Draw every picture into ``outdir``; return the paths that changed."""
    os.makedirs(outdir, exist_ok=True)
    changed = []
    for name, draw in PICTURES.items():
        path = os.path.join(outdir, name)
        if draw(path):
            changed.append(path)
    return changed


if __name__ == "__main__":
    for written in main(*sys.argv[1:2]):
        print("wrote", written)
