#!/usr/bin/env python3
"""Draw the timelines of the pipeline schedules into ``docs/_static/pipeline_schedules.png``.

    python scripts/draw_pipeline.py [OUTDIR]

Each stage's order of forwards and backwards is the schedule's own
:meth:`~pympar.pipeline.PipelineSchedule.steps` (:func:`stage_orders`); :func:`timeline`
then starts every step as soon as its stage is free and its input has arrived (a forward
after the previous stage's forward of that micro-batch, a backward after the next stage's
backward of it), with fixed forward and backward times and free transfers. The picture shows
GPipe and 1F1B on 4 stages with 8 micro-batches, and the micro-batches each stage holds
(:func:`in_flight`). ``tests/test_pipeline_example.py`` checks the timelines: the step takes
``(m + p - 1)`` forward-and-backward times, the bubble is ``(p - 1) / (m + p - 1)``, and a
stage holds ``m`` (GPipe) or ``p - s`` (1F1B) micro-batches at most. The PNG is rewritten
only when its bytes change.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from draw_layouts import pyplot, save_png  # noqa: E402
from pympar.pipeline import GPipe, OneFOneB  # noqa: E402

DEFAULT_OUTDIR = os.path.join(os.path.dirname(HERE), "docs", "_static")
#: The pictured pipeline: stages, micro-batches, and the time of a forward and a backward.
STAGES, MICRO_BATCHES, FORWARD, BACKWARD = 4, 8, 1.0, 2.0
#: (start, end) of one step on a stage: ("forward" or "backward", micro-batch, start, end).
Step = tuple


def stage_orders(schedule: type, stages: int, micro_batches: int) -> list[list[tuple]]:
    """Every stage's order of ``("forward", k)`` and ``("backward", k)``, from the schedule
    class's own ``steps()``.

    ``steps()`` reads only the micro-batch count and the stage's place in the pipeline, so it
    is called here on a stand-in for a schedule of each stage (a real one needs the ranks).
    """
    orders = []
    for stage in range(stages):
        view = SimpleNamespace(micro_batches=micro_batches,
                               pipeline=SimpleNamespace(size=stages, rank=stage))
        orders.append(schedule.steps(view))
    return orders


def timeline(orders: list[list[tuple]], forward: float = FORWARD,
             backward: float = BACKWARD) -> list[list[Step]]:
    """When each stage runs each step: ``(action, k, start, end)`` in its order.

    A step starts when its stage has finished the step before and its input is there: a
    forward of micro-batch ``k`` on stage ``s > 0`` when stage ``s - 1`` finished its
    forward of ``k``, a backward on stage ``s < p - 1`` when stage ``s + 1`` finished its
    backward of ``k`` (the last stage's loss gradient is ready with its forward).

    Raises
    ------
    RuntimeError
        When no stage can go on (orders that deadlock).
    """
    p = len(orders)
    done: dict[tuple, float] = {}  # (stage, action, k) -> end time
    placed: list[list[Step]] = [[] for _ in range(p)]
    free, at = [0.0] * p, [0] * p
    while any(at[s] < len(orders[s]) for s in range(p)):
        progress = False
        for s in range(p):
            while at[s] < len(orders[s]):
                action, k = orders[s][at[s]]
                source = (s - 1, "forward", k) if action == "forward" else (s + 1, "backward", k)
                needed = 0 <= source[0] < p
                if needed and source not in done:
                    break
                start = max(free[s], done[source] if needed else 0.0)
                end = start + (forward if action == "forward" else backward)
                placed[s].append((action, k, start, end))
                done[(s, action, k)], free[s] = end, end
                at[s] += 1
                progress = True
        if not progress:
            raise RuntimeError(f"the orders deadlock at steps {at}")
    return placed


def in_flight(steps: list[Step]) -> list[tuple[float, int]]:
    """``(time, micro-batches held)`` after each step of one stage: a forward adds one, a
    backward releases one."""
    held, out = 0, [(0.0, 0)]
    for action, _, _, end in steps:
        held += 1 if action == "forward" else -1
        out.append((end, held))
    return out


def bubble(placed: list[list[Step]]) -> float:
    """The idle fraction of the stages over the step: ``1 - busy / (p * span)``."""
    span = max(step[3] for steps in placed for step in steps)
    busy = sum(end - start for steps in placed for _, _, start, end in steps)
    return 1.0 - busy / (len(placed) * span)


def draw(path: str, stages: int = STAGES, micro_batches: int = MICRO_BATCHES) -> bool:
    """Draw GPipe's and 1F1B's timelines and the micro-batches they hold; True when the
    file changed."""
    plt = pyplot()
    schedules = (("GPipe", GPipe), ("1F1B", OneFOneB))
    fig, axes = plt.subplots(3, 1, figsize=(10.5, 7.6),
                             gridspec_kw={"height_ratios": [stages, stages, 2.6]})
    p, m = stages, micro_batches
    ideal = (p - 1) / (m + p - 1)
    span = 0.0
    for ax, (name, schedule) in zip(axes, schedules):
        placed = timeline(stage_orders(schedule, p, m))
        span = max(span, max(step[3] for steps in placed for step in steps))
        for s, steps in enumerate(placed):
            for action, k, start, end in steps:
                colour = "#56B4E9" if action == "forward" else "#E69F00"
                ax.broken_barh([(start, end - start)], (s - 0.4, 0.8), facecolors=colour,
                               edgecolors="0.25", linewidth=0.6)
                ax.text((start + end) / 2, s, f"{'F' if action == 'forward' else 'B'}{k}",
                        ha="center", va="center", fontsize=7.5)
            peak = max(held for _, held in in_flight(steps))
            ax.text(1.005, s, f"holds {peak}", transform=ax.get_yaxis_transform(),
                    va="center", fontsize=8)
        ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
        ax.set_ylim(p - 0.5, -0.5)
        ax.set_title(f"{name}: {m} micro-batches on {p} stages; idle (white) "
                     f"{bubble(placed):.0%} of the step = (p - 1) / (m + p - 1) = "
                     f"{p - 1}/{m + p - 1}", fontsize=9, loc="left")
        ax.tick_params(axis="x", labelbottom=False)
    memory = axes[2]
    for (name, schedule), style in zip(schedules, ("-", "--")):
        first = timeline(stage_orders(schedule, p, m))[0]
        points = in_flight(first)
        memory.step([t for t, _ in points], [h for _, h in points], style, where="post",
                    label=f"{name}, stage 0 (peak {max(h for _, h in points)})")
    memory.set(ylabel="micro-batches\nheld", xlabel="time (a forward takes 1, a backward 2)",
               ylim=(0, m + 1))
    memory.legend(fontsize=8, loc="upper right")
    memory.set_title("activations alive on stage 0: GPipe holds all m, 1F1B at most p - s",
                     fontsize=9, loc="left")
    for ax in axes:
        ax.set_xlim(0, span)
    fig.suptitle(f"Forwards (blue, F k) and backwards (orange, B k) of micro-batch k: "
                 f"both schedules leave the same bubble, {ideal:.0%} here", fontsize=10)
    return save_png(fig, path)


def main(outdir: str = DEFAULT_OUTDIR) -> list[str]:
    """Draw the picture into ``outdir``; return the paths that changed."""
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, "pipeline_schedules.png")
    return [path] if draw(path) else []


if __name__ == "__main__":
    for written in main(*sys.argv[1:2]):
        print("wrote", written)
