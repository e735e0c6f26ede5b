"""The steps of :func:`pympar.checkpoint.load`, in the order it runs them.

Each step does one thing; :func:`~pympar.checkpoint.load` runs every step through
:func:`~pympar.checkpoint._shared.attempt`, so a failure on any rank raises the same error
on all of them before the next step starts.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
from typing import Any

import numpy as np
from mpi4py import MPI

from ..partition import block_slice
from ._shared import agree, call_key, open_fd, optimizer_names, same_call
from .checksums import AdlerSums, Chunks, verdict
from .files import Buffer, box_runs, read_box, read_range
from .format import MANIFEST, CheckpointError, check_header, chunk_count, logical_name, \
    parse_manifest

__all__ = ["compare_calls", "read_manifest", "check", "read_files", "verify", "optimizer_state"]

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


def check(directory: str, text: bytes, model: Any, optimizer: Any, tensors: list,
          meta: dict | None) -> tuple:
    """The manifest, tensors, optimizer state and data offsets, everything checked.

    ``tensors`` and ``meta`` are the model's and optimizer's (:func:`~pympar.checkpoint.
    _shared.tensors_of`), completed by those held on other ranks
    (:func:`~pympar.checkpoint.parts.complete`). Nothing trusts the manifest: names, files,
    dtypes and shapes against the model, every header against its entry, every file's
    length against its header.
    """
    manifest = parse_manifest(directory, text)
    # The optimizer first: another optimizer type is named as such, not as missing moments.
    state = None if optimizer is None else optimizer_state(
        manifest, model, optimizer, set(meta["steps"]) if meta else None)
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


def read_files(rank: int, size: int, manifest: dict, tensors: list, offsets: list,
               buffer: Buffer) -> list:
    """Read this rank's blocks straight into its arrays; hash this rank's share of each file.

    A block that is contiguous in the file and lands in contiguous host memory is read with
    positioned reads (:func:`~pympar.checkpoint.files.read_range`); any other NumPy block is
    copied, with strides, out of a read-only mapping of the file (one copy from the page
    cache and no system call per run, where a row-slab exchange cost a read, a pack and a
    transfer); CuPy blocks go through the staging buffer. Verification does not depend on the
    layout: rank ``r`` hashes the ``r``-th balanced share of each file's chunks (format 1:
    of its bytes), the pieces its reads pass over while they are in the cache, the rest
    straight from the mapping. Nothing here communicates.
    """
    entries = manifest["tensors"]
    tallies = []
    for t, offset in zip(tensors, offsets):
        tally = _tally(manifest["version"], entries[t.name], t)
        with open_fd(entries[t.name]["path"]) as fd:
            _read_tensor(fd, offset, t, tally, _own_bytes(tally, rank, size), buffer)
        tallies.append(tally)
    return tallies


def _read_tensor(fd: int, offset: int, t: Any, tally: Any, own: tuple[int, int],
                 buffer: Buffer) -> None:
    """This rank's blocks of tensor ``t`` into its arrays, and its share hashed.

    The data bytes are mapped read-only (``mmap``). The file's length was checked against
    its header; a file that another process truncates while it is mapped ends this process
    (``SIGBUS``), as it would any reader of a mapping.
    """
    mapping = mmap.mmap(fd, offset + tally.total, access=mmap.ACCESS_READ) \
        if tally.total else None
    data = None
    try:
        if mapping is not None:
            data = np.frombuffer(mapping, dtype=np.uint8, count=tally.total, offset=offset)
        for g, lo in t.placement.pieces():
            _read_block(fd, offset, t, g, t.array[(*lo, ...)], data, buffer,
                        tally if tally.fed_while_reading else None, own)
        tally.complete(*own, lambda at, n: memoryview(data[at:at + n]))
    finally:
        data = None  # the views go before the mapping closes
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:  # a view held by an error's traceback: closed when freed
                pass


def _tally(version: int, entry: dict, t: Any) -> Any:
    total = math.prod(t.placement.shape) * t.stored.itemsize
    return AdlerSums(total) if version == 1 else Chunks(total, entry["chunk_bytes"])


def _own_bytes(tally: Any, rank: int, size: int) -> tuple[int, int]:
    """The data bytes this rank verifies: its balanced share of the chunks (of the bytes)."""
    if isinstance(tally, AdlerSums):
        share = block_slice(tally.total, size, rank)
        return share.start, share.stop
    share = block_slice(chunk_count(tally.total, tally.chunk), size, rank)
    return share.start * tally.chunk, min(share.stop * tally.chunk, tally.total)


def _read_block(fd: int, data_offset: int, t: Any, box: tuple, dst: Any, data: Any,
                buffer: Buffer, tally: Any, own: tuple[int, int]) -> None:
    """Fill ``dst`` with the ``box`` of tensor ``t``'s file (``data``: the mapped data bytes),
    feeding ``tally`` the bytes read within ``own``."""
    shape, stored = t.placement.shape, t.stored
    starts, _ = box_runs(shape, box)
    if not len(starts):
        return
    if len(starts) == 1 and isinstance(dst, np.ndarray) and dst.flags.c_contiguous \
            and dst.dtype == stored:
        read_range(fd, data_offset, int(starts[0]) * stored.itemsize,
                   memoryview(dst).cast("B"), tally, own)
    elif isinstance(dst, np.ndarray):
        np.copyto(dst, data.view(stored).reshape(shape)[box])
    else:  # CuPy: staged through the host buffer
        read_box(fd, data_offset, shape, box, dst, stored, buffer)


def verify(comm: MPI.Intracomm, manifest: dict, tensors: list, tallies: list) -> None:
    """Compare every file's checksum with the manifest; one error on every rank; collective."""
    entries = manifest["tensors"]
    key = "adler32" if manifest["version"] == 1 else "digests"
    agree(comm, verdict(comm, [t.name for t in tensors],
                        [entries[t.name]["file"] for t in tensors], tallies,
                        [entries[t.name][key] for t in tensors]))


def optimizer_state(manifest: dict, model: Any, optimizer: Any,
                    stepped: set[str] | None = None) -> dict:
    """The optimizer's local state with the saved steps and hyperparameters, checked.

    Its arrays are the live buffers, which the load then fills with the saved blocks.
    ``stepped``: the parameters the ranks' optimizers step together (by default this one's),
    which must be the saved optimizer's.
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
    stepped = set(by_name) if stepped is None else stepped
    if set(saved["steps"]) != stepped:
        extra, missing = sorted(stepped - set(saved["steps"])), sorted(set(saved["steps"])
                                                                         - stepped)
        raise CheckpointError(f"the optimizer given steps other parameters than the saved one: "
                              f"{extra[:8]}{' ...' * (len(extra) > 8)} not in the checkpoint's "
                              f"optimizer state, {missing[:8]}{' ...' * (len(missing) > 8)} "
                              f"saved but not in the optimizer given; build it over the "
                              f"parameters it was saved with")
    for name, i in by_name.items():
        state["state"][i]["step"] = saved["steps"][name]
    state["type"], state["hyperparameters"] = saved["type"], saved.get("hyperparameters")
    try:
        optimizer.check_local_state_dict(state)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"optimizer state: {err}") from None
    return state
