"""A 3D tensor-parallel MLP on 8 ranks (depth 2), checked against the serial model.

    mpiexec -n 8 python examples/linear3d.py

The cube of 8 ranks holds 1/8 of every weight and every activation. Two
``Linear3D`` layers alternate layouts (the second has ``swap=True``), so the
output of the first is the input of the second with no communication in
between. After training, the gathered weights are compared with a serial NumPy
model trained on the same data from the same initial weights.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from mpi4py import MPI

from pympar import manager
from pympar.launch import RankZeroParser, launcher_hint, report_error
from pympar.modules import GELU, Linear, Linear3D, MSELoss
from pympar.optim import SGD


def run(args: argparse.Namespace) -> dict:
    """Train the 3D and the serial MLP side by side; return losses and the largest difference."""
    comm = MPI.COMM_WORLD
    manager.initialize_parallel(args.tp, tensor_parallel_mode="3d")
    cube = manager.get_tensor_parallel_group()
    try:
        fc1 = Linear3D(args.features, args.hidden, dtype=np.float64, seed=1)
        act = GELU()
        fc2 = Linear3D(args.hidden, args.features, swap=True, dtype=np.float64, seed=2)
        # The serial twin: the same seeds give the same full weights.
        ref1, ref_act, ref2 = (Linear(args.features, args.hidden, dtype=np.float64, seed=1), GELU(),
                               Linear(args.hidden, args.features, dtype=np.float64, seed=2))
        params = [*fc1.parameters(), *fc2.parameters()]
        ref_params = [*ref1.parameters(), *ref2.parameters()]
        opt, ref_opt = SGD(params, lr=args.lr), SGD(ref_params, lr=args.lr)
        rng = np.random.default_rng(0)
        teacher = rng.standard_normal((args.features, args.features)) / np.sqrt(args.features)
        losses = []
        for step in range(args.steps):
            x = rng.standard_normal((args.batch, args.features))
            target = np.tanh(x @ teacher)
            # 3D: every rank takes its block of the batch and of the features
            x_local = fc1.layout.split_input(x)
            y_local = fc2.forward(act.forward(fc1.forward(x_local)))
            t_local = fc2.layout.split_output(target)
            diff = y_local - t_local
            # the 8 ranks hold disjoint blocks of the output: sum over the whole cube
            loss = cube.comm.allreduce(float((diff * diff).sum())) / target.size
            for p in params:
                p.zero_grad()
            fc1.backward(act.backward(fc2.backward(diff * (2.0 / target.size))))
            opt.step()
            # serial reference step
            ref_loss = MSELoss()
            ref_loss.forward(ref2.forward(ref_act.forward(ref1.forward(x))), target)
            for p in ref_params:
                p.zero_grad()
            ref1.backward(ref_act.backward(ref2.backward(ref_loss.backward())))
            ref_opt.step()
            losses.append(loss)
            if comm.rank == 0 and (step % max(args.steps // 5, 1) == 0 or step == args.steps - 1):
                print(f"step {step:4d}  3D loss {loss:.6f}")
        worst = max(float(np.abs(layer.full_weight()[0] - ref.weight.data).max())
                    for layer, ref in ((fc1, ref1), (fc2, ref2)))
        return {"losses": losses, "max_weight_difference": worst}
    finally:
        manager.destroy_parallel()


def main(argv=None) -> int:
    """Parse flags, train, report."""
    p = RankZeroParser(prog="linear3d.py", description="3D tensor-parallel MLP",
                       command="examples/linear3d.py")
    p.add_argument("--tp", type=int, default=8, help="cube size d**3 (8 for depth 2)")
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.1)
    comm = MPI.COMM_WORLD
    args = p.parse_args(argv)
    try:
        result = run(args)
    except ValueError as err:  # raised on every rank alike: said once, then all exit
        return report_error("linear3d.py", f"{err}{launcher_hint('examples/linear3d.py')}")
    if comm.rank == 0:
        print(f"final loss {result['losses'][-1]:.6f}; largest difference between the gathered 3D "
              f"weights and the serial model's: {result['max_weight_difference']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
