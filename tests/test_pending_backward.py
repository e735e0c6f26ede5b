"""Debug mode catches a forward whose backward never ran on some rank.

Without it a rank that skips a layer's backward (the first layer's, say, because it has
``input_grad=False`` and the training loop stops at the first ``None``) reduces a gradient
that lacks its contribution, and training goes on silently wrong. In debug mode the next
forward of that layer, or the gradient all-reduce, raises, naming the layer and the rank.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpi_helpers import WORLD, agree, assert_close, raises_everywhere
from pympar import Mesh, debug, manager
from pympar.debug import CollectiveMismatchError, debug_mode
from pympar.modules import GELU, ColumnParallelLinear, Linear, Sequential
from pympar.optim import allreduce_gradients

P = WORLD.size
SKIPS = P - 1  # the rank that skips a backward


@pytest.fixture(scope="module")
def world_group():
    group = Mesh(WORLD, {"dp": P}).group("dp")
    yield group
    group.free()


def _model() -> Sequential:
    return Sequential(Linear(4, 8, dtype=np.float64, seed=1), GELU(),
                      Linear(8, 2, dtype=np.float64, seed=2), input_grad=False)


def _step(model: Sequential, skip_first: bool) -> None:
    x = np.random.default_rng(3 + WORLD.rank).standard_normal((5, 4))
    dy = np.ones((5, 2))
    model.forward(x)
    layers = list(model)[1:] if skip_first else list(model)
    for layer in reversed(layers):
        dy = layer.backward(dy)


@pytest.mark.mpi(min_size=1)
def test_a_backward_skipped_on_one_rank_is_named_at_the_gradient_all_reduce(world_group):
    model = _model()
    with debug_mode(True, timeout=8.0):
        _step(model, WORLD.rank == SKIPS)
        error = CollectiveMismatchError if P > 1 else RuntimeError
        err = raises_everywhere(error, rf"allreduce_gradients on global rank {SKIPS} of {P}: "
                                r"the backward of Linear\(in_features=4.*weight, bias.*never ran",
                                allreduce_gradients, model, world_group)
        agree("\n" not in str(err), str(err))
        if WORLD.rank == SKIPS:
            model[0].saved_tensors()  # release the pending cache
        # Every backward ran: the reduction goes through, the same as outside debug mode.
        model.zero_grad()
        _step(model, False)
        allreduce_gradients(model, world_group)
    reference = _model()
    reference.zero_grad()
    _step(reference, False)
    allreduce_gradients(reference, world_group)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, what=p.name)


@pytest.mark.mpi(min_size=1)
def test_a_forward_over_a_pending_cache_names_the_layer_and_the_rank():
    model = _model()
    with debug_mode(True):
        _step(model, True)  # every rank skips the first layer's backward
        with pytest.raises(RuntimeError, match=rf"Linear\(in_features=4.* on global rank "
                           rf"{WORLD.rank} of {P}: a forward while the previous forward's "
                           r"cache is still pending"):
            model.forward(np.zeros((5, 4)))
        # Forward-only passes are fine, in training mode (no backward ran since) or not.
        model[0].saved_tensors()
        model.forward(np.zeros((5, 4)))
        model.forward(np.zeros((5, 4)))
        model.eval()
        model.forward(np.zeros((5, 4)))
    # Outside debug mode nothing is checked (and nothing costs).
    model.train()
    _step(model, True)
    model.forward(np.zeros((5, 4)))


@pytest.mark.mpi(min_size=1)
def test_a_parallel_layer_over_a_pending_cache_raises_on_every_rank(clean_state):
    manager.initialize_parallel(P)
    layer = ColumnParallelLinear(4, 2 * P, dtype=np.float64, input_grad=False)
    tail = GELU()
    x = np.random.default_rng(4).standard_normal((3, 4))

    def step(skip: bool) -> None:
        tail.forward(layer.forward(x))
        dy = tail.backward(np.ones((3, 2 * P)))
        if not skip:
            layer.backward(dy)

    with debug_mode(True, timeout=8.0):
        # Every rank skipped the layer's backward: each refuses before the forward's
        # collectives.
        step(True)
        raises_everywhere(RuntimeError, rf"ColumnParallelLinear.* on global rank "
                          rf"{WORLD.rank} of {P}: a forward while the previous forward's "
                          r"cache is still pending", layer.forward, x)
        layer.saved_tensors()
        # One rank skips it while the others run it: their backward's agreement meets that
        # rank's refused next forward, and every rank names it.
        step(True)
        error = CollectiveMismatchError if P > 1 else RuntimeError
        call = layer.forward if WORLD.rank == SKIPS else layer.backward
        raises_everywhere(error, rf"ColumnParallelLinear.* on global rank {SKIPS} of {P}: a "
                          r"forward while the previous forward's cache is still pending",
                          call, x if WORLD.rank == SKIPS else np.ones((3, 2 * P)))
        if WORLD.rank == SKIPS:
            layer.saved_tensors()
        step(False)  # the group is still usable
    assert not debug.is_enabled()


@pytest.mark.mpi(min_size=1)
def test_a_backward_skipped_on_one_rank_is_named_at_the_zero_step(world_group):
    from pympar.zero import ZeroRedundancyOptimizer
    model = _model()
    opt = ZeroRedundancyOptimizer(model, group=world_group, lr=1e-2)
    with debug_mode(True, timeout=8.0):
        _step(model, WORLD.rank == SKIPS)
        error = CollectiveMismatchError if P > 1 else RuntimeError
        raises_everywhere(error, rf"ZeroRedundancyOptimizer.step on global rank {SKIPS} of "
                          rf"{P}: the backward of Linear\(in_features=4.*never ran", opt.step)
