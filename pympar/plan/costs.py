"""What each operation costs: messages, bytes and round trips, then seconds on a machine.

Per rank and call, as functions of the group size ``p``, the ranks of the group per node
``q`` (the group spans ``m = p / q`` nodes) and the algorithm MPI uses:

==================  ====================  ===========  ==================  =================
operation           algorithm             round trips  messages sent       bytes sent
==================  ====================  ===========  ==================  =================
all-reduce          recursive doubling    log2 p       log2 p              n log2 p
all-reduce          Rabenseifner          2 log2 p     2 log2 p            2 n (p-1)/p
all-reduce          ring                  2 (p-1)      2 (p-1)             2 n (p-1)/p
all-gather          recursive doubling    log2 p       log2 p              n (p-1)/p
all-gather          ring                  p-1          p-1                 n (p-1)/p
reduce-scatter      recursive halving     log2 p       log2 p              n (p-1)/p
reduce-scatter      pairwise              p-1          p-1                 n (p-1)/p
all-to-all          pairwise              p-1          p-1                 n (p-1)/p
all-to-all          Bruck                 log2 p       log2 p              n/2 log2 p
broadcast           binomial tree         log2 p       <= log2 p           n per message
ring transfer       one neighbour         1            1                   n
halo face           one neighbour         1            1                   the face
==================  ====================  ===========  ==================  =================

``n`` is the whole vector: the all-reduce's input, the all-gather's result, the
reduce-scatter's input, this rank's all-to-all input, one halo face (an exchange sends two
faces per split axis: :mod:`pympar.plan.scaling` prices it face by face).
:func:`algorithm` picks by a simplified version of MPICH's classic (3.x) rules: recursive
doubling for short all-reduces and all-gathers, Rabenseifner and ring for long ones, Bruck
for all-to-alls of small blocks, pairwise otherwise. MPICH 4 and 5 choose from a tuning
table instead (the 5.0.2 wheel: Rabenseifner for all-reduces from 8 B on a power of two of
ranks, Bruck for all-gathers that are not, a scattered all-to-all for blocks of 256 B to
32 KiB, and node-aware compositions across nodes), which this model does not follow. The
counts of calls and bytes per group that the tests compare with the recorders do not depend
on the choice; the round trips and the bytes on each link do, and only the measured step
times (``benchmarks/bench_plan.py``) check those, on one node. Round ``k`` of a
recursive algorithm pairs ranks ``2**k`` apart, nearest first (recursive doubling's pieces
grow, halving's shrink): with ranks packed ``q`` to a node, its first ``log2 q`` rounds stay
in the node and the last ``log2 m`` cross it, every rank of the node at once (they share the
node's link: bandwidth ``1/q`` each). A ring crosses a node boundary on ``m`` of its ``p``
links and every round waits for the slowest. Pairwise exchanges cross to the other nodes on
``p - q`` of their ``p - 1`` rounds, ``q`` ranks sharing the link.

The agreement check (:mod:`pympar._agreement`), priced apart (:func:`check_seconds`): on one
node, one word per rank in shared memory (a store and a wait: the cost of the ranks meeting);
across nodes, the same inside each node and one 8-byte exchange among the ``m`` node leaders
(each leader sends to each other directly up to 16 leaders, else an all-gather: ``log2 m``
rounds); a halo's with its neighbours only (one 8-byte word to each neighbour on another
node). A gather that learns its extents adds one 16-byte all-gather (``log2 p`` rounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .machines import Machine

__all__ = ["Traffic", "algorithm", "traffic", "seconds", "check_seconds", "checkpoint_seconds",
           "SHORT_ALLREDUCE", "LONG_ALLGATHER", "SHORT_ALLTOALL_BLOCK"]

#: The classic MPICH thresholds (bytes; see the module docstring): recursive doubling
#: below, Rabenseifner above.
SHORT_ALLREDUCE = 2048
#: All-gathers of results this large or larger go round a ring.
LONG_ALLGATHER = 512 * 1024
#: All-to-alls of blocks this small (and 8 ranks or more) take Bruck's algorithm.
SHORT_ALLTOALL_BLOCK = 256


@dataclass(frozen=True)
class Traffic:
    """One rank's share of one call, and its critical path.

    Attributes
    ----------
    algorithm : str
    rounds : int
        Round trips on the critical path.
    messages : int
        Point-to-point messages this rank sends.
    nbytes : float
        Bytes this rank sends.
    inter_bytes : float
        Of those, the bytes to other nodes (on average over the group's ranks).
    intra_rounds, inter_rounds : int
        The critical path's rounds inside a node and across nodes.
    intra_path, inter_path : float
        The bytes those rounds move through their slowest link (a node's link counted
        once per rank of the node sending across at the same time).
    """

    algorithm: str
    rounds: int
    messages: int
    nbytes: float
    inter_bytes: float = 0.0
    intra_rounds: int = 0
    inter_rounds: int = 0
    intra_path: float = 0.0
    inter_path: float = 0.0


def _log2(p: int) -> int:
    return max(0, math.ceil(math.log2(p))) if p > 1 else 0


def algorithm(primitive: str, p: int, nbytes: float) -> str:
    """The algorithm the model prices for ``primitive`` on ``p`` ranks and ``nbytes``
    (MPICH's classic rules, simplified: see the module docstring)."""
    power = p & (p - 1) == 0
    if primitive == "all_reduce":
        return "recursive doubling" if nbytes <= SHORT_ALLREDUCE or not power else \
            "Rabenseifner"
    if primitive == "all_gather":
        return "recursive doubling" if nbytes < LONG_ALLGATHER and power else "ring"
    if primitive == "reduce_scatter":
        return "recursive halving" if nbytes < LONG_ALLGATHER and power else "pairwise"
    if primitive == "all_to_all":
        return "Bruck" if p >= 8 and nbytes / p <= SHORT_ALLTOALL_BLOCK else "pairwise"
    if primitive == "broadcast":
        return "binomial tree"
    if primitive == "halo":
        return "neighbours"
    return "one neighbour"


def traffic(primitive: str, p: int, q: int, nbytes: float, name: str | None = None) -> Traffic:
    """Messages, bytes and round trips of one call (see the module's table).

    Parameters
    ----------
    primitive : str
        One of :data:`pympar.plan.ledger.PRIMITIVES`.
    p : int
        Ranks in the group.
    q : int
        Ranks of the group on each node (``p`` on one node).
    nbytes : float
        The whole vector (see the module docstring).
    name : str, optional
        The algorithm; :func:`algorithm`'s choice by default.
    """
    name = name or algorithm(primitive, p, nbytes)
    if p <= 1:
        return Traffic(name, 0, 0, 0.0)
    q = max(1, min(q, p))
    m = max(1, p // q)
    n, r, ri = float(nbytes), _log2(p), _log2(q)
    if primitive in ("ring_transfer", "halo"):  # one message each way to a neighbour
        across = m > 1
        return Traffic(name, 1, 1, n, n / q if across else 0.0, int(not across), int(across),
                       0.0 if across else n, n if across else 0.0)
    if name == "recursive doubling" and primitive == "all_reduce":  # n every round
        return Traffic(name, r, r, n * r, n * (r - ri), ri, r - ri, n * ri, n * (r - ri) * q)
    if name == "recursive doubling":  # pieces n/p, 2n/p, ...: the last rounds cross
        inside, cross = n * (q - 1) / p, n * (p - q) / p
        return Traffic(name, r, r, inside + cross, cross, ri, r - ri, inside, cross * q)
    if name in ("recursive halving", "Rabenseifner"):  # pieces n/2, n/4, ...: last cross
        times = 2 if name == "Rabenseifner" else 1
        inside, cross = n * (1 - 1 / q), n * (m - 1) / p
        return Traffic(name, times * r, times * r, times * (inside + cross), times * cross,
                       times * ri, times * (r - ri), times * inside, times * cross * q)
    if name == "ring":  # every round waits for the slowest link: a node boundary, if any
        steps = 2 * (p - 1) if primitive == "all_reduce" else p - 1
        moved = steps * n / p
        if m == 1:
            return Traffic(name, steps, steps, moved, 0.0, steps, 0, moved, 0.0)
        return Traffic(name, steps, steps, moved, moved / q, 0, steps, 0.0, moved)
    if name == "pairwise":  # p - 1 partners, those on other nodes with the node's link shared
        share = n / p
        return Traffic(name, p - 1, p - 1, share * (p - 1), share * (p - q), q - 1, p - q,
                       share * (q - 1), share * (p - q) * q)
    if name == "Bruck":  # log2 p rounds of half the data
        return Traffic(name, r, r, n / 2 * r, n / 2 * (r - ri), ri, r - ri, n / 2 * ri,
                       n / 2 * (r - ri) * q)
    # binomial tree: the whole vector down log2 p levels, the upper ones across nodes
    return Traffic(name, r, r, n, n if m > 1 else 0.0, ri, r - ri, n * ri, n * (r - ri))


def seconds(t: Traffic, machine: Machine, reduce_bytes: float = 0.0) -> float:
    """The time of one call: its critical path's latencies and bytes on each kind of link,
    plus the reduction's arithmetic (``reduce_bytes`` summed at the memory bandwidth)."""
    if t.rounds == 0:
        return 0.0
    return (t.intra_rounds * machine.intra.latency + t.intra_path / machine.intra.bandwidth
            + t.inter_rounds * machine.inter.latency + t.inter_path / machine.inter.bandwidth
            + reduce_bytes / machine.memory_bandwidth)


def check_seconds(kind: str, p: int, q: int, machine: Machine) -> float:
    """The agreement check of one call on ``p`` ranks, ``q`` of them per node.

    ``kind`` is ``"board"`` (the words compared), ``"extents"`` (and then one 16-byte
    all-gather) or ``"neighbours"`` (a halo's: its neighbours only).
    """
    if p <= 1:
        return 0.0
    m = max(1, p // max(q, 1))
    if kind == "neighbours":
        return machine.check_intra if m == 1 else machine.check_intra + machine.inter.latency
    cost = machine.check_intra
    if m > 1:  # the leaders' one exchange: direct up to 16 leaders, else an all-gather
        cost += machine.check_intra + machine.inter.latency * (1 if m <= 16 else _log2(m))
    if kind == "extents":
        cost += seconds(traffic("all_gather", p, q, 16.0 * p, "recursive doubling"), machine)
    return cost


def checkpoint_seconds(total_bytes: float, ranks: int, q: int, machine: Machine,
                       steps: int = 8) -> float:
    """A checkpoint of ``total_bytes`` (the serial model and optimizer) written by ``ranks``
    ranks, each its ``1/ranks`` straight into the files: the slower of the ranks' own writes
    and the file system's, and ``steps`` agreements of the whole job (each one small
    all-reduce)."""
    per_rank = total_bytes / ranks
    write = max(per_rank / machine.disk_rank_bandwidth, total_bytes / machine.disk_bandwidth)
    small = seconds(traffic("all_reduce", ranks, q, 8.0), machine)
    return write + steps * small
