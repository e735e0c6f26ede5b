"""``save``, ``load`` and ``latest``: collective checkpoints written in the serial layout.

Every rank writes its own block of every tensor straight into the full ``.npy`` file at
computed offsets (``os.pwrite``); ranks holding the same block (replicas) split it so each
writes about ``1/replicas`` of it. Nothing is gathered. A load reads straight into the
arrays where the layout allows, hashing the bytes as they arrive. The ranks agree
on every verdict with one small all-reduce, so an error is raised on every rank with the
same message. The steps are in :mod:`~pympar.checkpoint.saving` and
:mod:`~pympar.checkpoint.loading`.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from typing import Any

from . import exchange, loading, parts, saving
from ._shared import attempt, default_comm, shares, tensors_of
from .checksums import gather_digests
from .files import Buffer
from .format import FORMAT, MANIFEST

__all__ = ["save", "load", "latest"]

#: Bytes of the host staging buffer each rank uses for a save or a load.
BUFFER_BYTES = 8 * 2**20


def save(path: str | os.PathLike, model: Any, optimizer: Any = None, *, step: int | None = None,
         extra: Any = None, keep: int | None = None, comm: Any = None) -> str:
    """Write a checkpoint of ``model`` (and ``optimizer``) to the directory ``path``; collective.

    Parameters
    ----------
    path : str or path-like
        The checkpoint directory to create; it must not exist. Its parent is created if needed.
    model : Module
        Each parameter is saved under its dotted name as the full serial-layout array, from
        every rank's block (``Parameter.placement``). A model that holds part of a model
        (``holds_part_of_model``: a pipeline stage) saves its parameters, and the other
        ranks' parts theirs: the checkpoint is the whole model's.
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
        (ordered as :func:`latest` orders them) so that ``keep`` remain, this one always
        among them, whatever its ``step``.
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
        different ``path``, ``step``, ``keep`` or optimizer (its type and hyperparameters;
        named); ``path`` is then not created (a
        temporary directory may remain; it is never loaded).
    """
    comm = default_comm(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    path = attempt(comm, _absolute, path)
    buffer = Buffer(BUFFER_BYTES)
    tensors, meta = attempt(comm, saving.prepare, rank, path, model, optimizer, step, extra,
                            keep)
    tensors, meta = parts.complete(comm, model, tensors, meta)  # a model split over ranks
    saving.compare_calls(comm, path, step, keep, tensors, meta)
    pieces = attempt(comm, shares, comm, tensors)
    temp = saving.make_temp(comm, path)
    attempt(comm, saving.create_files, rank, size, temp, tensors)
    # Blocks of short runs (split along a trailing axis) are traded for row slabs first.
    slabs = attempt(comm, exchange.plan, comm, tensors, pieces, buffer.nbytes)
    tallies = attempt(comm, saving.write_files, comm, temp, tensors, pieces, slabs, buffer)
    attempt(comm, saving.complete_chunks, temp, tensors, tallies, buffer)
    digests = attempt(comm, gather_digests, comm, tallies)
    attempt(comm, saving.commit, rank, temp, path, tensors, digests, meta, step, extra, keep,
            _retain)
    return path


def _absolute(path: str | os.PathLike) -> str:
    """``path`` made absolute (a TypeError for what is not a path, raised on every rank
    through :func:`attempt`)."""
    return os.path.abspath(os.fspath(path))


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


def _retain(directory: str, keep: int, saved: str) -> None:
    """Delete the oldest complete checkpoints in ``directory`` but ``saved`` (the one just
    written, whatever its step) so that ``keep`` remain."""
    older = [found for _, _, found in _complete(directory) if found != saved]
    for old in older[:max(len(older) - (keep - 1), 0)]:
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

    Each rank reads its own block straight into its arrays: with positioned reads where the
    block is contiguous in the file, else copied with strides out of a read-only mapping of
    the file. Before a parameter is changed, the manifest and every file's header and size
    are verified; the checksums (xxHash3-64 of every chunk, or a version-1 checkpoint's
    Adler-32) are computed by each rank over its balanced share of every file, on the bytes
    as its reads pass over them where it can, and compared once all are read.

    Parameters
    ----------
    path : str or path-like
        A checkpoint directory written by :func:`save`.
    model : Module
        Receives every saved parameter of the same dotted name; full shapes and dtypes must
        match, layouts need not. A part of a model (a pipeline stage) receives its own, the
        ranks together every saved one, whatever cut the saving run had.
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
        Nothing has been changed when it is raised before the data are read (anything but a
        checksum mismatch or a failing read). After a checksum mismatch the parameters and
        moments hold the damaged data; the optimizer's steps and hyperparameters are never
        changed: load another checkpoint.
    """
    comm = default_comm(comm)
    directory = attempt(comm, _absolute, path)
    loading.compare_calls(comm, directory, optimizer)
    text = loading.read_manifest(comm, directory)
    tensors, meta = parts.complete(comm, model, *attempt(comm, tensors_of, model, optimizer))
    manifest, tensors, state, offsets = attempt(comm, loading.check, directory, text, model,
                                                optimizer, tensors, meta)
    tallies = attempt(comm, loading.read_files, comm.Get_rank(), comm.Get_size(), manifest,
                      tensors, offsets, Buffer(BUFFER_BYTES))
    loading.verify(comm, manifest, tensors, tallies)
    if optimizer is not None:
        attempt(comm, optimizer.load_local_state_dict, state)
    return manifest.get("step"), manifest.get("extra")
