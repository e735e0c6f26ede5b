"""Report section of ``pipeline.json``: the schedules' bubble against the ideal, and the
micro-batches and memory each stage holds.

:func:`section_pipeline` takes the job's JSON document (``benchmarks/bench_pipeline.py``)
and returns markdown lines; its target lines end in "met" or "missed", or say why a case
is not judged (compute on stages sharing cores; sleeping stages need no core, and are
judged).
"""

from __future__ import annotations

from typing import Any

from benchmarks.report_format import table, verdict

#: The measured bubble within this fraction of the ideal, at m = 4p (issue 33).
BUBBLE_TARGET = 0.10
#: The schedules' names in the tables.
_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B"}


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2 ** 20:.1f}"


def off_ideal(measured: float, ideal: float) -> float:
    """``|measured - ideal| / ideal``: how far a measured bubble is from the ideal."""
    return abs(measured - ideal) / ideal if ideal else abs(measured)


def _figure(figures: dict[str, Any], name: str) -> str:
    """A figure to 3 places, or a dash where the run predates it."""
    return f"{figures[name]:.3f}" if name in figures else "-"


def _bubble_table(cases: list[dict[str, Any]]) -> list[str]:
    rows = []
    for c in cases:
        s = c["schedules"]
        rows.append([c["work"], c["stages"], c["micro_batches"], f"{c['micro_batch_ms']:.1f}",
                     f"{c['ideal']:.3f}",
                     *(f"{s[n]['bubble']:.3f} / {_figure(s[n], 'paced')} / {s[n]['idle']:.3f}"
                       for n in _NAMES),
                     *(f"{s[n]['step_ms']:.1f}" for n in _NAMES),
                     "yes" if c["oversubscribed"] else ""])
    return table(["work", "stages p", "micro-batches m", "one micro-batch (ms)",
                  "ideal (p-1)/(m+p-1)", "GPipe bubble / paced / idle",
                  "1F1B bubble / paced / idle",
                  "GPipe step (ms)", "1F1B step (ms)", "stages share cores"], rows)


def _target_lines(data: dict[str, Any]) -> list[str]:
    target, cores = BUBBLE_TARGET, data.get("cores")
    lines = []
    for c in data.get("cases", []):
        p, m = c["stages"], c["micro_batches"]
        if m != 4 * p:
            continue
        head = (f"- target bubble within {target:.0%} of the ideal {c['ideal']:.3f} at "
                f"m = 4p, {c['work']}, {p} stages")
        if c["oversubscribed"] and c["work"] == "compute":
            lines.append(f"{head}: not judged ({p} stages on {cores} cores compute two at "
                         f"once on a core; the sleep rows stand in)")
            continue
        found = {n: c["schedules"][n]["bubble"] for n in _NAMES}
        ok = all(off_ideal(b, c["ideal"]) <= target for b in found.values())
        shown = ", ".join(f"{_NAMES[n]} {b:.3f} ({off_ideal(b, c['ideal']):.0%} off)"
                          for n, b in found.items())
        lines.append(f"{head}: {shown}, {verdict(ok)}")
    return lines


def _memory_table(memory: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in memory:
        stages = r["per_stage"]
        rows.append([_NAMES.get(r["schedule"], r["schedule"]), r["stages"], r["micro_batches"],
                     " ".join(f"{s['in_flight']} ({s['formula']})" for s in stages),
                     " ".join(_mib(s["cached_bytes"]) for s in stages),
                     " ".join(_mib(s["traced_peak_bytes"]) for s in stages)])
    return table(["schedule", "stages p", "micro-batches m",
                  "held at most per stage (formula)", "cached activations per stage (MiB)",
                  "traced peak per stage (MiB)"], rows)


def _stage_words(args: dict[str, Any]) -> str:
    return (f"*compute* = {args.get('layers')} x (Linear {args.get('width')} -> "
            f"{args.get('width')}, GELU) on {args.get('rows')} rows a micro-batch (float32, "
            f"one BLAS thread), *sleep* = a forward sleeping a third of {args.get('sleep_ms')} "
            f"ms and a backward two thirds; each micro-batch sends "
            f"{4 * args.get('rows', 0) * args.get('width', 0) / 1024:.0f} KiB forward and back")


def section_pipeline(data: dict[str, Any], small: dict[str, Any] | None = None) -> list[str]:
    """The bubble table and its target lines, then the memory table and its check; with
    ``small`` (the job of a stage of half the compute for the same bytes), its bubble
    table and target lines after the first."""
    args = data.get("args", {})
    lines = ["## Pipeline schedules: bubble and memory", "",
             f"{data.get('ranks')} ranks on {data.get('cores')} cores; every stage the "
             f"same: {_stage_words(args)}. A step is one "
             "`run()` of m micro-batches, GPipe and 1F1B interleaved, median of "
             f"{args.get('repeats')} rounds, the slowest stage's time. *bubble* = "
             "(step - m x one micro-batch alone on the slowest stage) / step, *idle* = 1 - "
             "(the stage's forward, backward and loss time in that step) / step, the mean "
             "over the stages, *paced* = the same for the busiest stage of the step (the "
             "bubble with the compute timed within the step); ideal = (p - 1) / "
             "(m + p - 1) (equal stages, free transfers). "
             "Where stages share cores, compute runs two at once on a core and *bubble* "
             "counts the slowdown: those rows do not measure the schedule "
             "(benchmarks/bench_pipeline.py says more).", ""]
    cases = data.get("cases", [])
    if cases:
        lines += _bubble_table(cases) + [""] + _target_lines(data) + [""]
    if small and small.get("cases"):
        lines += ["The same at half the compute for the same bytes, so that the transfers "
                  f"weigh twice as much ({_stage_words(small.get('args', {}))}):", ""]
        lines += _bubble_table(small["cases"]) + [""] + _target_lines(small) + [""]
    memory = data.get("memory", [])
    if memory:
        lines += ["Memory (compute stages): the micro-batches each stage held at most, "
                  "counted by the schedule, against GPipe's m and 1F1B's min(p - s, m); "
                  "their cached activations (that count x one micro-batch's "
                  f"{_mib(memory[0]['micro_batch_bytes'])} MiB); and tracemalloc's peak "
                  "during one step above its start (caches, received activations, "
                  "temporaries; stage 0 caches views of the batch, allocated before the "
                  "step).", ""]
        lines += _memory_table(memory) + [""]
        exact = all(s["in_flight"] == s["formula"] for r in memory for s in r["per_stage"])
        lines += [f"- every stage held the formula's micro-batches (GPipe m, 1F1B "
                  f"min(p - s, m)), {len(memory)} runs: {verdict(exact)}", ""]
    return lines
