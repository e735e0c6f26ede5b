"""Checkpoint save and load bandwidth on 1, 2 and 4 ranks, against the disk and torch DCP.

Run on 4 ranks (the 1- and 2-rank figures use the first ranks of the job while the others
sleep)::

    PYTHONPATH=. mpiexec -n 4 python -m mpi4py benchmarks/bench_checkpoint.py \\
        [--size 1GiB | --quick] [--repeats 3] [--dir DIR] [--json PATH]

The state is a model of ``float32`` weights ``(rows, 4096)`` plus AdamW's two moments
(``--size`` in all, about a third each), split over the ranks like tensor-parallel layers:
half the weights by rows (Column-parallel: one contiguous block per rank in the file), half
by columns (Row-parallel: one run of ``4096 / ranks`` values per row). Variants,
interleaved round by round, each a median over rounds, each rate = state bytes / seconds
of the slowest rank:

* ``disk write``: one process writes the same number of bytes to a new file in 8 MiB
  ``os.write`` calls and ``fsync`` s it (the disk's own figure in this run);
* ``disk read, cold``: one process reads that file back into one preallocated array of its
  size, after ``posix_fadvise(DONTNEED)`` dropped it from the page cache: the disk's read
  (the loads below read from the page cache, as a restart right after a save would);
* ``raw read into preallocated arrays``: every rank reads its share (``1/ranks``, one
  contiguous range of each file) of the saved checkpoint's ``.npy`` files, from the page
  cache, into preallocated arrays of those sizes with one ``os.preadv`` per file, all at
  once (no checksum, no layout);
* ``raw copy from a mapping into preallocated arrays``: the same shares copied with one
  ``numpy.copyto`` each out of a read-only ``mmap`` of the file, all at once. The faster of
  these two is the least any load of these files must do. (Which one is faster depends on
  the file offset: on this VM's kernel a ``preadv`` of the page cache from a page-aligned
  offset ran at 1.6-1.8 GB/s and from the ``.npy`` data offsets, 128 bytes past a page, at
  5.5-6 GB/s; the copy ran at 4.4-5.7 GB/s from either, one process, 128 MiB);
* ``raw read and hash into preallocated arrays``: the same shares read with ``os.preadv``
  in pieces of 1 MiB (the load's), each hashed with xxHash3-64 (the load's checksum) right
  after it is read: what a load that verifies every byte it reads must at least do (no
  layout). With every core reading, the hash's time adds to the read's (xxHash3 ran at
  34-43 GB/s on cache-hot 1 MiB pieces, the read at 5.5-6 GB/s per core): 0.72, 0.78 and
  0.74 of the raw read on 1, 2 and 4 ranks (the committed run: 1 GiB, 5 rounds);
* ``disk write, a file per rank``: every rank writes its share of the bytes to a file of
  its own the same way, all at once: what the disk gives writers that never meet and
  ``fsync`` at the end (torch DCP writes this way; a writer that starts the write-back
  early, as pympar's save does, can beat it);
* ``pympar save`` (:func:`pympar.checkpoint.save`, fsync'd and committed);
* ``pympar load same layout`` and ``pympar load other layout`` (each weight split along
  its other axis: every rank reads other byte ranges than it wrote);
* ``torch DCP save`` / ``torch DCP load`` (``torch.distributed.checkpoint`` over gloo, each
  rank's shards as its own tensors) when torch is installed.

Every variant that writes starts from the same state: what its previous sample wrote is
deleted and ``os.sync`` ed just before, outside the timing (:func:`remove`; on a file system
mounted with ``discard`` the freed blocks would otherwise be trimmed during whichever
variant comes next). On the VM these figures come from, a write that follows an idle
pause ran at about half the speed of one that follows a sync, for the plain disk write
and the save alike, so unequal starting states would decide the ratios. Ratios are
medians over rounds of the two variants' ratio within a round.

It also reports the peak extra memory per rank of one save and one load (``tracemalloc``:
NumPy's allocations, not the page cache).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import xxhash
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from pympar import checkpoint  # noqa: E402
from pympar.checkpoint.files import PIECE_BYTES  # noqa: E402
from pympar.modules import Module, Parameter  # noqa: E402
from pympar.optim import AdamW  # noqa: E402
from pympar.partition import Placement, Split, block_slice  # noqa: E402

WORLD = MPI.COMM_WORLD
TENSORS = 8  # weights; each has two Adam moments
#: The raw reads of the saved shares, by the key of the load's ratio to each.
RAW_ANCHORS = {"raw_read": "raw read into preallocated arrays",
               "raw_copy": "raw copy from a mapping into preallocated arrays",
               "raw_verified": "raw read and hash into preallocated arrays"}


def parse_size(text: str) -> int:
    """``"1GiB"``, ``"48MiB"`` or a byte count."""
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * factor)
    return int(text)


def build(comm: MPI.Comm, rows: int, cols: int, swap: bool) -> tuple[Module, AdamW]:
    """The model, weights split alternately along axes 0 and 1 (swapped: 1 and 0), with AdamW
    state."""
    model = Module()
    for i in range(TENSORS):
        axis = (i + swap) % 2
        place = Placement((rows, cols), (Split(axis, comm.Get_size(), comm.Get_rank()),))
        data = np.full(place.local_shape, float(i), dtype=np.float32)
        setattr(model, f"w{i}", Parameter(data, placement=place))
    opt = AdamW(model.parameters(), lr=1e-3)
    for m in opt.exp_avg + opt.exp_avg_sq:
        m[...] = 0.5
    return model, opt


def disk_write(path: str, nbytes: int) -> float:
    """Seconds for one process to write ``nbytes`` in 8 MiB calls, with fsync."""
    view = memoryview(np.ones(8 * 2**20, dtype=np.uint8))
    start = time.perf_counter()
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, view[:min(left, len(view))])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def disk_read_cold(path: str, into: np.ndarray) -> float:
    """Seconds for one process to read the file at ``path`` (dropped from the page cache
    first, untimed) into ``into``, in 8 MiB calls."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        view = memoryview(into).cast("B")
        start = time.perf_counter()
        at = 0
        while at < len(view):
            got = os.preadv(fd, [view[at:at + 8 * 2**20]], at)
            if not got:
                break
            at += got
        return time.perf_counter() - start
    finally:
        os.close(fd)


