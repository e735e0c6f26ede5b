#!/usr/bin/env python3
"""Draw the slab-transpose picture of the simulation how-to into ``docs/_static``.

    python scripts/draw_fft.py [OUTDIR]

The blocks come from :func:`pympar.fft.physical_placement` and
:func:`pympar.fft.spectral_placement` (through :func:`pympar.partition.block_slice`), the
rule the transforms use, so the picture cannot disagree with the code. The PNG is rewritten
only when its bytes change.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

sys.path.insert(0, HERE)

from draw_layouts import save_png  # noqa: E402
from pympar.partition import block_slice  # noqa: E402

DEFAULT_OUTDIR = os.path.join(os.path.dirname(HERE), "docs", "_static")
PALETTE = ["#E69F00", "#56B4E9", "#009E73", "#CC79A7"]  # Okabe and Ito, one per rank

#: The field drawn: x0 x x1 points (the x2 axis, whole everywhere, points out of the page).
N0, N1, RANKS = 10, 9, 3


def _panel(ax, rows: int, cols: int, split_rows: bool, title: str, kept: int | None = None):
    """One layout: rows (x0) or columns (x1) split over the ranks; with ``kept``, only the
    ``kept`` lowest and highest columns exist, split over the ranks in their own order."""
    from matplotlib.patches import Rectangle

    columns = list(range(cols)) if kept is None else \
        list(range(kept)) + list(range(cols - kept, cols))
    for rank in range(RANKS):
        block = block_slice(rows if split_rows else len(columns), RANKS, rank)
        for i in range(rows):
            for position, j in enumerate(columns):
                if (i if split_rows else position) not in range(block.start, block.stop):
                    continue
                ax.add_patch(Rectangle((j, rows - 1 - i), 1, 1, facecolor=PALETTE[rank],
                                       edgecolor="white", lw=0.8))
        if split_rows:
            mid = (block.start + block.stop) / 2
            ax.text(cols + 0.3, rows - mid, f"rank {rank}: {block.stop - block.start} rows",
                    va="center", fontsize=7.5)
        elif block.stop > block.start:
            mid = (columns[block.start] + columns[block.stop - 1] + 1) / 2
            ax.text(mid, -0.6, f"rank {rank}" if kept is None else str(rank), ha="center",
                    va="top", fontsize=7.5)
    if kept is not None:
        ax.add_patch(Rectangle((kept, 0), cols - 2 * kept, rows, facecolor="#EEEEEE",
                               edgecolor="none"))
        ax.text(cols / 2, rows / 2, "dropped\nbefore\nthe\nexchange", ha="center",
                va="center", fontsize=7)
        ax.text(-0.3, -0.6, "rank", ha="right", va="top", fontsize=7.5)
    ax.set_xlim(-0.8, cols + (3.6 if split_rows else 0.2))
    ax.set_ylim(-1.4, rows + 0.2)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=8.5)


def draw_slab_transpose(path: str) -> bool:
    """Field split along x0 -> (local transforms of x1, x2) -> all-to-all -> split along x1."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6), dpi=120)
    _panel(axes[0], N0, N1, True,
           f"field {N0} x {N1} (x N2), x0 split over {RANKS} ranks:\n"
           "each rank transforms its whole axes x1, x2")
    _panel(axes[1], N0, N1, False,
           "one all-to-all: x1 split, x0 whole;\n"
           "each rank transforms x0 (rfftn's output layout)")
    _panel(axes[2], N0, N1, False,
           "SpectralConv keeps 2 + 2 modes of x1 first:\n"
           "the all-to-all moves only those", kept=2)
    axes[0].text(-0.3, N0 - 0.5, "x0", fontsize=7.5, ha="right", va="center")
    axes[0].text(0.5, -0.3, "x1", fontsize=7.5, ha="center", va="top")
    return save_png(fig, path, dpi=None)


def main(outdir: str = DEFAULT_OUTDIR) -> list[str]:
    """Draw the picture into ``outdir``; return the paths that changed."""
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, "slab_transpose.png")
    return [path] if draw_slab_transpose(path) else []


if __name__ == "__main__":
    for written in main(*sys.argv[1:2]):
        print("wrote", written)
