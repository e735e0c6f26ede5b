"""``save``, ``load`` and ``latest``: collective checkpoints written in the serial layout.

Every rank writes its own block of every tensor straight into the full ``.npy`` file at
computed offsets (``os.pwrite``); ranks holding the same block (replicas) split it so each
writes about ``1/replicas`` of it. Nothing is gathered. The ranks agree on every verdict with
one small all-reduce, so an error is raised on every rank with the same message.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from mpi4py import MPI

from ..partition import block_slice
from . import exchange
from ._shared import (agree, attempt, call_key, default_comm, file_name, open_fd,
                      optimizer_names, same_call, shares, signature, tensors_of)
from .files import Buffer, adler_total, checksum_range, read_box, write_box
from .format import (FORMAT, MANIFEST, VERSION, CheckpointError, check_header, logical_name,
                     npy_header, parse_manifest)

__all__ = ["save", "load", "latest"]

#: Bytes of the host staging buffer each rank uses for a save or a load.
BUFFER_BYTES = 8 * 2**20
_MANIFEST_LIMIT = 64 * 2**20
_OPEN_FILES = 64


def save(path: str | os.PathLike, model: Any, optimizer: Any = None, *, step: int | None = None,
         extra: Any = None, keep: int | None = None, comm: Any = None) -> str:
    """Write a checkpoint of ``model`` (and ``optimizer``) to the directory ``path``; collective.

    Parameters
    ----------
    path : str or path-like
        The checkpoint directory to create; it must not exist. Its parent is created if needed.
    model : Module
        Each parameter is saved under its dotted name as the full serial-layout array, from
        every rank's block (``Parameter.placement``).
    optimizer : Optimizer or ZeroRedundancyOptimizer, optional
        Its moments are saved as ``optimizer/<param name>/<key>`` tensors, its step counts and
        hyperparameters in the manifest. Each rank writes the block its
        ``local_state_dict()`` holds at ``state_placements()``: a ZeRO optimizer's shares go
        straight into the full files, never gathered, and read back as the plain optimizer's.
    step : int, optional
        Stored in the manifest; :func:`latest` orders checkpoints by it.
    extra : JSON-compatible, optional
        Anything else the program needs to resume (rank 0's value is saved).
    keep : int, optional
        After the commit, delete the oldest complete checkpoints in the same parent directory
        so that ``keep`` remain.
    comm : mpi4py communicator or Group, optional
        The ranks taking part: by default those of the current parallel state (else
        ``MPI.COMM_WORLD``).

    Returns
    -------
    str
        ``path``.

    Raises
    ------
    CheckpointError
        On every rank, with the same message, when any rank fails, or when the ranks pass
        different ``path``, ``step`` or ``keep`` (named); ``path`` is then not created (a
        temporary directory may remain; it is never loaded).
    """
    comm = default_comm(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    path = os.path.abspath(os.fspath(path))
    parent, base = os.path.split(path)
    buffer = Buffer(BUFFER_BYTES)

    def prepare():
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise CheckpointError(f"step must be an int or None, got {step!r}")
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise CheckpointError(f"keep must be an int >= 1, got {keep!r}")
        if rank == 0:
            json.dumps(extra)  # refuse non-JSON extras before any byte is written
            if os.path.lexists(path):
                raise CheckpointError(f"{path} exists; a checkpoint is never overwritten")
        return tensors_of(model, optimizer)

    tensors, meta = attempt(comm, prepare)
    # One exchange compares the call (a rank saving elsewhere, or another step, would
    # leave a checkpoint of some ranks only, or say what no rank meant) and the tensors.
    shown = f"passes path={os.path.abspath(os.fspath(path))!r}, step={step!r}, keep={keep!r}"
    mine = np.array([call_key(shown), signature(tensors)], dtype=np.int64)
    keys = np.empty((size, 2), dtype=np.int64)
    comm.Allgather(mine, keys)
    same_call(comm, "checkpoint.save", shown, keys[:, 0])
    agree(comm, None if (keys[:, 1] == keys[0, 1]).all() else
          "the ranks disagree on the model's tensors (names, full shapes or dtypes)")
    blocks = attempt(comm, shares, comm, tensors)

    # A fresh temporary directory beside the target, named by rank 0.
    name = np.zeros(256, dtype=np.uint8)

    def make_temp():
        if rank == 0:
            os.makedirs(parent, exist_ok=True)
            temp = f".{base}.tmp-{os.getpid()}-{time.time_ns()}"
            os.mkdir(os.path.join(parent, temp))
            name[:len(temp)] = np.frombuffer(temp.encode(), dtype=np.uint8)

    attempt(comm, make_temp)
    comm.Bcast(name, root=0)
    temp = os.path.join(parent, bytes(name).rstrip(b"\0").decode())

    def create_files():
        # Rank i % size creates file i: header written, data region sized.
        for i, t in enumerate(tensors):
            if i % size == rank:
                header = npy_header(t.placement.shape, t.stored)
                nbytes = math.prod(t.placement.shape) * t.stored.itemsize
                fd = os.open(os.path.join(temp, file_name(i)), os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                             0o644)
                try:
                    os.pwrite(fd, header, 0)
                    os.ftruncate(fd, len(header) + nbytes)
                finally:
                    os.close(fd)

    attempt(comm, create_files)
    sums = np.zeros((len(tensors), 2), dtype=np.int64)

    # Blocks of short runs (split along a trailing axis) are traded for row slabs first.
    slabs = attempt(comm, exchange.plan, comm, tensors, blocks, buffer.nbytes)

    def write_files():
        # Each chunk's write-back starts as soon as it is written and its checksum runs on a
        # helper thread meanwhile; the fsyncs then run together at the end (one journal
        # commit for many files, not one per file), at most _OPEN_FILES files behind.
        written: list[int] = []
        error: BaseException | None = None

        def open_file(i: int) -> int:
            if len(written) == _OPEN_FILES:
                _fsync_all(written)
                while written:
                    os.close(written.pop())
            written.append(os.open(os.path.join(temp, file_name(i)), os.O_WRONLY))
            return written[-1]

        with ThreadPoolExecutor(1) as checksums:
            try:
                # The exchanges are collective: every rank takes part in each, in the same
                # order, even after a failed write (reported once they are all done).
                for i in (i for i, boxes in enumerate(slabs) if boxes is not None):
                    t = tensors[i]
                    rows = block_slice(t.placement.shape[0], size, rank)
                    fd = None
                    if rows.stop > rows.start and error is None:
                        try:
                            fd = open_file(i)
                        except Exception as err:  # noqa: BLE001 - the exchange goes on
                            error = err
                    failed = exchange.write_slabs(comm, fd, _data_offset(t), t, slabs[i],
                                                  buffer, sums[i], checksums)
                    error = error or failed
                if error is not None:
                    raise error
                # Each rank starts at its own tensor: ranks writing runs of the same file at
                # once queue on its inode lock and share pages at the runs' ends.
                start = rank * len(tensors) // size
                for i in [*range(start, len(tensors)), *range(start)]:
                    t, pieces = tensors[i], blocks[i]
                    if slabs[i] is not None or i % size != rank and not any(
                            math.prod(s.stop - s.start for s in g) for g, _ in pieces):
                        continue  # nothing to write here; the creator still fsyncs the header
                    fd = open_file(i)
                    for g, lo in pieces:
                        write_box(fd, _data_offset(t), t.placement.shape, g,
                                  t.array[(*lo, ...)], t.stored, buffer, sums[i], checksums)
                _fsync_all(written)
            finally:
                for fd in written:
                    os.close(fd)

    attempt(comm, write_files)
    comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)

    def commit():
        if rank == 0:
            entries = {}
            for i, t in enumerate(tensors):
                total = math.prod(t.placement.shape) * t.stored.itemsize
                entries[t.name] = {"file": file_name(i), "shape": list(t.placement.shape),
                                   "dtype": logical_name(t.logical),
                                   "checksum": f"adler32:{adler_total(sums[i], total):08x}"}
            manifest = {"format": FORMAT, "version": VERSION, "step": step, "extra": extra,
                        "optimizer": meta, "tensors": entries}
            _commit(temp, path, json.dumps(manifest, indent=1).encode())
            if keep is not None:
                _retain(parent, keep)

    attempt(comm, commit)
    return path


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


def _complete(directory: str) -> list[tuple[int, float, str]]:
    """``(step, mtime, path)`` of each complete checkpoint directly inside ``directory``."""
    found = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return found
    for entry in names:
        if entry.startswith("."):
            continue  # temporary (partial) directories
        manifest = os.path.join(directory, entry, MANIFEST)
        try:
            info = os.lstat(manifest)
            if not stat.S_ISREG(info.st_mode):
                continue
            with open(manifest, "rb") as f:
                data = json.loads(f.read())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("format") == FORMAT:
            step = data.get("step")
            found.append((step if isinstance(step, int) else -1, info.st_mtime,
                          os.path.join(directory, entry)))
    return sorted(found)


def _retain(directory: str, keep: int) -> None:
    for _, _, old in _complete(directory)[:-keep]:
        shutil.rmtree(old)


def latest(directory: str | os.PathLike) -> str | None:
    """The newest complete checkpoint directly inside ``directory``, or None; not collective.

    Complete means renamed into place with a readable ``manifest.json``; temporary directories
    (names starting with ``.``) are ignored. Newest: the highest ``step``, then modification time.
    """
    found = _complete(os.path.abspath(os.fspath(directory)))
    return found[-1][2] if found else None


def load(path: str | os.PathLike, model: Any, optimizer: Any = None, *,
         comm: Any = None) -> tuple[int | None, Any]:
    """Load a checkpoint into ``model`` (and ``optimizer``) under any layout; collective.

    Each rank reads only its own block of each tensor. Before a parameter is changed, the
    manifest, every file's header and size, and every file's checksum (each rank checking one
    contiguous range of each file) are verified.

    Parameters
    ----------
    path : str or path-like
        A checkpoint directory written by :func:`save`.
    model : Module
        Receives every saved parameter of the same dotted name; full shapes and dtypes must
        match, layouts need not.
    optimizer : Optimizer or ZeroRedundancyOptimizer, optional
        Receives the saved moments, step counts and hyperparameters (same optimizer type;
        ZeRO counts as the class it wraps), each rank reading only its block (its shard, or
        its share under ZeRO) whatever the saving run's layout and sharding.
    comm : mpi4py communicator or Group, optional
        As for :func:`save`.

    Returns
    -------
    step : int or None
    extra : JSON value
        As given to :func:`save`.

    Raises
    ------
    CheckpointError
        On every rank, naming the tensor: a missing, truncated, corrupted (checksum) or
        untrusted file, a tensor missing or fitting no parameter, an unknown format version,
        the state of another optimizer type; ranks passing different paths (named), or an
        optimizer on some ranks only.
        Nothing has been changed when it is raised before the data are read.
    """
    comm = default_comm(comm)
    rank = comm.Get_rank()
    directory = os.path.abspath(os.fspath(path))
    # Rank 0 reads the manifest for all: ranks passing another path would read other
    # files under it (a wrong "corrupted"), so the call is compared first.
    shown = f"passes path={directory!r}, optimizer={type(optimizer).__name__}"
    keys = np.empty(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([call_key(shown)], dtype=np.int64), keys)
    same_call(comm, "checkpoint.load", shown, keys)
    length = np.zeros(1, dtype=np.int64)
    raw: list[bytes] = [b""]

    def read_manifest():
        if rank == 0:
            manifest = os.path.join(directory, MANIFEST)
            if not os.path.isdir(directory) or not os.path.lexists(manifest):
                raise CheckpointError(f"{directory} is not a complete checkpoint (no {MANIFEST})")
            if not stat.S_ISREG(os.lstat(manifest).st_mode):
                raise CheckpointError(f"{MANIFEST} in {directory} is not a regular file")
            with open(manifest, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > _MANIFEST_LIMIT:
                    raise CheckpointError(f"{MANIFEST} holds {size} bytes, more than any "
                                          f"manifest ({_MANIFEST_LIMIT}); refused")
                raw[0] = f.read(size)
            length[0] = len(raw[0])

    attempt(comm, read_manifest)
    comm.Bcast(length, root=0)
    text = np.zeros(int(length[0]), dtype=np.uint8)
    if rank == 0:
        text[:] = np.frombuffer(raw[0], dtype=np.uint8)
    comm.Bcast(text, root=0)

    def check():
        manifest = parse_manifest(directory, text.tobytes())
        tensors, _ = tensors_of(model, optimizer)
        # The optimizer first: another optimizer type is named as such, not as missing moments.
        state = None if optimizer is None else _optimizer_state(manifest, model, optimizer)
        entries = manifest["tensors"]
        names = {t.name for t in tensors}
        for t in tensors:
            entry = entries.get(t.name)
            if entry is None:
                raise CheckpointError(f"tensor {t.name!r} is missing from the checkpoint")
            if entry["shape"] != t.placement.shape or entry["logical"] != t.logical:
                raise CheckpointError(f"tensor {t.name!r}: the checkpoint holds shape "
                                      f"{entry['shape']} {entry['dtype']}, which fits no "
                                      f"parameter (the model's is {t.placement.shape} "
                                      f"{logical_name(t.logical)})")
        for name in entries:
            if name not in names:
                raise CheckpointError(f"tensor {name!r} of the checkpoint fits no parameter of "
                                      "the model")
        offsets = [check_header(entries[t.name], t.name) for t in tensors]
        return manifest, tensors, state, offsets

    manifest, tensors, state, offsets = attempt(comm, check)
    buffer = Buffer(BUFFER_BYTES)
    entries = manifest["tensors"]
    sums = np.zeros((len(tensors), 2), dtype=np.int64)

    def verify():
        # Pass 1: each rank checksums one contiguous range of every file; nothing is touched.
        for i, t in enumerate(tensors):
            total = math.prod(t.placement.shape) * t.stored.itemsize
            mine = block_slice(total, comm.Get_size(), rank)
            if mine.stop > mine.start:
                with open_fd(entries[t.name]["path"]) as fd:
                    checksum_range(fd, offsets[i], mine.start, mine.stop, total, buffer, sums[i])

    attempt(comm, verify)
    comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
    bad = None
    for i, t in enumerate(tensors):
        total = math.prod(t.placement.shape) * t.stored.itemsize
        if adler_total(sums[i], total) != entries[t.name]["adler32"]:
            bad = bad or (f"tensor {t.name!r}: checksum mismatch in {entries[t.name]['file']} "
                          "(the file is corrupted)")
    agree(comm, bad)

    def place():
        # Pass 2: every rank reads its whole block straight into its arrays.
        for i, t in enumerate(tensors):
            with open_fd(entries[t.name]["path"]) as fd:
                for g, lo in t.placement.pieces():
                    read_box(fd, offsets[i], t.placement.shape, g, t.array[(*lo, ...)], t.stored,
                             buffer)
        if optimizer is not None:
            optimizer.load_local_state_dict(state)

    attempt(comm, place)
    return manifest.get("step"), manifest.get("extra")


def _optimizer_state(manifest: dict, model: Any, optimizer: Any) -> dict:
    """The optimizer's local state with the saved steps and hyperparameters, checked.

    Its arrays are the live buffers, which the load then fills with the saved blocks.
    """
    saved = manifest.get("optimizer")
    if not isinstance(saved, dict) or not isinstance(saved.get("steps"), dict):
        raise CheckpointError("the checkpoint holds no optimizer state")
    if saved.get("type") != optimizer.local_state_dict()["type"]:
        raise CheckpointError(f"the checkpoint holds the state of a {saved.get('type')!r} "
                              f"optimizer, not of the {optimizer.local_state_dict()['type']!r} "
                              f"given ({type(optimizer).__name__})")
    state = optimizer.local_state_dict()
    by_name = {n: i for i, n in enumerate(optimizer_names(model, optimizer))}
    if set(saved["steps"]) != set(by_name):
        raise CheckpointError("the checkpoint's optimizer steps name other parameters")
    for name, i in by_name.items():
        state["state"][i]["step"] = saved["steps"][name]
    state["type"], state["hyperparameters"] = saved["type"], saved.get("hyperparameters")
    try:
        optimizer.check_local_state_dict(state)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"optimizer state: {err}") from None
    return state
