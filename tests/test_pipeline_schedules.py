"""GPipe and 1F1B against the serial model: loss, every gradient and ten AdamW steps equal
(float64, 1e-10) on 2 and 4 stages, with TP and DP composed, for 1, p and p + 1
micro-batches; the micro-batches each stage keeps alive, counted; ZeRO, the loss scaler and
Recompute per stage; debug mode's skipped backward."""

from __future__ import annotations

import weakref

import numpy as np
import pytest

from mpi_helpers import agree, raises_everywhere
from layer_helpers import self_group
from pipeline_helpers import (LAYOUTS, OUT, ROWS, P, Layout, batch, check_training, layers,
                              stage_loss, worst)
from pympar import debug
from pympar.amp import GradScaler
from pympar.errors import CollectiveMismatchError, PeerEndedError
from pympar.modules import Linear, Module, Recompute, Sequential, VocabParallelCrossEntropy
from pympar.optim import AdamW
from pympar.pipeline import GPipe, OneFOneB, PipelineGroup, split_stages, stage_bounds
from pympar.zero import ZeroRedundancyOptimizer

SCHEDULES = [pytest.param(GPipe, id="gpipe"), pytest.param(OneFOneB, id="1f1b")]
needs = pytest.mark.skipif(not LAYOUTS, reason=f"no pipeline layout of {P} ranks")


@pytest.fixture(scope="module")
def layouts():
    """Every layout that fits the world, made once (collective) and freed at the end."""
    made = {name: Layout(name) for name in LAYOUTS}
    yield made
    for layout in made.values():
        layout.free()


def counts(layout: Layout) -> list[int]:
    """1, p, and p + 1 micro-batches (no multiple of p)."""
    p = layout.pp.size
    return sorted({1, p, p + 1})


@needs
@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_training_equals_the_serial_model(layouts, name, schedule):
    layout = layouts[name]
    for m in counts(layout):
        stage = split_stages(layers(layout.tp, layout.tensor_parallel), layout.pp)
        run = schedule(stage, layout.pp, m, stage_loss(layout.pp))
        check_training(layout, stage, run, AdamW(stage, lr=1e-2))
        run.free()


@needs
@pytest.mark.parametrize("name", [n for n in LAYOUTS if "dp" in n])
def test_zero_per_stage_equals_the_serial_model(layouts, name):
    layout = layouts[name]
    stage = split_stages(layers(layout.tp, layout.tensor_parallel), layout.pp)
    run = OneFOneB(stage, layout.pp, layout.pp.size + 1, stage_loss(layout.pp))
    zero = ZeroRedundancyOptimizer(stage, AdamW, group=layout.dp, lr=1e-2)
    check_training(layout, stage, run, zero, reduce=False, grads=False)


@needs
def test_recompute_and_the_loss_scaler_per_stage(layouts):
    """Every layer wrapped in Recompute, the loss gradient scaled by a GradScaler over the
    world (every stage agrees on overflow): the same training."""
    layout = layouts[LAYOUTS[0]]
    chain = [Recompute(layer) for layer in layers(layout.tp, layout.tensor_parallel)]
    stage = split_stages(chain, layout.pp)
    run = GPipe(stage, layout.pp, 3, stage_loss(layout.pp))
    scaler = GradScaler(init_scale=2.0**10)

    class Scaled:
        """An optimizer stepped through the scaler (its step unscales first)."""

        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self):
            assert scaler.step(self.optimizer)
            scaler.update()

    class ScaledRun:
        def run(self, x, t):
            return run.run(x, t, loss_scale=scaler.get_scale())

    check_training(layout, stage, ScaledRun(), Scaled(AdamW(stage, lr=1e-2)), grads=False,
                   steps=3)


class Probe(Module):
    """An identity layer whose cache holds a token; ``alive`` counts tokens not yet freed."""

    alive = 0
    peak = 0

    def forward(self, x):
        token = Token()
        Probe.alive += 1
        Probe.peak = max(Probe.peak, Probe.alive)
        weakref.finalize(token, Probe._gone)
        self.save_for_backward(token)
        return x

    @staticmethod
    def _gone():
        Probe.alive -= 1

    def backward(self, dy):
        self.saved_tensors()
        return dy


class Token:
    pass


@needs
@pytest.mark.parametrize("schedule,bound", [pytest.param(GPipe, "m", id="gpipe"),
                                            pytest.param(OneFOneB, "p-s", id="1f1b")])
