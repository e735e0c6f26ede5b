"""The pipeline axis of the parallel state: initialize_parallel(pipeline_parallel_size=) and
Megatron's pipeline getters, laid out as NumPy says, and a pipeline trained on its groups."""

from __future__ import annotations

import numpy as np
import pytest

from mpi_helpers import WORLD, agree, raises_everywhere
from pipeline_helpers import check_training, layers, stage_loss
from pympar import manager
from pympar.optim import AdamW
from pympar.pipeline import OneFOneB, split_stages

P = WORLD.Get_size()


def layouts() -> list[tuple[int, int, int]]:
    """(tp, cp, pp) with two or more stages that fit this world."""
    return [(tp, cp, pp) for tp in (1, 2) for cp in (1, 2) for pp in (2, 4)
            if P % (tp * cp * pp) == 0]


def expected_groups(tp: int, cp: int, pp: int, order: str) -> dict[str, list[int]]:
    """This rank's groups from NumPy alone: the world's ranks as an array whose axes are
    the order's, outermost first."""
    axes = order.split("-")
    sizes = {"tp": tp, "cp": cp, "dp": P // (tp * cp * pp), "pp": pp}
    grid = np.arange(P).reshape([sizes[a] for a in reversed(axes)])
    where = [int(c[0]) for c in np.nonzero(grid == WORLD.rank)]
    found = {}
    for axis in ("tp", "cp", "dp", "pp"):
        index = list(where)
        index[len(axes) - 1 - axes.index(axis)] = slice(None)
        found[axis] = grid[tuple(index)].tolist()
    return found


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("order", ["tp-cp-dp", "pp-tp-cp-dp", "tp-pp-cp-dp"])
def test_the_pipeline_axis_is_laid_out_as_numpy_says(clean_state, order):
    cases = layouts()
    if not cases:
        pytest.skip(f"no pipeline of two or more stages fits {P} ranks")
    for tp, cp, pp in cases:
        state = manager.initialize_parallel(tp, cp, order, pipeline_parallel_size=pp)
        full = order if "pp" in order else order + "-pp"  # outermost when not named
        want = expected_groups(tp, cp, pp, full)
        got = {"tp": state.tensor.ranks, "cp": state.context.ranks, "dp": state.data.ranks,
               "pp": state.pipeline.ranks}
        what = f"tp={tp} cp={cp} pp={pp} order={order}"
        agree(all(list(got[a]) == want[a] for a in want), f"{what}: {got} != {want}")
        stages = want["pp"]
        s = stages.index(WORLD.rank)
        facts = (manager.get_pipeline_model_parallel_world_size(),
                 manager.get_pipeline_model_parallel_rank(),
                 manager.is_pipeline_first_stage(), manager.is_pipeline_last_stage(),
                 manager.get_pipeline_model_parallel_prev_rank(),
                 manager.get_pipeline_model_parallel_next_rank(),
                 manager.get_data_parallel_world_size())
        expected = (pp, s, s == 0, s == pp - 1, stages[(s - 1) % pp], stages[(s + 1) % pp],
                    P // (tp * cp * pp))
        agree(facts == expected, f"{what}: getters {facts} != {expected}")
        agree(manager.get_pipeline_model_parallel_group() is state.pipeline and
              manager.get_pipeline_model_parallel_group_name() == state.pipeline.name and
              manager.resolve_group(None, "L", "pipeline") is state.pipeline, what)
        manager.destroy_parallel()
        agree(state.pipeline.freed, f"{what}: destroy_parallel frees the pipeline group")


@pytest.mark.mpi(min_size=1)
def test_one_stage_is_this_rank_alone(clean_state):
    manager.initialize_parallel(1)
    agree(manager.get_pipeline_model_parallel_world_size() == 1
          and manager.is_pipeline_first_stage() and manager.is_pipeline_last_stage()
          and manager.get_pipeline_model_parallel_next_rank() == WORLD.rank
          and manager.get_data_parallel_world_size() == P, "one stage")
    agree("pp" not in repr(manager.get_parallel_state().mesh), "no pp axis with one stage")


@pytest.mark.mpi(min_size=1)
def test_stages_that_do_not_fit_say_what_would(clean_state):
    raises_everywhere(ValueError, f"world size {P} is not divisible by tensor_parallel_size 1 "
                      f"x context_parallel_size 1 x pipeline_parallel_size {P + 1}",
                      manager.initialize_parallel, pipeline_parallel_size=P + 1)
    raises_everywhere(ValueError, "needs", manager.initialize_parallel,
                      pipeline_parallel_size=1, data_parallel_size=P + 1)
    raises_everywhere(ValueError, "pp", manager.initialize_parallel,
                      pipeline_parallel_size=0)


class StateLayout:
    """The groups of the current parallel state, as the pipeline helpers take them."""

    def __init__(self) -> None:
        self.pp = manager.get_pipeline_model_parallel_group()
        self.tp = manager.get_tensor_parallel_group()
        data = manager.get_data_parallel_group()
        self.dp = data if data.size > 1 else None
        self.name = f"pp{self.pp.size}-tp{self.tp.size}-dp{data.size}"

    @property
    def tensor_parallel(self) -> bool:
        return self.tp.size > 1


@pytest.mark.mpi(min_size=2)
def test_a_pipeline_on_the_states_groups_trains_like_the_serial_model(clean_state):
    tp = 2 if P % 4 == 0 else 1
    manager.initialize_parallel(tp, pipeline_parallel_size=2)
    layout = StateLayout()
    stage = split_stages(layers(layout.tp, layout.tensor_parallel), layout.pp)
    run = OneFOneB(stage, layout.pp, 3, stage_loss(layout.pp))
    check_training(layout, stage, run, AdamW(stage, lr=1e-2), steps=3)
    run.transfer.free()
