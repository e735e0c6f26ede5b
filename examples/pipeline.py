"""Train a token model over pipeline x tensor x data parallelism; check it on one rank.

    mpiexec -n 4 python -m mpi4py examples/pipeline.py                # 2 stages x TP 2
    mpiexec -n 4 python -m mpi4py examples/pipeline.py --pp 4 --tp 1  # 4 stages
    mpiexec -n 4 python -m mpi4py examples/pipeline.py --tp 1 --schedule gpipe  # DP 2

The data are sequences of a random Markov chain over ``--vocab`` tokens (each token has
three possible successors, with probabilities 0.6, 0.3 and 0.1); the model learns to
predict the next token, so its loss falls from ``log(vocab)`` towards the chain's
entropy (0.90). The model is a chain of layers (Megatron's token model without
attention):

* :class:`~pympar.modules.VocabParallelEmbedding` (the vocabulary split over the tensor
  group, any size), ``--layers`` residual blocks
  ``x + Row(GELU(Column(LayerNorm(x))))``, a :class:`~pympar.modules.LayerNorm`, and a
  :class:`~pympar.modules.ColumnParallelLinear` head whose logits stay split over the
  vocabulary, into :class:`~pympar.modules.VocabParallelCrossEntropy`: no rank holds the
  full ``(tokens, vocabulary)`` logits;
* the chain is cut by depth into ``--pp`` stages (:func:`pympar.pipeline.split_stages`),
  each built on its own ranks only, and trained by the GPipe or 1F1B schedule
  (:mod:`pympar.pipeline`) on ``--micro-batches`` micro-batches per step;
* the ranks left over split every batch (data parallelism); gradients are summed over
  them, each replica's loss gradient scaled by its share of the batch.

Each step's loss is the mean over the whole batch. At the end every rank trains the same
chain unsplit, on one rank with the whole batch at once, and rank 0 prints both losses
and their largest relative difference; the exit status is 1 when it exceeds
``--tolerance``.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from pympar import manager
from pympar.launch import RankZeroParser, finalize_and_exit, launcher_hint, report_error
from pympar.modules import (GELU, ColumnParallelLinear, LayerNorm, Module,
                            RowParallelLinear, Sequential, VocabParallelCrossEntropy,
                            VocabParallelEmbedding)
from pympar.optim import AdamW, allreduce_gradients
from pympar.partition import block_slice
from pympar.pipeline import GPipe, OneFOneB, split_stages

#: How to run this example (said when it is started as one process without a launcher).
COMMAND = "examples/pipeline.py"
SCHEDULES = {"gpipe": GPipe, "1f1b": OneFOneB}

# ---------------------------------------------------------------- the data


def markov_chain(vocab: int, seed: int) -> np.ndarray:
    """The chain's transition matrix: three successors per token, 0.6, 0.3 and 0.1."""
    rng = np.random.default_rng(seed)
    moves = np.zeros((vocab, vocab))
    for token in range(vocab):
        nexts = rng.choice(vocab, size=min(3, vocab), replace=False)
        moves[token, nexts] = [0.6, 0.3, 0.1][:len(nexts)]
    return moves / moves.sum(axis=1, keepdims=True)


