"""Every layout mapping on a tiny array, so the layouts can be seen.

    mpiexec -n 2 python examples/mapping_tour.py      (any number of ranks)

All ten mappings of :mod:`pympar.mappings` are shown.
The global array has 5 rows (sequence, axis 0) and 3 columns (hidden, last
axis): nothing divides evenly, so the balanced split shows. Each line prints
what every rank holds after the forward and after the backward of a mapping.
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from pympar import manager, mappings
from pympar.launch import RankZeroParser


def show(title: str, arrays: list[np.ndarray]) -> None:
    """Print each rank's array on one line (called on rank 0 with gathered arrays)."""
    print(f"\n{title}")
    for rank, a in enumerate(arrays):
        body = np.array2string(a, separator=",", max_line_width=200).replace("\n", "")
        print(f"  rank {rank}: shape {a.shape!s:8} {body}")


def main(argv=None) -> int:
    """Walk through every mapping on the whole world as one group."""
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    parser = RankZeroParser(prog="mapping_tour.py", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    if size == 1 and rank == 0:
        print("a single process: nothing is split. Start it under a launcher to see the "
              "layouts, e.g. `mpiexec -n 2 python examples/mapping_tour.py`")
    manager.initialize_parallel(tensor_parallel_size=size, context_parallel_size=1)
    tp = manager.get_tensor_parallel_group()
    full = np.arange(15.0).reshape(5, 3)
    rows = np.array_split(np.arange(5), size)[rank]
    cols = np.array_split(np.arange(3), size)[rank]
    partial = full * (rank + 1)  # a per-rank partial value: the logical value is the sum
    steps = [
        ("copy_to_all", full, {}, full, {}),
        ("reduce_from_all", partial, {}, full, {}),
        ("scatter_to_hidden", full, {}, full[:, cols], {"global_size": 3}),
        ("gather_from_hidden", full[:, cols], {"global_size": 3}, full, {}),
        ("scatter_to_sequence", full, {}, full[rows], {"global_size": 5}),
        ("gather_from_sequence", full[rows], {"global_size": 5}, full, {}),
        ("reduce_scatter_to_sequence", partial, {}, full[rows], {"global_size": 5}),
        ("reduce_scatter_to_hidden", partial, {}, full[:, cols], {"global_size": 3}),
    ]
    if rank == 0:
        print(f"{size} ranks, group {tp.name}; the global array is\n{full}")
    for name, x, options, dy, back_options in steps:
        mapping = getattr(mappings, name)
        y = mapping(x, group=tp, **options)
        dx = mapping.backward(dy, group=tp, **back_options)
        ys, dxs = comm.gather(np.asarray(y), root=0), comm.gather(np.asarray(dx), root=0)
        if rank == 0:
            show(f"{name}: forward  ({mapping.__doc__.split('. ')[0]})", ys)
            show(f"{name}: backward of the forward's output layout", dxs)
    manager.destroy_parallel()

    # Ulysses: sequence shards become head shards on the context-parallel group.
    manager.initialize_parallel(context_parallel_size=size)
    cp = manager.get_context_parallel_group()
    heads = np.arange(5 * 4, dtype=float).reshape(5, 4)  # [sequence, heads]
    x = heads[rows]
    y = mappings.all_to_all_from_sequence_to_hidden(x, group=cp)
    back = mappings.all_to_all_from_sequence_to_hidden.backward(y, group=cp)
    inverse = mappings.all_to_all_from_hidden_to_sequence(y, group=cp)
    inverse_back = mappings.all_to_all_from_hidden_to_sequence.backward(x, group=cp)
    ys, backs = comm.gather(y, root=0), comm.gather(back, root=0)
    inverses, inverse_backs = comm.gather(inverse, root=0), comm.gather(inverse_back, root=0)
    if rank == 0:
        show("all_to_all_from_sequence_to_hidden: [S/P, H] -> [S, H/P]", ys)
        show("its backward returns the sequence shards, bitwise", backs)
        show("all_to_all_from_hidden_to_sequence: [S, H/P] -> [S/P, H] (the inverse)", inverses)
        show("its backward: [S/P, H] -> [S, H/P]", inverse_backs)
    exact = (np.array_equal(back, x) and np.array_equal(inverse, x)
             and np.array_equal(inverse_back, y))
    same = comm.allreduce(bool(exact), op=MPI.LAND)
    manager.destroy_parallel()
    if rank == 0:
        print(f"\nround trip exact on every rank: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
