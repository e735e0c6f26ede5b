"""The steps of :func:`pympar.checkpoint.load`, in the order it runs them.

Each step does one thing; :func:`~pympar.checkpoint.load` runs every step through
:func:`~pympar.checkpoint._shared.attempt`, so a failure on any rank raises the same error
on all of them before the next step starts.
"""

from __future__ import annotations

import math
import os
import stat
from typing import Any

import numpy as np
from mpi4py import MPI

from . import exchange
from ._shared import agree, call_key, open_fd, optimizer_names, replicas, same_call, tensors_of
from .checksums import AdlerSums, Chunks, verdict
from .files import Buffer, box_runs, file_reader, read_box, replica_share
from .format import MANIFEST, CheckpointError, check_header, logical_name, parse_manifest

__all__ = ["compare_calls", "read_manifest", "check", "plan_reads", "read_files", "verify",
           "optimizer_state"]

#: The largest manifest read (about 90 KB per GiB of data: 2.8 TB of checkpoint).
_MANIFEST_LIMIT = 256 * 2**20


def compare_calls(comm: MPI.Intracomm, directory: str, optimizer: Any) -> None:
    """Compare the call across ranks first; collective.

    Rank 0 reads the manifest for all: ranks passing another path would read other files
    under it (a wrong "corrupted").
    """
    shown = f"passes path={directory!r}, optimizer={type(optimizer).__name__}"
    keys = np.empty(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([call_key(shown)], dtype=np.int64), keys)
    same_call(comm, "checkpoint.load", shown, keys)


def read_manifest(comm: MPI.Intracomm, directory: str) -> bytes:
    """The manifest's bytes on every rank: rank 0 reads, then broadcasts; collective."""
    raw, error = b"", None
    if comm.Get_rank() == 0:
        try:
            raw = _manifest_bytes(directory)
        except CheckpointError as err:
            error = str(err)
        except OSError as err:
            error = f"{type(err).__name__}: {err}"
    agree(comm, error)
    length = comm.bcast(len(raw), root=0)
    text = np.zeros(length, dtype=np.uint8)
    if comm.Get_rank() == 0:
        text[:] = np.frombuffer(raw, dtype=np.uint8)
    comm.Bcast(text, root=0)
    return text.tobytes()


def _manifest_bytes(directory: str) -> bytes:
    manifest = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory) or not os.path.lexists(manifest):
        raise CheckpointError(f"{directory} is not a complete checkpoint (no {MANIFEST})")
    if not stat.S_ISREG(os.lstat(manifest).st_mode):
        raise CheckpointError(f"{MANIFEST} in {directory} is not a regular file")
    with open(manifest, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > _MANIFEST_LIMIT:
            raise CheckpointError(f"{MANIFEST} holds {size} bytes, more than any manifest "
                                  f"({_MANIFEST_LIMIT}); refused")
        return f.read(size)


def check(directory: str, text: bytes, model: Any, optimizer: Any) -> tuple:
    """The manifest, tensors, optimizer state and data offsets, everything checked.

    Nothing trusts the manifest: names, files, dtypes and shapes against the model, every
    header against its entry, every file's length against its header.
    """
    manifest = parse_manifest(directory, text)
    tensors, _ = tensors_of(model, optimizer)
    # The optimizer first: another optimizer type is named as such, not as missing moments.
    state = None if optimizer is None else optimizer_state(manifest, model, optimizer)
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


def plan_reads(comm: MPI.Intracomm, tensors: list, buffer: Buffer) -> tuple[list, list]:
    """Which tensors are read as row slabs and traded (:mod:`~pympar.checkpoint.exchange`),
    and each block's ``(count, index)`` among its replicas; collective."""
    blocks = [list(t.placement.pieces()) for t in tensors]
    return exchange.plan(comm, tensors, blocks, buffer.nbytes), replicas(comm, tensors)


def read_files(comm: MPI.Intracomm, manifest: dict, tensors: list, offsets: list, slabs: list,
               holders: list, buffer: Buffer) -> list:
    """Read every rank's blocks straight into its arrays, feeding the checksum tallies.

    The exchanged tensors first (collective: every rank takes part in each, even after a
    failed read), then each rank's own reads. Every byte of a file is fed by one rank: a
    slab by its reader; a block contiguous in the file by each replica's share of it; any
    other block by its first replica.
    """
    entries = manifest["tensors"]
    tallies = [_tally(manifest["version"], entries[t.name], t) for t in tensors]
    error: BaseException | None = None
    for i in (i for i, boxes in enumerate(slabs) if boxes is not None):
        t, fd = tensors[i], None
        try:
            fd = os.open(entries[t.name]["path"], os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except Exception as err:  # noqa: BLE001 - the exchange goes on
            error = error or err
        try:
            failed = exchange.read_slabs(comm, fd, offsets[i], t, slabs[i], buffer, tallies[i])
            error = error or failed
            if fd is not None and error is None:
                tallies[i].finish(file_reader(fd, offsets[i], buffer))
        finally:
            if fd is not None:
                os.close(fd)
    if error is not None:
        raise error
    for i, t in enumerate(tensors):
        if slabs[i] is not None:
            continue
        with open_fd(entries[t.name]["path"]) as fd:
            count, index = holders[i]
            for g, lo in t.placement.pieces():
                verified = _verified_bytes(t, g, count, index)
                read_box(fd, offsets[i], t.placement.shape, g, t.array[(*lo, ...)], t.stored,
                         buffer, tallies[i] if verified else None, verified)
            tallies[i].finish(file_reader(fd, offsets[i], buffer))
    return tallies


def _tally(version: int, entry: dict, t: Any) -> Any:
    total = math.prod(t.placement.shape) * t.stored.itemsize
    return AdlerSums(total) if version == 1 else Chunks(total, entry["chunk_bytes"])


def _verified_bytes(t: Any, box: tuple, count: int, index: int) -> tuple[int, int] | None:
    """The data bytes of ``box`` this rank feeds: all of it for an only holder; its share
    for one of several replicas when every replica's share is one contiguous range; else
    all of it for the first replica and nothing for the others."""
    shape, itemsize = t.placement.shape, t.stored.itemsize
    everything = (0, math.prod(shape) * itemsize)
    if count == 1:
        return everything
    parts = [replica_share(box, count, k) for k in range(count)]
    runs = [box_runs(shape, p) if p is not None else (np.zeros(0), 0) for p in parts]
    if all(len(starts) <= 1 for starts, _ in runs):
        starts, length = runs[index]
        if not len(starts):
            return None
        return int(starts[0]) * itemsize, (int(starts[0]) + length) * itemsize
    return everything if index == 0 else None


def verify(comm: MPI.Intracomm, manifest: dict, tensors: list, tallies: list) -> None:
    """Compare every file's checksum with the manifest; one error on every rank; collective."""
    entries = manifest["tensors"]
    key = "adler32" if manifest["version"] == 1 else "digests"
    agree(comm, verdict(comm, [t.name for t in tensors],
                        [entries[t.name]["file"] for t in tensors], tallies,
                        [entries[t.name][key] for t in tensors]))


def optimizer_state(manifest: dict, model: Any, optimizer: Any) -> dict:
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
