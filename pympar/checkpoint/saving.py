"""The steps of :func:`pympar.checkpoint.save`, in the order it runs them.

Each step does one thing; :func:`~pympar.checkpoint.save` runs every step through
:func:`~pympar.checkpoint._shared.attempt`, so a failure on any rank raises the same error
on all of them before the next step starts.
"""

from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from mpi4py import MPI

from ..partition import block_slice
from . import exchange
from ._shared import agree, call_key, file_name, same_call, signature, tensors_of
from .checksums import Chunks
from .files import Buffer, file_reader, write_box
from .format import CHUNK_BYTES, FORMAT, MANIFEST, VERSION, CheckpointError, hex_digests, \
    logical_name, npy_header

__all__ = ["prepare", "compare_calls", "make_temp", "create_files", "write_files",
           "complete_chunks", "commit"]

#: Files a rank keeps open (unsynced) while writing; then they are fsync'd and closed.
_OPEN_FILES = 64


def prepare(rank: int, path: str, model: Any, optimizer: Any, step: Any, extra: Any,
            keep: Any) -> tuple[list, dict | None]:
    """Check the arguments (rank 0: ``extra`` is JSON, ``path`` is free); the tensors."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise CheckpointError(f"step must be an int or None, got {step!r}")
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise CheckpointError(f"keep must be an int >= 1, got {keep!r}")
    if rank == 0:
        json.dumps(extra)  # refuse non-JSON extras before any byte is written
        if os.path.lexists(path):
            raise CheckpointError(f"{path} exists; a checkpoint is never overwritten")
    return tensors_of(model, optimizer)


def compare_calls(comm: MPI.Intracomm, path: str, step: Any, keep: Any, tensors: list,
                  meta: dict | None = None) -> None:
    """One exchange compares the call and the tensors; collective.

    A rank saving elsewhere, or another step, would leave a checkpoint of some ranks only,
    or say what no rank meant; so would an optimizer (its type and hyperparameters, in
    ``meta``) that some ranks pass and others not, or pass otherwise: the manifest holds one.
    """
    optimizer = None if meta is None else f"{meta['type']}({meta['hyperparameters']!r})"
    shown = f"passes path={path!r}, step={step!r}, keep={keep!r}, optimizer={optimizer}"
    mine = np.array([call_key(shown), signature(tensors)], dtype=np.int64)
    keys = np.empty((comm.Get_size(), 2), dtype=np.int64)
    comm.Allgather(mine, keys)
    same_call(comm, "checkpoint.save", shown, keys[:, 0])
    agree(comm, None if (keys[:, 1] == keys[0, 1]).all() else
          "the ranks disagree on the model's tensors (names, full shapes or dtypes)")


def make_temp(comm: MPI.Intracomm, path: str) -> str:
    """A fresh temporary directory beside ``path``, made and named by rank 0; collective."""
    parent, base = os.path.split(path)
    name = np.zeros(256, dtype=np.uint8)
    error = None
    if comm.Get_rank() == 0:
        try:
            os.makedirs(parent, exist_ok=True)
            temp = os.fsencode(f".{base}.tmp-{os.getpid()}-{time.time_ns()}")
            os.mkdir(os.path.join(os.fsencode(parent), temp))
            name[:len(temp)] = np.frombuffer(temp, dtype=np.uint8)  # bytes, not characters
        except Exception as err:  # noqa: BLE001 - any failure must reach the other ranks
            error = f"{type(err).__name__}: {err}"
    agree(comm, error)
    comm.Bcast(name, root=0)
    return os.path.join(parent, os.fsdecode(bytes(name).rstrip(b"\0")))


def create_files(rank: int, size: int, temp: str, tensors: list) -> None:
    """Rank ``i % size`` creates file ``i``: header written, data region sized."""
    for i, t in enumerate(tensors):
        if i % size == rank:
            header = npy_header(t.placement.shape, t.stored)
            fd = os.open(os.path.join(temp, file_name(i)), os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                         0o644)
            try:
                os.pwrite(fd, header, 0)
                os.ftruncate(fd, len(header) + _data_bytes(t))
            finally:
                os.close(fd)


def write_files(comm: MPI.Intracomm, temp: str, tensors: list, pieces: list, slabs: list,
                buffer: Buffer) -> list[Chunks]:
    """Write this rank's share of every tensor; the hashes of the chunks it wrote.

    The exchanged tensors first (collective: every rank takes part in each, in the same
    order, even after a failed write, reported once they are all done), then the direct
    writes, each rank starting at its own tensor (ranks writing runs of the same file at once
    queue on its inode lock and share pages at the runs' ends). Each piece is hashed right
    before it is written, and a buffer-full's write-back starts at once; the fsyncs run
    together at the end (one journal commit for many files, not one per file), at most
    :data:`_OPEN_FILES` files behind.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    tallies = [Chunks(_data_bytes(t), CHUNK_BYTES) for t in tensors]
    written: list[int] = []

    def open_file(i: int) -> int:
        if len(written) == _OPEN_FILES:
            _fsync_all(written)
            while written:
                os.close(written.pop())
        written.append(os.open(os.path.join(temp, file_name(i)), os.O_WRONLY))
        return written[-1]

    error: BaseException | None = None
    try:
        for i in (i for i, boxes in enumerate(slabs) if boxes is not None):
            t = tensors[i]
            rows = block_slice(t.placement.shape[0], size, rank)
            fd = None
            if rows.stop > rows.start and error is None:
                try:
                    fd = open_file(i)
                except Exception as err:  # noqa: BLE001 - the exchange goes on
                    error = err
            failed = exchange.write_slabs(comm, fd, _data_offset(t), t, slabs[i], buffer,
                                          tallies[i])
            error = error or failed
        if error is not None:
            raise error
        start = rank * len(tensors) // size
        for i in [*range(start, len(tensors)), *range(start)]:
            t = tensors[i]
            if slabs[i] is not None or i % size != rank and not any(
                    math.prod(s.stop - s.start for s in g) for g, _ in pieces[i]):
                continue  # nothing to write here; the creator still fsyncs the header
            fd = open_file(i)
            for g, lo in pieces[i]:
                write_box(fd, _data_offset(t), t.placement.shape, g, t.array[(*lo, ...)],
                          t.stored, buffer, tallies[i])
        _fsync_all(written)
    finally:
        for fd in written:
            os.close(fd)
    return tallies


def complete_chunks(temp: str, tensors: list, tallies: list[Chunks], buffer: Buffer) -> None:
    """Hash the rest of each chunk this rank began but another rank wrote, from the files
    (every rank has written and synced its share by now)."""
    for i, (t, tally) in enumerate(zip(tensors, tallies)):
        if tally.incomplete:
            fd = os.open(os.path.join(temp, file_name(i)), os.O_RDONLY)
            try:
                tally.finish(file_reader(fd, _data_offset(t), buffer))
            finally:
                os.close(fd)


def commit(rank: int, temp: str, path: str, tensors: list, digests: list | None, meta: Any,
           step: Any, extra: Any, keep: Any, retain: Any) -> None:
    """Rank 0 writes the manifest last, renames ``temp`` to ``path`` and applies ``keep``."""
    if rank != 0:
        return
    entries = {}
    for i, t in enumerate(tensors):
        entries[t.name] = {"file": file_name(i), "shape": list(t.placement.shape),
                           "dtype": logical_name(t.logical), "chunk_bytes": CHUNK_BYTES,
                           "xxh3_64": hex_digests(digests[i])}
    manifest = {"format": FORMAT, "version": VERSION, "step": step, "extra": extra,
                "optimizer": meta, "tensors": entries}
    _commit(temp, path, json.dumps(manifest, indent=1).encode())
    if keep is not None:
        retain(os.path.dirname(path), keep, path)


def _data_bytes(t: Any) -> int:
    return math.prod(t.placement.shape) * t.stored.itemsize


def _data_offset(t: Any) -> int:
    """Where the data of tensor ``t``'s ``.npy`` file start (the header's length)."""
    return len(npy_header(t.placement.shape, t.stored))


def _commit(temp: str, path: str, manifest: bytes) -> None:
    """Manifest last, everything fsync'd, then the atomic rename of ``temp`` to ``path``."""
    fd = os.open(os.path.join(temp, MANIFEST), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        view = memoryview(manifest)
        while len(view):
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync_dir(temp)
    if os.path.lexists(path):
        raise CheckpointError(f"{path} appeared while saving; not overwritten")
    os.rename(temp, path)
    _fsync_dir(os.path.dirname(path))


def _fsync_all(fds: list[int]) -> None:
    """``fsync`` the files at once, one thread each (up to 16): their write-backs overlap."""
    if len(fds) <= 1:
        for fd in fds:
            os.fsync(fd)
        return
    with ThreadPoolExecutor(min(len(fds), 16)) as pool:
        list(pool.map(os.fsync, fds))


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