class RawRead:
    """This rank's share of each ``.npy`` file of a checkpoint, read into arrays of its sizes.

    The share of a file is the balanced ``1/ranks`` of its data bytes, one contiguous range;
    the arrays are allocated and touched once, outside the timing. ``how`` it is read:

    * ``"read"``: one ``os.preadv`` per file;
    * ``"copy"``: one ``numpy.copyto`` out of a read-only ``mmap`` of the file made in the
      timing;
    * ``"verified"``: ``os.preadv`` in pieces of the load's size
      (:data:`pympar.checkpoint.files.PIECE_BYTES`), each hashed with xxHash3-64 (the load's
      checksum) right after it is read, while it is in the cache: what a load that verifies
      every byte it reads must at least do.
    """

    def __init__(self, comm: MPI.Comm, directory: str, how: str = "read") -> None:
        self.how, self.ranges = how, []
        for name in sorted(os.listdir(directory)):
            if not name.endswith(".npy"):
                continue
            path = os.path.join(directory, name)
            head = np.load(path, mmap_mode="r", allow_pickle=False)
            offset = os.path.getsize(path) - head.nbytes  # the data end the file
            share = block_slice(head.nbytes, comm.Get_size(), comm.Get_rank())
            into = np.ones(share.stop - share.start, dtype=np.uint8)
            self.ranges.append((path, offset + share.start, into))

    def __call__(self) -> None:
        for path, offset, into in self.ranges:
            fd = os.open(path, os.O_RDONLY)
            try:
                if self.how == "copy":
                    self._copy(fd, offset, into)
                    continue
                view, at = memoryview(into), 0
                step = PIECE_BYTES if self.how == "verified" else len(view)
                while at < len(view):
                    stop = min(at + step, len(view))
                    done = at
                    while done < stop:
                        got = os.preadv(fd, [view[done:stop]], offset + done)
                        if not got:
                            raise EOFError(f"{path} ends early")
                        done += got
                    if self.how == "verified":
                        xxhash.xxh3_64_intdigest(view[at:stop])
                    at = stop
            finally:
                os.close(fd)

    @staticmethod
    def _copy(fd: int, offset: int, into: np.ndarray) -> None:
        if not into.size:
            return
        with mmap.mmap(fd, offset + into.size, access=mmap.ACCESS_READ) as mapping:
            source = np.frombuffer(mapping, dtype=np.uint8, count=into.size, offset=offset)
            np.copyto(into, source)
            del source  # the view goes before the mapping closes


def remove(comm: MPI.Comm, path: str, every_rank: bool = False) -> None:
    """Delete ``path`` (file or folder, if there) on rank 0 (or each rank its own) and sync
    the file system, untimed."""
    if (every_rank or comm.Get_rank() == 0) and os.path.lexists(path):
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        os.sync()
    comm.Barrier()