def batch(moves: np.ndarray, step: int, rows: int, length: int,
          seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s whole batch, the same on every rank: ``rows`` sequences of the
    chain, the tokens and the tokens that follow them, each ``(rows, length)``."""
    rng = np.random.default_rng([seed, step])
    vocab = len(moves)
    tokens = np.empty((rows, length + 1), dtype=np.int64)
    tokens[:, 0] = rng.integers(vocab, size=rows)
    cumulative = moves.cumsum(axis=1)
    for t in range(length):
        drawn = rng.random(rows)[:, None]
        after = (drawn > cumulative[tokens[:, t]]).sum(axis=1)
        tokens[:, t + 1] = np.minimum(after, vocab - 1)
    return tokens[:, :-1], tokens[:, 1:]


# ---------------------------------------------------------------- the model


class Block(Module):
    """``x + Row(GELU(Column(LayerNorm(x))))``: a tensor-parallel residual MLP."""

    def __init__(self, hidden: int, dtype: Any, group: Any, seed: int) -> None:
        super().__init__()
        self.norm = LayerNorm(hidden, dtype=dtype)
        self.up = ColumnParallelLinear(hidden, 4 * hidden, gather_output=False,
                                       dtype=dtype, group=group, seed=seed)
        self.act = GELU()
        self.down = RowParallelLinear(4 * hidden, hidden, input_is_parallel=True,
                                      dtype=dtype, group=group, seed=seed + 1)

    def forward(self, x: Any) -> Any:
        h = self.act.forward(self.up.forward(self.norm.forward(x)))
        return x + self.down.forward(h)

    def backward(self, dy: Any) -> Any:
        dh = self.up.backward(self.act.backward(self.down.backward(dy)))
        return dy + self.norm.backward(dh)


def chain(args: argparse.Namespace, group: Any) -> list[Callable[[], Module]]:
    """The model as functions that build each layer (over the tensor group ``group``):
    a stage calls only its own, so each rank holds only its stage's parameters."""
    dtype, hidden, vocab = np.dtype(args.dtype), args.hidden, args.vocab
    seed = args.seed

    def embedding() -> Module:
        return VocabParallelEmbedding(vocab, hidden, dtype=dtype, group=group,
                                      seed=seed)

    def head() -> Module:  # its logits stay split over the vocabulary
        return ColumnParallelLinear(hidden, vocab, bias=False, gather_output=False,
                                    dtype=dtype, group=group, seed=seed + 1)

    blocks = [lambda i=i: Block(hidden, dtype, group, seed + 10 * (i + 1))
              for i in range(args.layers)]
    return [embedding, *blocks, lambda: LayerNorm(hidden, dtype=dtype), head]


# ---------------------------------------------------------------- training


def train(args: argparse.Namespace, comm: MPI.Intracomm = MPI.COMM_WORLD) -> dict:
    """Train on ``comm`` as the flags say. Returns the losses, the layout and each
    stage's layers and peak micro-batches in flight, the same on every rank."""
    check_layout(args, comm.Get_size())
    state = manager.initialize_parallel(args.tp, comm=comm,
                                        pipeline_parallel_size=args.pp)
    try:
        pp, tp, dp = state.pipeline, state.tensor, state.data
        stage = split_stages(chain(args, tp), pp)
        last = pp.rank == pp.size - 1
        loss = None
        if last:
            loss = VocabParallelCrossEntropy(args.vocab, dtype=args.dtype, group=tp)
        run = SCHEDULES[args.schedule](stage, pp, args.micro_batches, loss)
        optimizer = AdamW(stage, lr=args.lr)
        moves = markov_chain(args.vocab, args.seed)
        rows = block_slice(args.batch, dp.size, dp.rank)  # this replica's sequences
        share = (rows.stop - rows.start) / args.batch
        losses = []
        for step in range(args.steps):
            inputs, targets = batch(moves, step, args.batch, args.length, args.seed)
            stage.zero_grad()
            # The schedule's loss is this replica's mean: with its gradient scaled by
            # the replica's share of the batch, the gradients summed over the replicas
            # are those of the whole batch's mean.
            mine = run.run(inputs[rows], targets[rows], loss_scale=share)
            allreduce_gradients(stage, dp, average=False)
            optimizer.step()
            if last:
                losses.append(float(dp.all_reduce(np.array([mine * share]))[0]))
        # The last stage's ranks hold the losses: the lowest of them tells every rank.
        owners = comm.allgather(comm.Get_rank() if last else comm.Get_size())
        losses = comm.bcast(losses, root=min(owners))
        stages = comm.allgather((pp.rank, run.peak_in_flight, tuple(stage.layer_range)))
        run.free()
    finally:
        manager.destroy_parallel()
    return {"losses": losses, "stages": sorted(set(stages)),
            "layout": {"pp": pp.size, "tp": tp.size, "dp": dp.size}}


def train_serial(args: argparse.Namespace) -> list[float]:
    """The same chain, unsplit, on this rank alone: the whole batch forward and
    backward at once, no schedule. Returns the loss of every step."""
    state = manager.initialize_parallel(comm=MPI.COMM_SELF)
    try:
        model = Sequential(*(make() for make in chain(args, state.tensor)))
        loss = VocabParallelCrossEntropy(args.vocab, dtype=args.dtype,
                                         group=state.tensor)
        optimizer = AdamW(model, lr=args.lr)
        moves = markov_chain(args.vocab, args.seed)
        losses = []
        for step in range(args.steps):
            inputs, targets = batch(moves, step, args.batch, args.length, args.seed)
            model.zero_grad()
            losses.append(loss.forward(model.forward(inputs), targets))
            model.backward(loss.backward(1.0))
            optimizer.step()
    finally:
        manager.destroy_parallel()
    return losses


def difference(parallel: list[float], serial: list[float]) -> float:
    """The largest relative difference of two loss curves (inf for other lengths)."""
    a, b = np.asarray(parallel), np.asarray(serial)
    if a.shape != b.shape:
        return float("inf")
    return float(np.max(np.abs(a - b) / np.abs(b))) if b.size else 0.0


def check_layout(args: argparse.Namespace, world: int) -> None:
    """Refuse flags that do not fit the world or the model: ValueError, on every
    rank."""
    if min(args.pp, args.tp) < 1 or world % (args.pp * args.tp):
        raise ValueError(f"--pp {args.pp} x --tp {args.tp} does not divide {world} "
                         f"ranks" + launcher_hint(COMMAND))
    dp = world // (args.pp * args.tp)
    if args.layers + 3 < args.pp:
        raise ValueError(f"--pp {args.pp} stages need at least {args.pp} layers; the "
                         f"model has {args.layers + 3} (--layers {args.layers} + 3)")
    if min(args.micro_batches, args.steps, args.vocab, args.hidden, args.length) < 1:
        raise ValueError("--micro-batches, --steps, --vocab, --hidden and --length "
                         "must be at least 1")
    if args.batch < dp * args.micro_batches:
        raise ValueError(f"--batch {args.batch} cannot give each of the {dp} "
                         f"data-parallel replicas {args.micro_batches} micro-batches")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The example's flags."""
    p = RankZeroParser(prog="pipeline.py", command=COMMAND,
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2, help="pipeline stages")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size of a stage")
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    p.add_argument("--micro-batches", type=int, default=4, help="per step and replica")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=24, help="sequences per step in all")
    p.add_argument("--length", type=int, default=16, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=37, help="vocabulary size (any)")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=3, help="residual blocks")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest relative difference from one rank (default: 1e-9 in "
                   "float64, 1e-4 in float32)")
    p.add_argument("--quiet", action="store_true", help="print only the verdict")
    args = p.parse_args(argv)
    if args.tolerance is None:
        args.tolerance = 1e-9 if args.dtype == "float64" else 1e-4
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the example; returns 0, 1 (off from the run on one rank) or 2 (bad flags)."""
    comm = MPI.COMM_WORLD
    args = parse_args(argv)
    try:
        result = train(args, comm)
    except ValueError as err:  # said on every rank alike
        return report_error("pipeline.py", str(err))
    serial = train_serial(args)
    gap = difference(result["losses"], serial)
    ok = comm.allreduce(gap <= args.tolerance, op=MPI.LAND)
    if comm.Get_rank() == 0:
        layout, losses = result["layout"], result["losses"]
        print(f"pipeline.py: pp={layout['pp']} x tp={layout['tp']} x "
              f"dp={layout['dp']}, {args.schedule}, {args.micro_batches} "
              f"micro-batches, {args.steps} steps")
        for s, peak, layers in ([] if args.quiet else result["stages"]):
            print(f"  stage {s}: layers {layers[0]}-{layers[-1]}, micro-batches in "
                  f"flight at most {peak}")
        shown = sorted({0, args.steps // 2, args.steps - 1})
        for step in ([] if args.quiet else shown):
            print(f"  step {step:3d}: loss {losses[step]:.6f}, "
                  f"on one rank {serial[step]:.6f}")
        print(f"largest relative difference from one rank: {gap:.2e} (tolerance "
              f"{args.tolerance:g}): {'same' if ok else 'DIFFERENT'}")
    return 0 if ok else 1


if __name__ == "__main__":
    finalize_and_exit(main())