def test_micro_batches_alive_per_stage(layouts, schedule, bound):
    """The caches alive at once, counted by tokens they hold: 1F1B keeps at most p - s on
    stage s (p on the first), GPipe all m."""
    layout = layouts[LAYOUTS[0]]
    pp = PipelineGroup(layout.pp)
    m = 2 * pp.size + 1
    chain = [layer for pair in zip(layers(layout.tp, layout.tensor_parallel),
                                   [Probe() for _ in range(7)]) for layer in pair]
    stage = split_stages(chain, layout.pp)
    probes = sum(isinstance(layer, Probe) for layer in stage)  # each micro-batch: a token each
    run = schedule(stage, layout.pp, m, stage_loss(layout.pp))
    x = np.ones((2 * m, 5))
    Probe.alive = Probe.peak = 0
    run.run(x, np.ones((2 * m, 3)))
    expected = m if bound == "m" else pp.size - pp.rank
    peak = Probe.peak / probes
    agree(peak == expected == run.peak_in_flight and Probe.alive == 0,
          f"stage {pp.rank}: {peak} micro-batches alive at most ({run.peak_in_flight} "
          f"counted by the schedule, {Probe.alive} tokens left), expected {expected}")


@needs
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_loss_that_ignores_targets_weighs_micro_batches_by_what_it_counts(layouts,
                                                                            schedule):
    """Cross-entropy with ignored targets spread unevenly over the micro-batches (3 of the
    first one's 4 ignored, 1 of the second's, none of the third's): the loss and gradients
    of the whole batch's mean over the targets counted."""
    layout = layouts[LAYOUTS[0]]
    x, _ = batch(0, 1)
    t = np.arange(ROWS) % OUT
    t[[0, 1, 2, 7]] = -1

    def cross_entropy():
        return VocabParallelCrossEntropy(OUT, ignore_index=-1, dtype=np.float64,
                                         group=self_group())

    serial, loss_fn = Sequential(*layers(self_group(), False)), cross_entropy()
    expected = loss_fn.forward(serial.forward(x), t)
    serial.backward(loss_fn.backward(1.0))
    stage = split_stages(layers(self_group(), False), layout.pp)
    run = schedule(stage, layout.pp, 3, cross_entropy() if layout.pp.rank == layout.pp.size - 1
                   else None)
    loss = run.run(x, t)
    run.free()
    problems = worst(stage, {n: p.grad for n, p in serial.named_parameters()}, "grad")
    if loss is not None and not np.isclose(loss, expected, rtol=1e-12, atol=0):
        problems.append(f"loss {loss!r} != {expected!r}")
    agree(not problems, "; ".join(problems))


@needs
def test_steps_of_each_schedule(layouts):
    """The orders themselves: every micro-batch forward then backward, 1F1B's warm-up."""
    layout = layouts[LAYOUTS[0]]
    stage = split_stages(layers(layout.tp, layout.tensor_parallel), layout.pp)
    p, s, m = layout.pp.size, layout.pp.rank, 5
    ahead = min(p - s - 1, m)
    runs = [schedule(stage, layout.pp, m, stage_loss(layout.pp)) for schedule in (OneFOneB, GPipe)]
    one, all_f = (run.steps() for run in runs)
    for run in runs:
        run.free()
    agree(one[:ahead + 1] == [("forward", k) for k in range(ahead + 1)]
          and one[ahead + 1] == ("backward", 0) and sorted(one) == sorted(all_f)
          and all_f[:m] == [("forward", k) for k in range(m)],
          f"1F1B on stage {s} of {p}: {one}")


