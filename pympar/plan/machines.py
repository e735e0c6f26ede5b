"""Machines as the planner prices them: links (latency, bandwidth), compute, the check.

A :class:`Machine` is an alpha-beta-gamma description: per kind of link (inside a node, across
nodes) a latency ``alpha`` and a bandwidth ``1/beta``; a memory bandwidth (``gamma`` per byte
of a reduction) and a FLOP rate for local work; the time of one agreement check inside a node
and pympar's own time per collective call. :data:`PRESETS` holds the named ones:

``this``
    This machine, measured by ``python -m pympar plan --calibrate`` (stored as JSON in the
    user's cache, :func:`this_file`; see :mod:`pympar.plan.calibrate`): its local work per
    kind of layer from timings on one rank, its links and its checks from short runs on 2,
    2 x cores and 4 x cores ranks. Not calibrated, it is refused with the command that
    calibrates it.
``vm``
    The machine pympar's own figures were measured on (a 2-core VM, MPICH 5.0.2), as its
    calibration found it (``reference_vm.json`` beside this module): the machine of the
    committed planner benchmark (``benchmarks/results/plan.json``).
``hdr``
    A CPU node of 128 cores (two 64-core sockets, 2.45 GHz, 16 channels of DDR4-3200) on
    InfiniBand HDR: 1.3 us and 23 GB/s between nodes, shared memory 0.4 us and 12 GB/s
    inside (one pair of cores copying), 4 GiB of memory per core. A core does 40 GFLOP/s of
    float32 matrix work and reads 3.2 GB/s (the node's 409.6 GB/s shared), plus 15 us of
    Python and NumPy per layer call; pympar adds 10 us per collective and 1 us per check.
``25gbe``
    The same node on 25 Gb Ethernet (TCP): 20 us and 2.9 GB/s between nodes.
``gpu``
    A node of 8 GPUs of the H100 SXM class, one rank each: 3.35 TB/s of memory and 50 TFLOP/s
    of float32 matrix work per GPU, 80 GB of memory each, NVLink inside the node (3 us,
    300 GB/s), InfiniBand NDR across nodes (3 us, 45 GB/s per GPU); 30 us of Python and
    kernel launches per layer call, 15 us per collective, 2 us per check.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["Link", "Machine", "PRESETS", "REFERENCE_FILE", "this_file", "machine",
           "load_this"]

#: The calibration of the machine pympar's figures were measured on (the preset ``vm``).
REFERENCE_FILE = Path(__file__).resolve().parent / "reference_vm.json"


def this_file() -> Path:
    """Where ``--calibrate`` stores this machine's figures and ``this`` reads them:
    ``$PYMPAR_PLAN_MACHINE`` if set, else ``pympar/this_machine.json`` in the user's cache
    (``$XDG_CACHE_HOME``, else ``~/.cache``)."""
    named = os.environ.get("PYMPAR_PLAN_MACHINE")
    if named:
        return Path(named)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "pympar" / "this_machine.json"


@dataclass(frozen=True)
class Link:
    """One kind of link.

    Attributes
    ----------
    latency : float
        Seconds per message (alpha).
    bandwidth : float
        Bytes per second (1/beta).
    """

    latency: float
    bandwidth: float


@dataclass(frozen=True)
class Machine:
    """A machine the planner prices steps on.

    Attributes
    ----------
    name, description : str
    cores : int
        Cores (or devices) per node: ranks beyond them share one (see :attr:`shared`).
    intra, inter : Link
        Inside a node and across nodes.
    memory_bandwidth : float
        Bytes per second of one rank's local work (and of reductions).
    flop_rate : float
        FLOPs per second of one rank's matrix work.
    op_overhead : float
        Seconds per piece of local work (a layer's forward or backward: Python and the
        array library's dispatch, or kernel launches).
    call_overhead : float
        pympar's own seconds per collective call (validation, plan lookup, recorders off).
    check_intra : float
        One agreement check among ranks of one node (the words written and compared).
    kernels : dict of str to list of float
        Measured local work: per kind, ``[seconds per piece, seconds per FLOP, seconds per
        byte]`` (fitted on one rank); kinds not listed use the roofline of
        :attr:`flop_rate` and :attr:`memory_bandwidth`.
    shared, shared_check : dict of str to float
        With more ranks than cores: per ``ranks / cores`` (``"2"``, ``"4"``), the seconds
        each collective call (after its check), and each agreement check, costs on top (a
        rank waits for its partners' turns on the cores).
    disk_bandwidth, disk_rank_bandwidth : float
        Bytes per second a checkpoint reaches the file system at, in all and from one rank.
    jitter : float
        Ranks that meet after equal work arrive apart: the slowest later by this fraction of
        the work since their last meeting (measured on 2 ranks; 0 for the presets).
    wait_cap : float or None
        The most seconds that lateness reaches, however long the work (measured after long
        work on 2 ranks; None: no bound).
    shared_waits : dict of str to list of float
        The same two, ``[jitter, wait_cap]``, per ``ranks / cores`` (``"2"``, ``"4"``): ranks
        that take turns on the cores arrive later by up to a few of the system's time
        slices, a share of short work and a bound for long work.
    corun : float
        How much slower a rank's work runs while ranks work on the node's other cores
        (measured by running the examples side by side; 1 for the presets).
    node_memory : float
        Bytes of memory per node (a rank's share is the default ``--memory``).
    node_size : int or None
        Ranks per node by default (``--node-size`` overrides it); None: every rank on one
        node (this machine).
    measured : dict
        How the figures of ``this`` were measured (host, date, MPI, load).
    """

    name: str
    description: str
    cores: int
    intra: Link
    inter: Link
    memory_bandwidth: float
    flop_rate: float
    op_overhead: float
    call_overhead: float
    check_intra: float
    kernels: dict[str, list[float]] = field(default_factory=dict)
    shared: dict[str, float] = field(default_factory=dict)
    shared_check: dict[str, float] = field(default_factory=dict)
    disk_bandwidth: float = 2e9
    disk_rank_bandwidth: float = 1e9
    jitter: float = 0.0
    wait_cap: float | None = None
    shared_waits: dict[str, list[float]] = field(default_factory=dict)
    corun: float = 1.0
    node_memory: float = 512 * 2.0**30
    node_size: int | None = None
    measured: dict = field(default_factory=dict)

    def meeting_wait(self, factor: float, since: float) -> float:
        """Seconds the slowest of ranks meeting arrives after the others, ``since`` seconds
        of work after their last meeting (already lengthened by the turns on shared
        cores), with ``factor`` ranks per core: the measured share of that work, at most
        the measured bound (at the nearest measured factor not above ``factor``, else the
        lowest measured one; the bound scaled by ``factor`` over it, as more ranks take
        more turns)."""
        share, cap = self.jitter, self.wait_cap
        if factor > 1 and self.shared_waits:
            known = sorted((float(k), v) for k, v in self.shared_waits.items())
            k, (share, cap) = max((kv for kv in known if kv[0] <= factor), default=known[0])
            cap = cap * factor / k
        return share * since if cap is None else min(share * since, cap)

    def to_json(self) -> str:
        """The machine as JSON (what :func:`load_this` reads)."""
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @staticmethod
    def from_json(text: str) -> "Machine":
        """A machine from :meth:`to_json`'s text."""
        data = json.loads(text)
        data["intra"], data["inter"] = Link(**data["intra"]), Link(**data["inter"])
        return Machine(**data)


# ZeRO's slice copies: a NumPy slice assignment costs about 1 us of Python (0.9-1.3 us
# measured here), a CuPy one a kernel launch; their bytes at the memory bandwidth.
_CPU = dict(cores=128, intra=Link(0.4e-6, 12e9), memory_bandwidth=3.2e9, flop_rate=40e9,
            op_overhead=15e-6, call_overhead=10e-6, check_intra=1e-6, disk_bandwidth=50e9,
            disk_rank_bandwidth=1e9, node_size=128, kernels={"zero": [1e-6, 0.0, 1 / 3.2e9]})

PRESETS: dict[str, Machine] = {
    "hdr": Machine("hdr", "CPU nodes of 128 cores on InfiniBand HDR (200 Gb/s)",
                   inter=Link(1.3e-6, 23e9), **_CPU),
    "25gbe": Machine("25gbe", "CPU nodes of 128 cores on 25 Gb Ethernet (TCP)",
                     inter=Link(20e-6, 2.9e9), **_CPU),
    "gpu": Machine("gpu", "nodes of 8 GPUs (H100 SXM class), NVLink inside, NDR across",
                   cores=8, intra=Link(3e-6, 300e9), inter=Link(3e-6, 45e9),
                   memory_bandwidth=3.35e12, flop_rate=50e12, op_overhead=30e-6,
                   call_overhead=15e-6, check_intra=2e-6, disk_bandwidth=50e9,
                   disk_rank_bandwidth=2e9, node_memory=8 * 80e9, node_size=8,
                   kernels={"zero": [10e-6, 0.0, 1 / 3.35e12]}),
}


def load_this(path: Path | str | None = None) -> Machine:
    """This machine's calibrated figures (``--calibrate`` writes them).

    Raises
    ------
    ValueError
        When no calibration exists: run ``python -m pympar plan --calibrate`` first.
    """
    where = Path(path) if path is not None else this_file()
    if not where.is_file():
        raise ValueError(f"machine 'this' is not calibrated ({where} does not exist): run "
                         f"python -m pympar plan --calibrate, or choose one of vm, "
                         f"{', '.join(PRESETS)}")
    return Machine.from_json(where.read_text())


def machine(name: str) -> Machine:
    """The machine named ``name``: ``"this"`` or a key of :data:`PRESETS`, or the path of a
    JSON file written by :meth:`Machine.to_json`.

    Raises
    ------
    ValueError
        For an unknown name (the message lists the known ones).
    """
    if name == "this":
        return load_this()
    if name == "vm":
        return load_this(REFERENCE_FILE)
    if name in PRESETS:
        return PRESETS[name]
    if name.endswith(".json") and Path(name).is_file():
        return load_this(name)
    raise ValueError(f"unknown machine {name!r}: choose this, vm, {', '.join(PRESETS)}, or a "
                     f"JSON file written by python -m pympar.plan.calibrate --out FILE")

