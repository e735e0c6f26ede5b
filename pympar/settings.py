"""The job-settings agreement: calls that every rank must make alike, with the same settings.

Creating a mesh, a group or the parallel state first calls :func:`check_same`: one
small timed exchange compares what every rank passed and the settings of
:data:`MUST_AGREE`, so ranks that lay out, cut or configure differently get an error on
every rank instead of groups whose names lie or collectives that never match.
"""

from __future__ import annotations

import json
import os
import time
import zlib

import numpy as np
from mpi4py import MPI

from . import debug
from .errors import CollectiveMismatchError, CollectiveTimeoutError, wait

__all__ = ["MUST_AGREE", "ROLL_CALL_SECONDS", "settings", "check_settings", "check_same"]

#: Environment variables whose settings must be the same on every rank.
MUST_AGREE = ("PYMPAR_DEBUG", "PYMPAR_TIMEOUT")


def settings() -> dict[str, list[str]]:
    """Return this rank's settings that must agree, by variable name.

    Returns
    -------
    dict of str to [str, str]
        Per variable of :data:`MUST_AGREE`: what is in effect (compared) and how it
        reads in the environment (shown in errors).
    """
    timeout = debug.get_timeout()
    effective = {"PYMPAR_DEBUG": "on" if debug.is_enabled() else "off",
                 "PYMPAR_TIMEOUT": "off" if timeout is None else f"{timeout!r} s"}
    # The raw text is cut short: it is shown in one line of an error.
    return {name: [value, f"{value} ({name}={os.environ.get(name, '<unset>')[:40]})"]
            for name, value in effective.items()}


#: Seconds a rank whose exchange timed out waits for word from the others that wait too.
ROLL_CALL_SECONDS = 2.0
_ROLL_CALL_TAG = 24301  # below 32767, the least MPI_TAG_UB the standard allows
_TOKEN = np.zeros(1, np.uint8)  # lives as long as the sends freed before they complete


def _roll_call(comm: MPI.Comm, seconds: float = ROLL_CALL_SECONDS) -> list[int]:
    """The ranks of ``comm`` not heard from within ``seconds``, after a timed-out exchange.

    Every rank that timed out in the same exchange sends a token to every other rank and
    collects theirs; the ranks that never called it send none. Point-to-point, so the
    pending exchange does not block it; only taken on the way to an error.
    """
    size, me = comm.Get_size(), comm.Get_rank()
    token, status = np.zeros(1, np.uint8), MPI.Status()
    for rank in range(size):
        if rank != me:  # freed at once: MPI completes the send, or the job ends first
            comm.Isend(_TOKEN, dest=rank, tag=_ROLL_CALL_TAG).Free()
    heard, deadline = {me}, time.monotonic() + seconds
    while len(heard) < size and time.monotonic() < deadline:
        if comm.Iprobe(MPI.ANY_SOURCE, _ROLL_CALL_TAG, status):
            comm.Recv(token, source=status.Get_source(), tag=_ROLL_CALL_TAG)
            heard.add(status.Get_source())
        else:
            time.sleep(1e-3)
    return [rank for rank in range(size) if rank not in heard]


def _timeout_error(what: str, comm: MPI.Comm, timeout: float,
                   request: MPI.Request) -> CollectiveTimeoutError:
    missing = _roll_call(comm)
    who = (f"rank(s) {missing} of the communicator did not call it (no word from them "
           f"within {ROLL_CALL_SECONDS:g} s of this rank's timeout)" if missing else
           "every rank answered a roll call, so some called it with other arguments or "
           "over another communicator")
    error = CollectiveTimeoutError(
        f"{what} did not complete within {timeout:g} s on rank {comm.Get_rank()} of "
        f"{comm.Get_size()}: {who}; the communicator is no longer usable")
    error.request = request
    return error


def check_settings(seen: list[dict[str, list[str]]]) -> None:
    """Raise ValueError when the ranks' :func:`settings` differ (the same error on every rank).

    Parameters
    ----------
    seen : list of dict
        Every rank's :func:`settings`, by rank.

    Raises
    ------
    ValueError
        Naming the first setting that differs and each rank's value.
    """
    for name in seen[0]:
        if len({row[name][0] for row in seen}) == 1:
            continue
        shown: dict[str, list[int]] = {}
        for rank, row in enumerate(seen):
            shown.setdefault(row[name][1], []).append(rank)
        listing = "; ".join(f"{value} on ranks {ranks}" for value, ranks in shown.items())
        raise ValueError(f"{name} must be set alike on every rank, but the ranks differ: "
                         f"{listing}")


def check_same(comm: MPI.Comm, what: str, arguments: str) -> None:
    """Check that every rank of ``comm`` calls ``what`` with the same ``arguments`` and settings.

    Collective over ``comm``: one timed non-blocking Allgather of a 32-bit checksum of
    ``what``, ``arguments`` and this rank's :func:`settings` (non-blocking always, so
    ranks whose timeouts differ still match). Every agreed call of pympar uses this one
    exchange, so ranks that make different such calls (``initialize_parallel`` on one,
    ``Mesh`` on another) match each other and are told so. Only when the checksums
    differ does a second exchange gather the texts, to name what each rank passed.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The communicator every rank calls over.
    what : str
        The call, named in errors (e.g. ``"Mesh.group"``).
    arguments : str
        This rank's arguments, as text that is equal exactly when they mean the same.

    Raises
    ------
    ValueError
        On every rank, when a setting differs between ranks; it names the setting and
        each rank's value.
    pympar.errors.CollectiveMismatchError
        On every rank, when the calls or arguments differ; the message lists each
        distinct call and the ranks that made it.
    pympar.errors.CollectiveTimeoutError
        When ``PYMPAR_TIMEOUT`` is set here and other ranks do not call it in time
        (``comm`` then has a pending operation; the error's ``request``).
    """
    if comm.Get_size() == 1:
        return
    call = f"{what}({arguments})"
    mine = settings()
    effective = {name: value for name, (value, _) in mine.items()}
    send = np.array([zlib.crc32(json.dumps([call, effective]).encode())], np.uint32)
    sums = np.empty(comm.Get_size(), np.uint32)
    wait(comm.Iallgather(send, sums), what, comm, debug.get_timeout(), _timeout_error)
    if (sums == sums[0]).all():
        return
    # Every rank saw the same checksums, so every rank takes this (rare) path.
    seen: list[tuple[str, dict[str, list[str]]]] = comm.allgather((call, mine))
    try:
        check_settings([row for _, row in seen])
    except ValueError as err:
        err.raised_alike = True  # type: ignore[attr-defined]  # every rank saw the same
        raise
    made: dict[str, list[int]] = {}
    for rank, (text, _) in enumerate(seen):
        made.setdefault(text, []).append(rank)
    listing = "; ".join(f"{text} on ranks {ranks}" for text, ranks in made.items())
    raise CollectiveMismatchError(
        f"{what} is collective over its communicator: every rank must make the same call "
        f"with the same arguments, but the ranks differ: {listing}")
