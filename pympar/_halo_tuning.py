"""``faces="auto"``: which way a halo exchange's uncertain faces travel, settled by timing both
(private to :mod:`pympar.halo`).

A face that is not one contiguous run of the padded array reaches MPI either packed into a
reused buffer (a copy at each end and a plain send) or as a subarray datatype (MPI's own
datatype engine). Below a run length the copy always wins (``_halo_plan.PACK_BELOW``); above
it neither does reliably: under MPICH 5 on the same two ranks and the same 128^3 field, runs
of 1 KiB went 1.4x faster as datatypes in one job and 1.8x faster packed in another. So the
first exchanges of a plan time both ways on the caller's own arrays, alternating, and keep
the faster: :class:`Tuning`.

The trial exchanges are real ones (every ghost right in every call: the two ways move the
same elements), so tuning costs no extra call, only a few exchanges made the slower way.
Each rank decides alone, from its own clock: a face sent packed is received as a datatype
just as well (the type signatures are the same), so ranks that decide differently still
exchange correctly.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

__all__ = ["Tuning", "tune_from"]

#: ``faces="auto"``: faces whose contiguous runs are at least this many bytes are timed both
#: ways (shorter ones follow ``_halo_plan.PACK_BELOW``). MPICH 5 moved runs of up to 256 B
#: 2-10x faster packed in every job measured.
TUNE_FROM = {"MPICH": 512}
TUNE_FROM_OTHERS = 32

#: Timed exchanges each way, after one untimed each (its first touch of the buffers).
ROUNDS = 6


def tune_from(faces: str) -> float:
    """Runs (bytes) from which ``faces`` times both ways (inf: never)."""
    if faces != "auto":
        return float("inf")
    return TUNE_FROM.get(MPI.get_vendor()[0], TUNE_FROM_OTHERS)


class Tuning:
    """The trial of one plan's uncertain faces (keys of ``Plan.packs``): they travel all as
    datatypes or all packed, in turn, exchange after exchange, ``ROUNDS`` timed exchanges
    each way after one untimed each; then they keep the way of the shortest exchange.

    ``begin`` sets the way of the next exchange (dropping the plan's programs, which hold
    the other way's requests); ``record`` takes its time, and settles the plan when the
    trial is over (``plan.tuning`` is then None and ``plan.tuned`` says which way won)."""

    __slots__ = ("faces", "seconds", "calls")

    def __init__(self, faces: list[tuple[int, str]]) -> None:
        self.faces = faces
        self.seconds: tuple[list[float], list[float]] = ([], [])  # datatypes, packed
        self.calls = 0

    def begin(self, plan: Any) -> None:
        """Make the plan's next exchange go the way of this trial call."""
        self._use(plan, bool(self.calls % 2))

    def record(self, plan: Any, seconds: float) -> None:
        """The exchange that ``begin`` prepared took ``seconds``."""
        if self.calls >= 2:
            self.seconds[self.calls % 2].append(seconds)
        self.calls += 1
        if self.calls == 2 * (ROUNDS + 1):
            # the shortest: other work on the machine only ever adds to a time
            datatypes, packed = (min(s) for s in self.seconds)
            plan.tuned = packed < datatypes
            self._use(plan, plan.tuned)
            if not plan.tuned:  # the trial's packing buffers
                for face in self.faces:
                    plan.buffers.pop(face, None)
            plan.tuning = None

    def _use(self, plan: Any, packed: bool) -> None:
        if plan.packs[self.faces[0]] is not packed:
            for face in self.faces:
                plan.packs[face] = packed
            plan.free_requests()
