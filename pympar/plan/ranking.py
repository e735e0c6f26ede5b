"""A layout's predicted step: time, its parts, messages, bytes and memory; and the ranking.

The step time of a rank is the sum of its parts (pympar's collectives block, so nothing
overlaps but a ring's transfers, priced as if they did not):

* **compute**: every piece of local work (:class:`~pympar.plan.program.Work`), timed by the
  machine's measured kernels or its roofline, slower by the machine's ``corun`` factor while
  other ranks work on the node's other cores;
* **communication**: every call's critical path (:mod:`pympar.plan.costs`), pympar's own
  time per call and the writing of its result (at the memory bandwidth; all-reduces run in
  place);
* **checks**: every agreement check, priced apart (:func:`pympar.plan.costs.check_seconds`);
* **waiting**: ranks meet at every call and check; the slowest arrives later by the machine's
  ``jitter`` times the work since the last meeting, at most its ``wait_cap``, paid by the
  call or check;
* **shared cores**: with more ranks on a node than cores, the ranks take turns: compute
  takes ``ranks / cores`` times as long, every synchronizing call or check waits for its
  partners' turn on the core (the machine's measured ``shared`` cost per call), and the
  waiting above follows the share and bound measured with that many ranks a core
  (``shared_waits``): a few of the system's time slices after long work.

Rank 0 is the one priced: under the balanced split it holds the largest blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import costs
from .machines import Machine
from .models import Layout, Model, StepResult, describe, run_step
from .ledger import Call
from .program import Check, Work

__all__ = ["Prediction", "work_seconds", "predict", "rank"]

# The symbolic steps already run, by (model, layout, rank): the same step priced on several
# machines or memory limits is run once. Bounded: cleared when full.
_STEPS: dict[tuple[str, Layout, int], StepResult] = {}
_MAX_STEPS = 4096


def _step(model: Model, layout: Layout, world_rank: int) -> StepResult:
    key = (repr(model), layout, world_rank)
    found = _STEPS.get(key)
    if found is None:
        if len(_STEPS) >= _MAX_STEPS:
            _STEPS.clear()
        found = _STEPS[key] = run_step(model, layout, world_rank)
    return found


@dataclass
class Prediction:
    """What the planner predicts for one layout.

    Attributes
    ----------
    layout : Layout
    text : str
        The layout in a few words.
    fits : bool
        Whether it can run (the model takes it and its memory fits).
    reason : str or None
        Why it does not fit.
    seconds : dict of str to float
        ``compute``, ``communication``, ``checks`` (each with its waits for shared cores)
        and ``step`` (their sum), per step.
    messages : int
        Point-to-point messages rank 0 sends per step (its collectives' algorithms).
    bytes_sent : float
        Bytes rank 0 sends per step.
    calls, checks : int
        Collective calls and agreement checks per step.
    memory : dict of str to int
        Rank 0's bytes (:func:`pympar.memory.memory_report`'s kinds and ``total``).
    by_operation : dict of str to float
        Communication seconds per step by group role and kind of call (``"dp-cp
        all_reduce"``, ``"ulysses all_to_all"``) and the checks' by group role (``"tp
        checks"``).
    """

    layout: Layout
    text: str
    fits: bool = True
    reason: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    messages: int = 0
    bytes_sent: float = 0.0
    calls: int = 0
    checks: int = 0
    memory: dict[str, int] = field(default_factory=dict)
    by_operation: dict[str, float] = field(default_factory=dict)

    @property
    def step(self) -> float:
        """Predicted seconds per step."""
        return self.seconds.get("step", float("nan"))

    @property
    def communication_share(self) -> float:
        """The share of the step spent communicating, checks and waits for cores included."""
        s = self.seconds
        return (s["communication"] + s["checks"]) / s["step"] if s else 0.0

    def as_dict(self) -> dict:
        """The prediction as plain data (for ``--json``)."""
        return {"layout": self.text, "sizes": {"tp": self.layout.tp, "cp": self.layout.cp,
                                                "dp": self.layout.dp},
                "mode": self.layout.mode, "attention": self.layout.attention,
                "zero": self.layout.zero, "recompute": self.layout.recompute,
                "fits": self.fits, "reason": self.reason, "seconds": self.seconds,
                "communication_share": self.communication_share if self.fits else None,
                "messages": self.messages, "bytes_sent": self.bytes_sent, "calls": self.calls,
                "checks": self.checks, "memory": self.memory}


def work_seconds(work: Work, machine: Machine) -> float:
    """Seconds of one piece of local work: the machine's fit for its kind, else its
    roofline (the slower of its FLOPs and its bytes) and the overhead of one piece."""
    fit = machine.kernels.get(work.kind)
    if fit is not None:
        return fit[0] + fit[1] * work.flops + fit[2] * work.bytes
    return machine.op_overhead + max(work.flops / machine.flop_rate,
                                     work.bytes / machine.memory_bandwidth)


def _shared_cost(table: dict[str, float], factor: float) -> float:
    """Seconds per synchronizing event with ``factor`` ranks per core: the measured cost at
    the nearest factor not above it (the lowest measured one below all), scaled by
    ``factor`` over it."""
    if factor <= 1 or not table:
        return 0.0
    known = sorted((float(k), v) for k, v in table.items())
    k, v = max((kv for kv in known if kv[0] <= factor), default=known[0])
    return v * factor / k


def _price(call: Call, p: int, q: int, machine: Machine, factor: float,
           priced: dict[tuple, tuple[costs.Traffic, float]]) -> tuple[costs.Traffic, float]:
    """One call's traffic and seconds: pympar's own time, its result's copy, the critical
    path, the reduction, the wait for shared cores (memoized)."""
    key = (call.primitive, p, q, call.bytes_in, call.bytes_out)
    if key not in priced:
        whole = (max(call.bytes_in, call.bytes_out) if call.primitive == "ring_transfer"
                 else call.bytes_out if call.primitive == "all_gather" else call.bytes_in)
        t = costs.traffic(call.primitive, p, q, whole)
        seconds = machine.call_overhead
        if p > 1:
            reduced = call.bytes_in if call.primitive in ("all_reduce", "reduce_scatter") else 0
            # A fresh result (unpacked from MPI's blocks where split off axis 0): all-reduces
            # run in place, ring transfers into standing buffers.
            copied = 0 if call.primitive in ("all_reduce", "ring_transfer") else call.bytes_out
            seconds += (costs.seconds(t, machine, reduced) + _shared_cost(machine.shared, factor)
                        + copied / machine.memory_bandwidth)
        priced[key] = t, seconds
    return priced[key]


def predict(model: Model, layout: Layout, machine: Machine, node_size: int | None = None,
            memory: float | None = None, world_rank: int = 0) -> Prediction:
    """Predict one layout's step on ``machine``.

    Parameters
    ----------
    model : Model
    layout : Layout
    machine : Machine
    node_size : int, optional
        Ranks per node (the machine's default, else every rank on one node).
    memory : float, optional
        Bytes per rank available (the machine's node memory shared by its ranks by default).
    world_rank : int
        The rank priced.
    """
    pred = Prediction(layout, describe(layout, model))
    pred.reason = model.unfit(layout)
    if pred.reason is not None:
        pred.fits = False
        return pred
    ranks = layout.ranks
    node = node_size or machine.node_size or ranks
    on_node = min(ranks, node)
    result = _step(model, layout, world_rank)
    env, site = result.env, result.env.site
    pred.memory = result.memory
    limit = machine.node_memory / on_node if memory is None else memory
    if result.memory["total"] > limit:
        pred.fits = False
        pred.reason = (f"needs {result.memory['total'] / 2**20:.1f} MiB per rank, more than "
                       f"{limit / 2**20:.1f} MiB")
    factor = max(1.0, on_node / machine.cores)
    mine = world_rank // node
    on_my_node = {role: sum(1 for r in g.ranks if r // node == mine)
                  for role, g in site.groups.items()}
    # Ranks busy on the node's other cores slow this one's work (caches, memory bandwidth).
    slower = factor * (machine.corun if on_node > 1 else 1.0)
    compute = comm = checks = since_sync = 0.0
    priced: dict[tuple, tuple[costs.Traffic, float]] = {}  # a ring repeats its calls
    for event in env.timeline:
        if isinstance(event, Work):
            seconds = slower * work_seconds(event, machine)
            compute += seconds
            since_sync += seconds
            continue
        p, q = site.size(event.role), on_my_node[event.role]
        # Meeting the other ranks waits for the slowest: a share of the work since the
        # last meeting, up to a bound (Machine.meeting_wait).
        wait = machine.meeting_wait(factor, since_sync) if p > 1 else 0.0
        if p > 1:
            since_sync = 0.0
        if isinstance(event, Check):
            seconds = (wait + costs.check_seconds(event.kind, p, q, machine)
                       + _shared_cost(machine.shared_check, factor))
            checks += seconds
            pred.checks += 1
            name = f"{event.role} checks"
        else:
            t, seconds = _price(event, p, q, machine, factor, priced)
            pred.calls += 1
            seconds += wait
            comm += seconds
            name = f"{event.role} {event.primitive}"
            if event.primitive == "ring_transfer":  # one message, when this rank sends
                pred.messages += int(event.bytes_in > 0)
                pred.bytes_sent += event.bytes_in
            else:
                pred.messages += t.messages
                pred.bytes_sent += t.nbytes
        pred.by_operation[name] = pred.by_operation.get(name, 0.0) + seconds
    pred.seconds = {"compute": compute, "communication": comm, "checks": checks,
                    "step": compute + comm + checks}
    return pred


def rank(model: Model, ranks: int, machine: Machine, node_size: int | None = None,
         memory: float | None = None) -> tuple[list[Prediction], list[Prediction]]:
    """Every layout of ``model`` on ``ranks`` ranks: those that fit, fastest first, and those
    that do not, each with its reason."""
    fitting, unfit = [], []
    for layout in model.layouts(ranks):
        pred = predict(model, layout, machine, node_size, memory)
        (fitting if pred.fits else unfit).append(pred)
    fitting.sort(key=lambda p: p.step)
    return fitting, unfit
