"""``python -m pympar info``: the layout table printed by rank 0, and bad flags."""

import pytest

from mpi_helpers import WORLD, agree
from pympar import __main__ as cli
from pympar import manager
from pympar.mesh import group_ranks


@pytest.mark.mpi(min_size=1)
def test_info_prints_every_rank_with_its_groups(capsys):
    tp = 2 if WORLD.size % 2 == 0 else 1
    status = cli.main(["info", "--tp", str(tp)])
    out = capsys.readouterr().out
    agree(status == 0 and not manager.is_initialized(), f"status {status}")
    if WORLD.rank == 0:
        sizes = {"tp": tp, "cp": 1, "dp": WORLD.size // tp}
        lines = {int(line.split()[0]): line for line in out.splitlines()
                 if line.split() and line.split()[0].isdigit()}
        ok = (f"world size        {WORLD.size}" in out and "MPI library" in out
              and "CUDA-aware MPI" in out and sorted(lines) == list(range(WORLD.size)))
        for rank, line in lines.items():
            tp_row = [r for r in group_ranks(sizes, "tp-cp-dp", "tp").tolist() if rank in r][0]
            ok = ok and ("tp-" + "-".join(map(str, tp_row))) in line.split()
        agree(ok, out)
    else:
        agree(out == "", f"rank {WORLD.rank} printed {out!r}")


@pytest.mark.mpi(min_size=1)
def test_info_bad_layout_exits_2_on_every_rank(capsys):
    status = cli.main(["info", "--tp", str(WORLD.size + 1)])
    err = capsys.readouterr().err
    agree(status == 2 and "is not divisible by tensor_parallel_size" in err, err)
