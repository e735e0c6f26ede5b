"""Stage-to-stage transfer: activations to the next stage, their gradients back.

As a linear map the transfer is the identity from one stage's output to the next stage's
input, and its adjoint the identity back: :meth:`StageTransfer.send_forward` on stage ``s``
pairs with :meth:`~StageTransfer.recv_forward` on stage ``s + 1``, and
:meth:`~StageTransfer.send_backward` there with :meth:`~StageTransfer.recv_backward` here,
micro-batch by micro-batch.

Each array travels as a small header then its bytes (:mod:`._wire`): the receiver learns the
shape and dtype from the header (micro-batches may be uneven), and compares what the sender
was doing (the transfer's label, the enclosing :func:`pympar.collectives.label`, the
direction and the micro-batch) with what it expects. Only the two neighbours take part: no
stage waits for any other. A gradient coming back must have the shape and dtype of the
activation sent for that micro-batch. A stage ending its call (:meth:`StageTransfer.finish`)
tells both neighbours in the same stream as its data, so a neighbour still expecting data
learns that it ended early.

Whatever fails (the neighbours' calls differ, a stage's own error, a timeout of the
watchdog, the end of a stage's program) the stage that sees it first sends its neighbours an
abort, which every wait listens for; they raise and pass it on, so every stage of the
pipeline raises within the watchdog. An abort says how many arrays (and ends of calls) its
sender had sent before it: a neighbour takes those first, as sent, whatever order the
messages arrive in, so that where it raises does not depend on the timing (stages of
several pipelines that meet in one tensor-parallel call all stop at the same micro-batch).
The errors: :class:`~pympar.errors.CollectiveMismatchError` when
calls differ (and beside a stage that refused its arguments),
:class:`~pympar.errors.PeerEndedError` when a stage ended, a
:class:`~pympar.errors.CollectiveTimeoutError` where a wait ran out. A transfer that failed
stays failed: every later call raises the same error.

NumPy arrays are sent from their own memory; CuPy arrays directly to a CUDA-aware MPI
(after their stream is synchronized), else through a host copy (:func:`pympar.backend.
cuda_aware`). Sends never block: they complete while the stage waits for its next
message, and at the latest in :meth:`~StageTransfer.finish`.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import _agreement, _board, backend, debug, errors, stats
from ..errors import CollectiveMismatchError, PeerEndedError, timeout_error, where
from . import _wire
from .topology import PipelineGroup, as_pipeline

__all__ = ["StageTransfer"]

# The communicators of failed transfers, never freed (see StageTransfer.free).
_KEPT: list[MPI.Intracomm] = []


class StageTransfer:
    """The point-to-point pairs between neighbouring pipeline stages.

    Parameters
    ----------
    pipeline : PipelineGroup or Group
        The pipeline group; its rank ``s`` runs stage ``s``.
    label : str, default "pipeline"
        Names this transfer; the neighbours compare it in every message.

    Attributes
    ----------
    pipeline : PipelineGroup
    label : str
    failed : Exception or None
        The error this transfer failed with (then every call raises it again).

    Notes
    -----
    Creating one is collective over the pipeline group (a communicator of its own, so that
    messages left by a failed call never meet a later transfer's), bounded by the watchdog.
    Every call that waits (:meth:`recv_forward`, :meth:`recv_backward`, :meth:`finish`)
    waits at most ``PYMPAR_TIMEOUT`` for the neighbour, listening for an abort meanwhile.
    """

    def __init__(self, pipeline: PipelineGroup | Any, label: str = "pipeline") -> None:
        self.pipeline = as_pipeline(pipeline)
        self.label, self.failed = str(label), None
        group = self.pipeline.group
        self._sends: list[tuple[MPI.Request, Any]] = []
        self._sent: dict[int, tuple[tuple[int, ...], Any]] = {}
        self._signatures: dict[tuple, tuple[int, str]] = {}
        self._headers = _wire.Headers()
        self._listening: list[tuple[int, np.ndarray, MPI.Request]] = []
        self._told: list[Any] = []  # aborts sent, alive until MPI has them
        # Per neighbour, the units (arrays, ends of calls) sent to it and received from it,
        # and an abort that came while units it had sent before were still to be received.
        self._units_sent = dict.fromkeys(self._neighbours(), 0)
        self._units_received = dict.fromkeys(self._neighbours(), 0)
        self._held: dict[int, np.ndarray] = {}
        self.comm = None
        if group.size > 1:
            if group.comm == MPI.COMM_NULL:
                raise RuntimeError(f"StageTransfer: group {group.name!r} has been freed")
            comm, request = group.comm.Idup()
            errors.wait(request, f"StageTransfer({self.label!r})", group, debug._timeout)
            self.comm = comm
            for peer in self._neighbours():
                buf = np.zeros(_wire.ABORT_BYTES, np.uint8)
                self._listening.append((peer, buf, comm.Irecv(buf, peer, _wire.ABORT)))
            _board._LIVE.add(self)  # depart() at the end of the program tells the neighbours

    def __repr__(self) -> str:
        return f"StageTransfer({self.pipeline!r}, label={self.label!r})"

    # ------------------------------------------------------------------ the pairs

    def send_forward(self, x: Any, micro_batch: int = 0) -> None:
        """Send activation ``x`` of ``micro_batch`` to the next stage (does not block).

        Parameters
        ----------
        x : numpy.ndarray or cupy.ndarray
            Any shape (at most 8 axes) and dtype; the next stage learns both.
        micro_batch : int, default 0
            Compared by the receiver with the one it expects.
        """
        self._send(x, micro_batch, "forward", self.pipeline.next_rank)

    def recv_forward(self, micro_batch: int = 0, xp: Any = None) -> Any:
        """Receive the previous stage's activation of ``micro_batch``.

        Parameters
        ----------
        micro_batch : int, default 0
        xp : module, optional
            ``numpy`` (default) or ``cupy``: where the array is returned.

        Returns
        -------
        array
            Of the shape and dtype the previous stage sent.
        """
        return self._recv(micro_batch, "forward", self.pipeline.prev_rank, xp)

    def send_backward(self, dx: Any, micro_batch: int = 0) -> None:
        """Send the gradient of this stage's input of ``micro_batch`` to the previous stage
        (does not block); the previous stage checks its shape and dtype against the activation
        it sent."""
        self._send(dx, micro_batch, "backward", self.pipeline.prev_rank)

    def recv_backward(self, micro_batch: int = 0, xp: Any = None) -> Any:
        """Receive the gradient of the activation this stage sent for ``micro_batch``.

        Raises
        ------
        pympar.errors.CollectiveMismatchError
            On every stage, when its shape or dtype is not that activation's.
        """
        return self._recv(micro_batch, "backward", self.pipeline.next_rank, xp)

    def finish(self) -> None:
        """End this call: every stage returns from it, or every stage raises.

        Two waves of a small header run through the pipeline: from the last stage back to
        the first, then from the first on to the last. A stage passes a wave on once it has
        ended its own call, so that one returns only when every stage has ended well; a
        stage that fails stops the waves and tells its neighbours instead. A neighbour that
        still sends data, or ended another call, makes every stage raise
        (:class:`~pympar.errors.CollectiveMismatchError`).
        """
        self._check()
        if self.comm is None:
            return
        sig, shown = self._call("done")
        pipe, what = self.pipeline, f"{shown} (StageTransfer.finish)"
        mine = self._headers.make(_wire.DONE, sig, -1, shown)
        if pipe.is_first:
            self._unit(mine, pipe.next_rank, _wire.FORWARD_HEADER)
        if not pipe.is_last:  # every later stage has ended well
            self._done(pipe.next_rank, _wire.BACKWARD_HEADER, sig, shown, what)
        if not pipe.is_first:
            self._unit(mine, pipe.prev_rank, _wire.BACKWARD_HEADER)
            self._done(pipe.prev_rank, _wire.FORWARD_HEADER, sig, shown, what)  # earlier too
            if not pipe.is_last:
                self._unit(mine, pipe.next_rank, _wire.FORWARD_HEADER)
        self._wait([r for r, _ in self._sends], f"{shown} (the sends)", self._neighbours())
        self._sends.clear()
        self._sent.clear()

    def _unit(self, head: np.ndarray, peer: int, tag: int) -> None:
        """Send ``head``, the end of this call, to ``peer`` (one unit)."""
        self._sends.append((self.comm.Isend(head, peer, tag), head))
        self._units_sent[peer] += 1

    def _done(self, peer: int, tag: int, sig: int, shown: str, what: str) -> None:
        """Receive ``peer``'s end of the call; a mismatch when it is data or another call."""
        words = _wire.empty_header()
        self._wait([self.comm.Irecv(words, peer, tag)], what, [peer], unit_from=peer)
        self._units_received[peer] += 1
        theirs = self._headers.read(words)
        if theirs["kind"] != _wire.DONE or theirs["sig"] != sig:
            said = (f"sent micro-batch {theirs['micro_batch']} of {theirs['shown']}"
                    if theirs["kind"] == _wire.DATA else f"ended {theirs['shown']}")
            self._mismatch(peer, f"{where(self.pipeline.group, peer)} {said}, while "
                                 f"{self._me()} ended {shown}")

    def abort(self, error: BaseException) -> None:
        """Tell both neighbours that this stage ended by ``error`` (raised by its own code,
        not by this transfer): they raise :class:`~pympar.errors.PeerEndedError` and tell
        theirs. Nothing happens when this transfer already failed (it told them)."""
        if self.failed is None:
            self.failed = error
            self._tell(_wire.ENDED, f"{self._me()} raised {type(error).__name__}: {error}")

    def depart(self) -> None:
        """At the end of the program: tell the neighbours that this stage has ended."""
        if self.failed is None and self.comm is not None:
            self.failed = PeerEndedError("this stage's program has ended")
            self._tell(_wire.ENDED, f"{self._me()} ended its program (returned, sys.exit or an "
                                    f"error)")

    def free(self) -> None:
        """Release the communicator (collective over the group; idempotent).

        A transfer that failed keeps its communicator to the end of the program: messages
        its failure left unreceived must never meet the calls of a later communicator, which
        MPI may give the freed one's identity.
        """
        _board._LIVE.discard(self)
        for _, _, request in self._listening:
            if not request.Test():
                request.Cancel()
                request.Wait()
        self._listening.clear()
        if self.comm is not None:
            if self.failed is None:
                self.comm.Free()
            else:
                _KEPT.append(self.comm)
            self.comm = None
        self.failed = self.failed or RuntimeError(f"{self!r} has been freed")

    # ------------------------------------------------------------------ internals

    def _neighbours(self) -> list[int]:
        return [r for r in (self.pipeline.prev_rank, self.pipeline.next_rank) if r is not None]

    def _header_tag(self, peer: int, incoming: bool) -> int:
        """Headers from the previous stage (or to the next) travel forward, others backward."""
        forward = (peer == self.pipeline.prev_rank) == incoming
        return _wire.FORWARD_HEADER if forward else _wire.BACKWARD_HEADER

    def _me(self) -> str:
        return f"stage {self.pipeline.rank} ({where(self.pipeline.group, self.pipeline.rank)})"

    def _call(self, direction: str) -> tuple[int, str]:
        """The signature and words of this rank's call (label block, transfer, direction)."""
        name = _agreement.within(None)
        key = (name, direction)
        found = self._signatures.get(key)
        if found is None:
            shown = f"{name + ': ' if name else ''}StageTransfer({self.label!r}).{direction}"
            found = self._signatures[key] = (_wire.signature(self.label, name, direction), shown)
        return found

    def _check(self) -> None:
        if self.failed is not None:
            raise self.failed

    def _refuse(self, error: Exception, what: str) -> None:
        """Raise ``error``, this rank's refusal of its arguments, after telling the
        neighbours (they raise the mismatch naming it)."""
        if self.failed is None:
            self.failed = error
            self._tell(_wire.MISMATCH, f"{what} on {self._me()}, refused by this rank: {error}")
        raise error

    def _start(self, micro_batch: int, direction: str, peer: int | None,
               sending: bool) -> tuple[int, str, str]:
        """A call's signature and words, and the call with its micro-batch; refused at the
        end of the pipeline where there is no ``peer``."""
        self._check()
        sig, shown = self._call(direction)
        what = f"{shown} of micro-batch {micro_batch}"
        if peer is None:
            end = "last" if (direction == "forward") == sending else "first"
            lack = "no stage to send to" if sending else "nothing to receive"
            self._refuse(ValueError(f"{what}: the {end} stage has {lack}"), what)
        return sig, shown, what

    def _send(self, x: Any, micro_batch: int, direction: str, peer: int | None) -> None:
        sig, shown, what = self._start(micro_batch, direction, peer, sending=True)
        if not (isinstance(x, np.ndarray) or backend.is_cupy_array(x)):
            self._refuse(TypeError(f"{what}: expected a numpy.ndarray or cupy.ndarray, not "
                                   f"{type(x).__name__}"), what)
        if x.ndim > _wire.MAX_DIMS:
            self._refuse(ValueError(f"{what}: at most {_wire.MAX_DIMS} axes, got {x.ndim}"), what)
        try:
            _wire.dtype_name(x.dtype)
            datatype = backend.mpi_datatype(x.dtype)
        except TypeError as error:
            self._refuse(error, what)
        if self.comm is None:  # one stage: nothing to send to (refused above)
            return
        start = time.perf_counter()
        head = self._headers.make(_wire.DATA, sig, micro_batch, shown, x)
        data = _wire.outgoing(x)
        header_tag, data_tag = _wire.TAGS[direction]
        # The earlier sends that are complete let go of their arrays (not these two: just
        # posted, the payload's is not, and testing it costs more than the rest of the call).
        self._sends = [(r, keep) for r, keep in self._sends if not r.Test()]
        self._sends.append((self.comm.Isend(head, peer, header_tag), head))
        self._sends.append((self.comm.Isend([_wire.raw(data), datatype], peer, data_tag), data))
        self._units_sent[peer] += 1
        if direction == "forward":
            self._sent[micro_batch] = (tuple(x.shape), x.dtype)
        if stats.is_recording():
            stats.add(self.pipeline.name, f"pipeline.send_{direction}", x.nbytes, 0,
                      time.perf_counter() - start)

    def _recv(self, micro_batch: int, direction: str, peer: int | None, xp: Any) -> Any:
        sig, shown, what = self._start(micro_batch, direction, peer, sending=False)
        start = time.perf_counter()
        header_tag, data_tag = _wire.TAGS[direction]
        words = _wire.empty_header()
        self._wait([self.comm.Irecv(words, peer, header_tag)], what, [peer], unit_from=peer)
        theirs = self._headers.read(words)
        group = self.pipeline.group
        if theirs["kind"] != _wire.DATA:
            self._mismatch(peer, f"{where(group, peer)} ended {theirs['shown']} while "
                                 f"{self._me()} expects {what}: a stage ended early")
        if theirs["sig"] != sig or theirs["micro_batch"] != micro_batch:
            self._mismatch(peer, f"{where(group, peer)} sent micro-batch "
                                 f"{theirs['micro_batch']} of {theirs['shown']}, while "
                                 f"{self._me()} expects {what}")
        shape, dtype = theirs["shape"], theirs["dtype"]
        if direction == "backward":
            sent = self._sent.pop(micro_batch, None)
            if sent is not None and (sent[0] != shape or sent[1] != dtype):
                self._mismatch(peer, f"{where(group, peer)} sent the gradient of micro-batch "
                                     f"{micro_batch} as {_wire.describe(shape, dtype)}, but "
                                     f"{self._me()} sent that activation as "
                                     f"{_wire.describe(*sent)} ({shown}): a stage's backward "
                                     f"must return a gradient shaped as its input")
        out, wire = _wire.incoming(shape, dtype, xp)
        self._wait([self.comm.Irecv([_wire.raw(wire), backend.mpi_datatype(dtype)], peer,
                                    data_tag)],
                   what, [peer], unit_from=peer)
        self._units_received[peer] += 1
        out = _wire.arrived(out, wire)
        if stats.is_recording():
            stats.add(self.pipeline.name, f"pipeline.recv_{direction}", 0, out.nbytes,
                      time.perf_counter() - start)
        return out

    def _wait(self, requests: list[MPI.Request], what: str, peers: list[int],
              unit_from: int | None = None) -> None:
        """Complete ``requests`` (waiting on ``peers``; a unit from ``unit_from``), listening
        for the neighbours' aborts and completing pending sends meanwhile; the watchdog's
        timeout raises. An abort from ``unit_from`` that came after this unit was sent waits
        until the unit is in (it raises at the next wait on that neighbour)."""
        test = MPI.Request.Testall
        for peer in [p for p in self._held if p != unit_from or not self._owed(p)]:
            self._aborted(peer, self._held.pop(peer))
        for _ in range(errors.SPINS):  # a message already there: as fast as a Wait
            if test(requests):
                return
        timeout = debug._timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        start = time.monotonic()
        yielding, delay = start + 0.01, 1e-5
        while not test(requests):
            for peer, buf, request in self._listening:
                if peer not in self._held and request.Test():
                    self._held[peer] = buf
                    if peer != unit_from or not self._owed(peer):
                        self._aborted(peer, self._held.pop(peer))
            if self._sends:
                self._sends = [(r, k) for r, k in self._sends if not r.Test()]
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                error = timeout_error(what, self.pipeline.group, timeout, requests, peers)
                self.failed = error
                self._tell(_wire.ENDED, f"{self._me()} timed out waiting for "
                                        f"{where(self.pipeline.group, *peers)} in {what}")
                raise error
            if now < yielding:
                errors.yield_core()
            else:
                delay = errors.doze(delay, now - start)

    def _owed(self, peer: int) -> bool:
        """Whether ``peer``'s held abort came after units not yet received here."""
        return _wire.read_abort(self._held[peer])[2] > self._units_received[peer]

    def _tell(self, kind: int, text: str, exclude: int | None = None) -> None:
        """Send every neighbour but ``exclude`` an abort (not waited for: the neighbours'
        listeners are posted since the transfer was made)."""
        if self.comm is None:
            return
        for peer in self._neighbours():
            if peer != exclude:
                message = _wire.abort_message(kind, text, self._units_sent[peer])
                self._told += [message, self.comm.Isend(message, peer, _wire.ABORT)]

    def _mismatch(self, peer: int, text: str) -> None:
        """Raise the mismatch with ``peer`` here, after telling every neighbour."""
        message = (f"neighbouring stages of pipeline group {self.pipeline.name!r} disagree: "
                   f"{text}; every stage must make the same calls (schedule, micro-batches, "
                   f"label) in the same order")
        error = CollectiveMismatchError(message)
        self.failed = error
        self._tell(_wire.MISMATCH, message)
        raise error

    def _aborted(self, peer: int, buf: np.ndarray) -> None:
        """A neighbour's abort arrived: pass it on to the other neighbour and raise it."""
        kind, text, _ = _wire.read_abort(buf)
        group = self.pipeline.group
        heard = f"{self._me()} heard it from {where(group, peer)}"
        if kind == _wire.MISMATCH:
            error: Exception = CollectiveMismatchError(f"{text} ({heard})")
        else:
            error = PeerEndedError(f"pipeline group {self.pipeline.name!r}: {text}; "
                                   f"{heard}, so the pipeline cannot go on")
        self.failed = error
        self._tell(kind, text, exclude=peer)
        raise error
