#!/usr/bin/env python3
"""Draw the timeline of the Slurm requeue protocol into ``docs/_static/requeue_timeline.png``.

    python scripts/draw_requeue.py [OUTDIR]

One run of a job stopped early and requeued, then the run that finishes, in four lanes:
Slurm, the batch shell (``examples/slurm/requeue.sh``), the ranks of the training step and
the queue. The picture is committed; rerun this after changing the protocol.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
LANES = {"Slurm": 3.0, "batch shell": 2.0, "ranks\n(training step)": 1.0, "queue": 0.0}


def draw(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    fig, ax = plt.subplots(figsize=(14, 5.2), dpi=110)
    y = dict(zip(["slurm", "shell", "ranks", "queue"], LANES.values()))
    for name, level in LANES.items():
        ax.axhline(level, color="0.85", lw=1, zorder=0)
        ax.text(-0.3, level, name, ha="right", va="center", fontsize=10, weight="bold")

    def box(x0, x1, lane, text, color):
        ax.add_patch(FancyBboxPatch((x0, y[lane] - 0.28), x1 - x0, 0.56,
                                    boxstyle="round,pad=0.02", fc=color, ec="0.3", lw=0.8))
        ax.text((x0 + x1) / 2, y[lane], text, ha="center", va="center", fontsize=7.5)

    def arrow(x0, lane0, x1, lane1, text="", dy=0.0, color="0.2"):
        ax.annotate("", xy=(x1, y[lane1] + (0.3 if lane1 != lane0 and y[lane1] < y[lane0]
                                              else -0.3 if lane1 != lane0 else 0)),
                    xytext=(x0, y[lane0] - (0.3 if y[lane1] < y[lane0] else -0.3)),
                    arrowprops=dict(arrowstyle="->", color=color, lw=1.2))
        if text:
            ax.text((x0 + x1) / 2 + 0.1, (y[lane0] + y[lane1]) / 2 + dy, text, fontsize=7.5,
                    color=color, ha="left", va="center")

    # Run 1: stopped early.
    box(0.0, 2.0, "shell", "source requeue.sh: trap\nUSR1, rm this job's stale\n"
        "/dev/shm/mpich_shm_*", "#dbe9f6")
    box(2.1, 3.1, "shell", "srun ...\npympar info", "#dbe9f6")
    box(3.2, 8.9, "shell", "run_step srun ... (waits for the step to end)", "#dbe9f6")
    box(3.4, 4.6, "ranks", "start, MPI_Init,\nPreemption", "#e3f1dc")
    box(4.7, 6.7, "ranks", "step | step | step\nshould_stop()?", "#e3f1dc")
    box(6.8, 7.8, "ranks", "save\n(every rank)", "#fbe3c4")
    box(7.9, 9.1, "ranks", "MPI_Finalize,\nexit 75", "#fbe3c4")
    arrow(5.7, "slurm", 5.7, "shell", "SIGUSR1 to the batch shell\n(--signal=B:USR1@lead,"
          " scancel --batch)\ntrap: touch $PYMPAR_STOP_FILE", dy=0.05, color="#b03030")
    arrow(6.1, "shell", 6.1, "ranks", "stop file seen by rank 0\nat a step boundary", dy=-0.05,
          color="#b03030")
    ax.annotate("", xy=(5.2, y["ranks"] + 0.3), xytext=(5.2, y["slurm"] - 0.3),
                arrowprops=dict(arrowstyle="->", color="#7a3db0", lw=1.0, ls="--"))
    ax.text(3.55, y["slurm"] - 0.55, "or SIGUSR1 to the steps\n(scancel --signal=USR1)",
            fontsize=7.5, color="#7a3db0")
    box(9.2, 10.6, "shell", "status 75:\nscontrol requeue", "#f6d5d5")
    arrow(9.1, "ranks", 9.5, "shell", "", color="0.2")
    box(9.4, 11.6, "slurm", "requeue: the batch shell\nends (no step runs)", "#eeeeee")
    box(10.7, 12.9, "queue", "PENDING, Reason=BeginTime\n(about 2 minutes)", "#eeeeee")
    arrow(10.6, "shell", 11.0, "queue", "", color="0.2")
    # Run 2: resumes and finishes.
    box(13.0, 15.0, "shell", "next run: restart + 1,\nrm stale segments", "#dbe9f6")
    box(13.2, 15.0, "ranks", "--resume: newest\ncheckpoint, train", "#e3f1dc")
    box(15.1, 16.3, "ranks", "finished:\nexit 0", "#e3f1dc")
    box(15.1, 16.6, "shell", "status 0:\nno requeue", "#dbe9f6")
    box(15.3, 16.8, "slurm", "COMPLETED", "#d8efd8")
    ax.annotate("", xy=(17.0, -0.6), xytext=(0.0, -0.6),
                arrowprops=dict(arrowstyle="->", color="0.4"))
    ax.text(8.5, -0.8, "time", ha="center", va="top", fontsize=9, color="0.3")
    ax.set(xlim=(-2.2, 17.2), ylim=(-1.0, 3.6))
    ax.set_title("The requeue protocol: the program stops, saves, finalizes and exits 75; "
                 "the batch script requeues after the step", fontsize=10)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(outdir: str | None = None) -> str:
    outdir = outdir or os.path.join(os.path.dirname(HERE), "docs", "_static")
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, "requeue_timeline.png")
    draw(path)
    return path


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else None))