def timed(comm: MPI.Comm, fn) -> float:
    comm.Barrier()
    start = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)


def measure(comm: MPI.Comm, size: int, repeats: int, root: str, torch_group=None) -> dict:
    """All variants on the ranks of ``comm``; rates in GB/s."""
    ranks = comm.Get_size()
    cols = 4096
    rows = max(size // (3 * TENSORS * cols * 4), ranks)
    nbytes = 3 * TENSORS * rows * cols * 4
    model, opt = build(comm, rows, cols, swap=False)
    other, other_opt = build(comm, rows, cols, swap=True)
    where = os.path.join(root, f"p{ranks}")
    counter = [0]

    def fresh() -> str:
        counter[0] += 1
        return os.path.join(where, f"c{counter[0]}")

    saved = checkpoint.save(os.path.join(where, "loaded"), model, opt, comm=comm)
    raw_read, raw_copy = RawRead(comm, saved), RawRead(comm, saved, how="copy")
    raw_verified = RawRead(comm, saved, how="verified")
    cold = np.ones(nbytes if comm.Get_rank() == 0 else 0, dtype=np.uint8)
    torch_dcp = None if torch_group is None else _torch(comm, model, opt, where, torch_group)

    def sample_save() -> float:
        remove(comm, os.path.join(where, f"c{counter[0]}"))  # the previous sample's
        path = fresh()
        return timed(comm, lambda: checkpoint.save(path, model, opt, comm=comm))

    def sample_disk_write() -> float:
        remove(comm, os.path.join(where, "raw"))
        return comm.bcast(disk_write(os.path.join(where, "raw"), nbytes)
                          if comm.Get_rank() == 0 else None)

    def sample_disk_write_every_rank() -> float:
        mine = os.path.join(where, f"raw.{comm.Get_rank()}")
        remove(comm, mine, every_rank=True)
        share = block_slice(nbytes, ranks, comm.Get_rank())
        return timed(comm, lambda: disk_write(mine, share.stop - share.start))

    samplers = {
        "disk write": sample_disk_write,
        "disk write, a file per rank": sample_disk_write_every_rank,
        "disk read, cold": lambda: comm.bcast(disk_read_cold(os.path.join(where, "raw"), cold)
                                              if comm.Get_rank() == 0 else None),
        "raw read into preallocated arrays": lambda: timed(comm, raw_read),
        "raw copy from a mapping into preallocated arrays": lambda: timed(comm, raw_copy),
        "raw read and hash into preallocated arrays": lambda: timed(comm, raw_verified),
        "pympar save": sample_save,
        "pympar load same layout": lambda: timed(
            comm, lambda: checkpoint.load(saved, model, opt, comm=comm)),
        "pympar load other layout": lambda: timed(
            comm, lambda: checkpoint.load(saved, other, other_opt, comm=comm)),
    }
    if torch_dcp is not None:
        samplers.update(torch_dcp)
    samples = common.interleaved(samplers, repeats, 1, comm)
    rates = {name: nbytes / common.median(s) / 1e9 for name, s in samples.items()}
    remove(comm, os.path.join(where, f"c{counter[0]}"))

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    path = checkpoint.save(fresh(), model, opt, comm=comm)
    save_peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.reset_peak()
    checkpoint.load(path, other, other_opt, comm=comm)
    load_peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    shard = max(p.data.nbytes for p in model.parameters())
    return {"ranks": ranks, "state_bytes": nbytes, "gbps": rates,
            "seconds": {k: common.median(v) for k, v in samples.items()},
            "samples": samples,
            "peak_extra_bytes": {"save": comm.allreduce(save_peak, op=MPI.MAX),
                                 "load": comm.allreduce(load_peak, op=MPI.MAX)},
            "largest_shard_bytes": shard, "buffer_bytes": checkpoint.BUFFER_BYTES}


def torch_groups(sizes: list[int]) -> dict[int, object]:
    """One gloo group per job size, made on every rank of the world (torch needs that)."""
    torch, reason = common.import_torch_distributed()
    if torch is None:
        common.say(WORLD, f"torch DCP skipped: {reason}")
        return {}
    import torch.distributed as dist

    if not dist.is_initialized():
        common.init_torch_gloo(WORLD)
    return {n: dist.new_group(list(range(n))) for n in sizes}


def _torch(comm: MPI.Comm, model: Module, opt: AdamW, where: str, group: object):
    """Samplers for torch.distributed.checkpoint over ``group`` (the ranks of ``comm``)."""
    import torch
    import torch.distributed.checkpoint as dcp

    rank = comm.Get_rank()
    state = {}
    for i, p in enumerate(model.parameters()):
        for key, arr in (("w", p.data), ("m", opt.exp_avg[i]), ("v", opt.exp_avg_sq[i])):
            state[f"{key}{i}.rank{rank}"] = torch.from_numpy(arr)
    counter = [0]

    def save() -> float:
        remove(comm, os.path.join(where, f"dcp{counter[0]}"))  # the previous sample's
        counter[0] += 1
        path = os.path.join(where, f"dcp{counter[0]}")
        return timed(comm, lambda: dcp.save(state, checkpoint_id=path, process_group=group))

    def load() -> float:
        if not counter[0]:
            save()
        path = os.path.join(where, f"dcp{counter[0]}")
        return timed(comm, lambda: dcp.load(state, checkpoint_id=path, process_group=group))

    return {"torch DCP save": save, "torch DCP load": load}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1GiB", help="model + Adam state bytes (e.g. 1GiB, 48MiB)")
    p.add_argument("--quick", action="store_true", help="48 MiB, 2 repeats")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    size, repeats = (48 * 2**20, 2) if args.quick else (parse_size(args.size), args.repeats)
    root = WORLD.bcast(tempfile.mkdtemp(prefix="pympar-bench-ckpt-", dir=args.dir)
                       if WORLD.rank == 0 else None)
    results = []
    try:
        sizes = sorted({1, 2, 4} & set(range(1, WORLD.size + 1)))
        groups = torch_groups(sizes)
        for ranks in sizes:
            sub = WORLD.Split(0 if WORLD.rank < ranks else MPI.UNDEFINED, WORLD.rank)
            if sub != MPI.COMM_NULL:
                results.append(measure(sub, size, repeats, root, groups.get(ranks)))
                sub.Free()
            common.sleep_barrier(WORLD)
    finally:
        WORLD.Barrier()
        if WORLD.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    machine = common.machine_info()  # collective over WORLD
    if WORLD.rank == 0:
        for r in results:
            print(f"{r['ranks']} rank(s), {r['state_bytes'] / 2**30:.2f} GiB state: " + ", ".join(
                f"{k} {v:.2f} GB/s" for k, v in r["gbps"].items()))
            print(f"   peak extra per rank: save {r['peak_extra_bytes']['save'] / 2**20:.1f} MiB, "
                  f"load {r['peak_extra_bytes']['load'] / 2**20:.1f} MiB (largest shard "
                  f"{r['largest_shard_bytes'] / 2**20:.1f} MiB, buffer "
                  f"{r['buffer_bytes'] / 2**20:.0f} MiB)")
        common.write_json(args.json, {"benchmark": "checkpoint", "machine": machine,
                                      "size": size, "repeats": repeats, "results": results,
                                      "ratios": _ratios(results)})
    return 0


def _ratios(results: list[dict]) -> list[dict]:
    """Speed ratios (rate over rate, i.e. time over time inverted), each the median over
    rounds of the two variants' ratio in the same round: the disk of this machine drifts
    by 2x within a minute, and a round's samples run within seconds of each other."""
    out = []
    for r in results:
        s = r["samples"]

        def paired(a: str, b: str) -> float:  # speed of a over speed of b
            return common.paired_ratio(s[b], s[a])

        row = {"ranks": r["ranks"], "save_vs_disk_write": paired("pympar save", "disk write"),
               "load_other_vs_same": paired("pympar load same layout",
                                            "pympar load other layout")}
        for anchor, variant in RAW_ANCHORS.items():
            if variant in s:
                for layout in ("same", "other"):
                    row[f"load_{layout}_vs_{anchor}"] = paired(f"pympar load {layout} layout",
                                                               variant)
        row["save_vs_disk_every_rank"] = paired("pympar save", "disk write, a file per rank")
        if "torch DCP save" in s:
            row["torch_dcp_vs_disk_every_rank"] = paired("torch DCP save",
                                                         "disk write, a file per rank")
            row["save_vs_torch_dcp"] = paired("pympar save", "torch DCP save")
            row["load_vs_torch_dcp"] = paired("pympar load same layout", "torch DCP load")
            row["load_other_vs_torch_dcp"] = paired("pympar load other layout", "torch DCP load")
        out.append(row)
    return out


if __name__ == "__main__":
    sys.exit(main())