def test_stage_bounds():
    assert stage_bounds(7, 2) == [range(0, 4), range(4, 7)]
    assert stage_bounds(7, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    assert stage_bounds(5, 2, balance=[1, 4]) == [range(0, 1), range(1, 5)]
    for bad in ([1, 3], [0, 5], [5]):
        with pytest.raises(ValueError, match="balance"):
            stage_bounds(5, 2, balance=bad)
    with pytest.raises(ValueError, match="cannot fill"):
        stage_bounds(2, 3)


@needs
def test_factories_build_only_their_stage(layouts):
    """Layers given as functions are built on their stage only; names are the serial ones."""
    layout = layouts[LAYOUTS[0]]
    built = []

    def factory(i):
        def make():
            built.append(i)
            return Linear(4, 4, dtype=np.float64, seed=i)
        return make

    stage = split_stages([factory(i) for i in range(6)], layout.pp, balance=None)
    mine = list(stage.layer_range)
    names = [n for n, _ in stage.named_parameters()]
    agree(built == mine and names == [f"{i}.{w}" for i in mine for w in ("weight", "bias")],
          f"built {built}, names {names}, stage holds {mine}")


@needs
def test_stages_that_cut_differently_raise_everywhere(layouts):
    layout = layouts[LAYOUTS[0]]
    chain = layers(layout.tp, layout.tensor_parallel)
    if layout.pp.size == 1:
        pytest.skip("one stage: nothing to cut differently")
    cut = None if layout.pp.rank else [7 - layout.pp.size + 1] + [1] * (layout.pp.size - 1)
    raises_everywhere(CollectiveMismatchError, "split_stages", split_stages, chain, layout.pp,
                      balance=cut, comm=layout.pp.comm)


@needs
def test_schedules_that_differ_raise_everywhere(layouts):
    layout = layouts[LAYOUTS[0]]
    if layout.pp.size == 1:
        pytest.skip("one stage: nothing to differ from")
    stage = split_stages(layers(layout.tp, layout.tensor_parallel), layout.pp)
    last = layout.pp.rank == layout.pp.size - 1
    kind, m = (OneFOneB, 3) if last else (GPipe, 3)
    raises_everywhere(CollectiveMismatchError, "GPipe", kind, stage, layout.pp, m,
                      stage_loss(layout.pp), comm=layout.pp.comm)
    raises_everywhere(CollectiveMismatchError, "micro_batches=4", GPipe, stage, layout.pp,
                      4 if last else 3, stage_loss(layout.pp), comm=layout.pp.comm)
    raises_everywhere(CollectiveMismatchError, "last stage needs a loss", GPipe, stage,
                      layout.pp, 3, None, comm=layout.pp.comm)


@needs
def test_a_stage_that_raises_mid_run_ends_every_stage(layouts):
    """Stage 0's layer raises in micro-batch 1: it raises its own error, the others
    PeerEndedError naming it (told along the chain), and the schedule stays failed."""
    layout = layouts[LAYOUTS[0]]
    if layout.pp.size == 1:
        pytest.skip("one stage")

    class Failing(Module):
        calls = 0

        def forward(self, x):
            Failing.calls += 1
            if Failing.calls == 2:
                raise ValueError("micro-batch 1 refused")
            return x

        def backward(self, dy):
            return dy

    chain = [Failing()] + layers(layout.tp, layout.tensor_parallel)
    stage = split_stages(chain, layout.pp, balance=[len(chain) - layout.pp.size + 1]
                         + [1] * (layout.pp.size - 1))
    with debug.debug_mode(debug.is_enabled(), timeout=30):
        run = OneFOneB(stage, layout.pp, 3, stage_loss(layout.pp))
        x = np.ones((6, 5))
        first = layout.pp.rank == 0
        caught = raises_everywhere(ValueError if first else PeerEndedError,
                                   "micro-batch 1 refused", run.run, x, np.ones((6, 3)),
                                   comm=layout.pp.comm)
        again = raises_everywhere(type(caught), "micro-batch 1 refused", run.run, x,
                                  np.ones((6, 3)), comm=layout.pp.comm)
        agree(again is caught, "the failed schedule raises its error again")


@needs
def test_a_skipped_backward_in_debug_mode(layouts):
    """A layer whose backward the stage skips: debug mode raises after that micro-batch."""
    layout = layouts[LAYOUTS[0]]

    class Skipping(Module):
        """Two layers, the second's backward skipped."""

        def __init__(self):
            super().__init__()
            self.a, self.b = Linear(5, 5, dtype=np.float64), Linear(5, 5, dtype=np.float64,
                                                                       seed=1)

        def forward(self, x):
            return self.b.forward(self.a.forward(x))

        def backward(self, dy):
            return self.a.backward(dy)  # b's cache is never used: its gradient is missing

    stage = split_stages([Skipping() for _ in range(layout.pp.size)], layout.pp)
    with debug.debug_mode(True, timeout=30):
        run = GPipe(stage, layout.pp, 2, stage_loss(layout.pp))
        x = np.ones((4, 5))
        raises_everywhere(RuntimeError, "never ran|ended", run.run, x, np.ones((4, 5)),
                          comm=layout.pp.comm)
