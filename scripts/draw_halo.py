#!/usr/bin/env python3
"""Draw the halo picture of the documentation into ``docs/_static/halo.png``.

    python scripts/draw_halo.py [OUTDIR]

The blocks come from :func:`pympar.partition.balanced_sizes`, the split every
:class:`~pympar.decomposition.Decomposition` uses, and each ghost cell is labelled with the
block whose cell it copies (:func:`padded_owners`; ``tests/test_halo.py`` checks that a real
exchange delivers exactly these owners). Drawing imports matplotlib lazily (Agg backend);
the PNG is rewritten only when its bytes change.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

sys.path.insert(0, HERE)

from draw_layouts import pyplot, save_png  # noqa: E402
from pympar.partition import balanced_sizes  # noqa: E402

DEFAULT_OUTDIR = os.path.join(os.path.dirname(HERE), "docs", "_static")
#: The pictured field: 10 x 8 cells over 3 x 2 ranks, walls along axis 0, periodic along 1.
SHAPE, PARTS, PERIODIC, WIDTH, SHOWN = (10, 8), (3, 2), (False, True), 1, (1, 1)
# Colour-blind friendly palette (Okabe and Ito), one colour per block.
PALETTE = ["#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7",
           "#999999"]


def block_id(coords: Sequence[int], parts: Sequence[int]) -> int:
    """The number of the block at ``coords``: the first axis varies fastest."""
    return int(np.ravel_multi_index(tuple(coords), tuple(parts), order="F"))


def owners(shape: Sequence[int], parts: Sequence[int]) -> np.ndarray:
    """Every cell of the global field labelled with the number of the block holding it."""
    coords = [np.repeat(np.arange(p), balanced_sizes(n, p)) for n, p in zip(shape, parts)]
    grid = np.meshgrid(*coords, indexing="ij")
    return np.ravel_multi_index(tuple(grid), tuple(parts), order="F")


def padded_owners(shape: Sequence[int], parts: Sequence[int], coords: Sequence[int],
                  width: int, periodic: Sequence[bool]) -> np.ndarray:
    """Block ``coords``'s padded block, each cell labelled with the block it copies (-1:
    outside a non-periodic field, where the ghosts are zero)."""
    field = owners(shape, parts)
    index = []
    for n, p, c, wrap in zip(shape, parts, coords, periodic):
        start = sum(balanced_sizes(n, p)[:c])
        cells = np.arange(start - width, start + balanced_sizes(n, p)[c] + width)
        index.append(cells % n if wrap else cells)
    grid = np.meshgrid(*index, indexing="ij")
    inside = np.ones(grid[0].shape, bool)
    for g, n in zip(grid, shape):
        inside &= (g >= 0) & (g < n)
    out = np.full(grid[0].shape, -1)
    out[inside] = field[tuple(g[inside] for g in grid)]
    return out


def _cells(ax, labels: np.ndarray, origin: tuple[int, int], alpha: np.ndarray) -> None:
    from matplotlib.patches import Rectangle

    for (i, j), who in np.ndenumerate(labels):
        x, y = origin[1] + j, -(origin[0] + i)
        if who < 0:
            ax.add_patch(Rectangle((x, y - 1), 1, 1, facecolor="white", edgecolor="#777777",
                                   hatch="///", lw=0.6))
            continue
        ax.add_patch(Rectangle((x, y - 1), 1, 1, facecolor=PALETTE[who % len(PALETTE)],
                               alpha=alpha[i, j], edgecolor="white", lw=0.8))
        ax.text(x + 0.5, y - 0.5, str(who), ha="center", va="center", fontsize=7)


def _padded_panel(ax, coords: tuple[int, int], title: str) -> tuple[int, int]:
    from matplotlib.patches import Rectangle

    padded = padded_owners(SHAPE, PARTS, coords, WIDTH, PERIODIC)
    pale = np.full(padded.shape, 0.45)
    pale[WIDTH:-WIDTH, WIDTH:-WIDTH] = 1.0  # the block solid, its ghosts pale
    _cells(ax, padded, (0, 0), pale)
    h, w = padded.shape
    ax.add_patch(Rectangle((WIDTH, -(h - WIDTH)), w - 2 * WIDTH, h - 2 * WIDTH, fill=False,
                           edgecolor="black", lw=2.0))
    ax.set_title(title, fontsize=9)
    return h, w


def draw(path: str) -> bool:
    """Draw the field's blocks and two padded blocks with their ghosts' owners."""
    from matplotlib.patches import Rectangle

    plt = pyplot()
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(11.5, 4.8),
                                              gridspec_kw={"width_ratios": [1.0, 0.9, 0.9]})
    field = owners(SHAPE, PARTS)
    _cells(left, field, (0, 0), np.ones(field.shape))
    starts = [np.concatenate([[0], np.cumsum(balanced_sizes(n, p))]) for n, p in
              zip(SHAPE, PARTS)]
    for r in starts[0]:
        left.plot([0, SHAPE[1]], [-r, -r], color="black", lw=1.6)
    for c in starts[1]:
        left.plot([c, c], [0, -SHAPE[0]], color="black", lw=1.6)
    r0, r1 = starts[0][SHOWN[0]], starts[0][SHOWN[0] + 1]
    c0, c1 = starts[1][SHOWN[1]], starts[1][SHOWN[1] + 1]
    left.add_patch(Rectangle((c0 - WIDTH, -(r1 + WIDTH)), c1 - c0 + 2 * WIDTH,
                             r1 - r0 + 2 * WIDTH, fill=False, edgecolor="black", lw=2.2,
                             ls="--", clip_on=False))
    left.set_title(f"a {SHAPE[0]} x {SHAPE[1]} field over {PARTS[0]} x {PARTS[1]} ranks,\n"
                   f"cells labelled by block (dashed: block {block_id(SHOWN, PARTS)}'s halo)",
                   fontsize=9)
    h, w = _padded_panel(middle, SHOWN, f"block {block_id(SHOWN, PARTS)} padded, width "
                                         f"{WIDTH}: pale\nghosts copy the block labelled")
    middle.annotate("corner: the diagonal\nneighbour's cell, carried\nby the axis-1 step",
                    xy=(0.5, -0.5), xytext=(-0.2, -h - 3.2), fontsize=8,
                    arrowprops={"arrowstyle": "->"})
    middle.annotate("axis 1 is periodic:\nthe row wraps around", xy=(w - 0.5, -2.5),
                    xytext=(w - 3.0, -h - 1.6), fontsize=8, arrowprops={"arrowstyle": "->"})
    top = (0, SHOWN[1])
    _padded_panel(right, top, f"block {block_id(top, PARTS)} padded: axis 0 has walls,\n"
                              f"the ghosts beyond them are 0 (hatched)")
    for ax, (rows, cols) in ((left, SHAPE), (middle, (h, w)), (right, (h + 1, w))):
        ax.set_xlim(-1.2, cols + 1.2)
        ax.set_ylim(-max(rows, 11) - 1.2, 1.0)
        ax.set_aspect("equal")
        ax.axis("off")
    return save_png(fig, path)


def main(outdir: str = DEFAULT_OUTDIR) -> list[str]:
    """Draw the picture into ``outdir``; return the paths that changed."""
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, "halo.png")
    return [path] if draw(path) else []


if __name__ == "__main__":
    for written in main(*sys.argv[1:2]):
        print("wrote", written)
