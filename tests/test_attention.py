"""Sequence-parallel (Ulysses) and tensor-parallel attention against serial references."""

import time

import numpy as np
import pytest

from layer_helpers import XPS, block, get_xp, numeric_grad, rng_array, self_group
from mpi_helpers import WORLD, agree, assert_close, raises_everywhere
from pympar import debug, manager, stats
from pympar.debug import CollectiveMismatchError
from pympar.modules import DistributedAttention, ParallelAttention
from test_ring_attention import reference

#: TP=2 or CP=2 over the world: an odd world is refused (see test_manager).
even_world = pytest.mark.skipif(WORLD.size % 2 != 0, reason="needs an even number of ranks")

S, B = 7, 2


@pytest.fixture
def clean():
    manager.destroy_parallel()
    yield
    manager.destroy_parallel()


def numpy_attention(x, wqkv, bqkv, wo, bo, heads):
    """Independent reference: plain per-head loops of softmax(q k^T / sqrt(d)) v."""
    hidden = x.shape[-1]
    dh = hidden // heads
    qkv = x @ wqkv.T + bqkv
    q, k, v = (qkv[..., i * hidden:(i + 1) * hidden] for i in range(3))
    out = np.empty_like(q)
    for b in range(x.shape[1]):
        for h in range(heads):
            sl = slice(h * dh, (h + 1) * dh)
            scores = q[:, b, sl] @ k[:, b, sl].T / np.sqrt(dh)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out[:, b, sl] = p @ v[:, b, sl]
    return out @ wo.T + bo


@pytest.mark.mpi(min_size=1)
def test_serial_attention_matches_numpy_and_finite_differences():
    hidden, heads = 8, 2
    layer = DistributedAttention(hidden, heads, group=self_group(), dtype=np.float64, seed=7)
    x = rng_array(1, (5, B, hidden), np.float64)
    y = layer.forward(x)
    ref = numpy_attention(x, layer.qkv.weight.data, layer.qkv.bias.data,
                          layer.proj.weight.data, layer.proj.bias.data, heads)
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
    w = rng_array(2, y.shape, np.float64)
    dx = layer.backward(w)
    loss = lambda: float((layer.forward(x) * w).sum())  # noqa: E731
    np.testing.assert_allclose(dx, numeric_grad(loss, x), rtol=1e-6, atol=1e-7)
    for p in (layer.qkv.weight, layer.proj.bias):
        np.testing.assert_allclose(p.grad, numeric_grad(loss, p.data), rtol=1e-6, atol=1e-7)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("cp,heads", [(2, 3), (4, 6)], ids=["cp2-heads3", "cp4-heads6"])
@pytest.mark.parametrize("xp_name", XPS)
def test_distributed_attention(clean, cp, heads, xp_name):
    if WORLD.size % cp:
        pytest.skip(f"needs a multiple of {cp} ranks")
    xp = get_xp(xp_name)
    hidden, dtype = 12, np.float64
    ref = DistributedAttention(hidden, heads, group=self_group(), dtype=dtype, seed=9, xp=xp)
    x = rng_array(3, (S, B, hidden), dtype, xp)
    dy = rng_array(4, (S, B, hidden), dtype, xp)
    y_ref = ref.forward(x)
    dx_ref = ref.backward(dy)
    manager.initialize_parallel(context_parallel_size=cp)
    rows = block(S, cp, manager.get_context_parallel_rank())
    layer = DistributedAttention(hidden, heads, dtype=dtype, seed=9, xp=xp)
    y = layer.forward(x[rows])
    assert_close(y, y_ref[rows], what="forward")
    assert_close(layer.backward(dy[rows]), dx_ref[rows], what="dx")
    group = manager.get_context_parallel_group()
    for (name, p), (_, q) in zip(layer.named_parameters(), ref.named_parameters()):
        # replicated weights: each rank holds the gradient of its own sequence block
        assert_close(group.all_reduce(p.grad), q.grad, what=f"sum over cp of {name}")


@even_world
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("xp_name", XPS)
def test_tensor_parallel_attention(clean, sp, xp_name):
    xp = get_xp(xp_name)
    tp, hidden, heads, dtype = 2, 8, 4, np.float64
    ref = DistributedAttention(hidden, heads, group=self_group(), dtype=dtype, seed=5, xp=xp)
    x = rng_array(5, (S, B, hidden), dtype, xp)
    dy = rng_array(6, (S, B, hidden), dtype, xp)
    y_ref = ref.forward(x)
    dx_ref = ref.backward(dy)
    manager.initialize_parallel(tp)
    r = manager.get_tensor_parallel_rank()
    rows = block(S, tp, r) if sp else slice(None)
    layer = ParallelAttention(hidden, heads, use_sequence_parallel=sp, dtype=dtype, seed=5, xp=xp)
    y = layer.forward(x[rows])
    assert_close(y, y_ref[rows], what="forward")
    assert_close(layer.backward(dy[rows]), dx_ref[rows], what="dx")
    local = np.concatenate([np.arange(hidden)[block(hidden, tp, r)] + i * hidden for i in range(3)])
    assert_close(layer.qkv.weight.grad, ref.qkv.weight.grad[local], what="dWqkv")
    assert_close(layer.qkv.bias.grad, ref.qkv.bias.grad[local], what="dbqkv")
    assert_close(layer.proj.weight.grad, ref.proj.weight.grad[:, block(hidden, tp, r)], what="dWo")
    assert_close(layer.proj.bias.grad, ref.proj.bias.grad, what="dbo")


@even_world
@pytest.mark.mpi(min_size=2)
def test_attention_bad_input(clean):
    raises_everywhere(RuntimeError, "DistributedAttention needs a context-parallel group",
                      DistributedAttention, 8, 2)
    manager.initialize_parallel(2)
    raises_everywhere(ValueError, "num_heads 3 is not divisible by the tensor-parallel size 2",
                      ParallelAttention, 12, 3)
    raises_everywhere(ValueError, "hidden size 10 is not divisible by num_heads 3",
                      DistributedAttention, 10, 3)


def serial_reference(hidden, heads, seed, causal, lens, x, dy):
    """Full weights (from a serial layer with the same seed) and the masked NumPy reference."""
    full = DistributedAttention(hidden, heads, group=self_group(), dtype=np.float64, seed=seed)
    ws = [full.qkv.weight.data, full.qkv.bias.data, full.proj.weight.data, full.proj.bias.data]
    return reference(x, *ws, heads, causal, lens, dy)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("causal,padded", [(True, False), (False, True), (True, True)],
                         ids=["causal", "padding", "both"])
def test_distributed_attention_masks(clean, cp, causal, padded):
    if WORLD.size % cp:
        pytest.skip(f"needs a multiple of {cp} ranks")
    hidden, heads, seq = 10, 5, 9
    x, dy = rng_array(3, (seq, B, hidden), np.float64), rng_array(4, (seq, B, hidden), np.float64)
    lens = np.array([seq - 3, 2]) if padded else None
    y_ref, dx_ref, *grads_ref = serial_reference(hidden, heads, 9, causal, lens, x, dy)
    manager.initialize_parallel(context_parallel_size=cp)
    rows = block(seq, cp, manager.get_context_parallel_rank())
    layer = DistributedAttention(hidden, heads, dtype=np.float64, seed=9, causal=causal)
    assert_close(layer.forward(x[rows], key_lengths=lens), y_ref[rows], what="forward")
    assert_close(layer.backward(dy[rows]), dx_ref[rows], what="dx")
    group = manager.get_context_parallel_group()
    for p, g in zip(layer.parameters(), grads_ref):
        assert_close(group.all_reduce(p.grad), g, what=p.name)


@even_world
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("causal,padded", [(True, False), (True, True)], ids=["causal", "both"])
def test_tensor_parallel_attention_masks(clean, sp, causal, padded):
    tp, hidden, heads, dtype = 2, 8, 4, np.float64
    x, dy = rng_array(5, (S, B, hidden), dtype), rng_array(6, (S, B, hidden), dtype)
    lens = np.array([S, 3]) if padded else None
    y_ref, dx_ref, dwqkv, dbqkv, dwo, dbo = serial_reference(hidden, heads, 5, causal, lens, x, dy)
    manager.initialize_parallel(tp)
    r = manager.get_tensor_parallel_rank()
    rows = block(S, tp, r) if sp else slice(None)
    layer = ParallelAttention(hidden, heads, use_sequence_parallel=sp, dtype=dtype, seed=5,
                              causal=causal)
    assert_close(layer.forward(x[rows], key_lengths=lens), y_ref[rows], what="forward")
    assert_close(layer.backward(dy[rows]), dx_ref[rows], what="dx")
    local = np.concatenate([np.arange(hidden)[block(hidden, tp, r)] + i * hidden for i in range(3)])
    assert_close(layer.qkv.weight.grad, dwqkv[local], what="dWqkv")
    assert_close(layer.qkv.bias.grad, dbqkv[local], what="dbqkv")
    assert_close(layer.proj.weight.grad, dwo[:, block(hidden, tp, r)], what="dWo")
    assert_close(layer.proj.bias.grad, dbo, what="dbo")


@even_world
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["ulysses", "tp"])
def test_attention_without_input_gradient(clean, kind):
    """input_grad=False: backward returns None, parameter gradients are bitwise the full
    backward's; with QKV frozen too, nothing below the output projection runs (no collective)."""
    hidden, heads, dtype = 8, 4, np.float64
    manager.initialize_parallel(*((2, 1) if kind == "tp" else (1, 2)))
    rows = block(S, 2, manager.get_context_parallel_rank() if kind == "ulysses" else 0)
    make = {"ulysses": lambda **kw: DistributedAttention(hidden, heads, dtype=dtype, seed=2, **kw),
            "tp": lambda **kw: ParallelAttention(hidden, heads, dtype=dtype, seed=2, **kw)}[kind]
    x = rng_array(7, (S, B, hidden), dtype)[rows if kind == "ulysses" else slice(None)]
    dy = rng_array(8, x.shape, dtype)
    grads, results = [], []
    for flag in (True, False):
        layer = make(input_grad=flag, causal=True)
        layer.forward(x)
        results.append(layer.backward(dy))
        grads.append([p.grad for p in layer.parameters()])
    ok = results[0] is not None and results[1] is None and layer.qkv.input_grad is False
    # switched off after construction (as Sequential does): the QKV layer hears of it too
    late = make(causal=True)
    late.input_grad = False
    late.forward(x)
    ok &= late.backward(dy) is None and late.qkv.input_grad is False
    ok &= all(np.array_equal(p.grad, g) for p, g in zip(late.parameters(), grads[0]))
    ok &= all(np.array_equal(a, b) for a, b in zip(*grads))
    for p in layer.qkv.parameters():
        p.requires_grad, p.grad = False, None
    layer.forward(x)
    with stats.record() as rec:
        ok &= layer.backward(dy) is None
    ok &= all(p.grad is None for p in layer.qkv.parameters())
    ok &= not rec.rows  # no all-to-all (Ulysses), no all-reduce of the input gradient (TP)
    # The QKV layer's cache is released though its backward is skipped: debug mode's check
    # of a forward over a pending cache lets the next step run.
    with debug.debug_mode(True):
        for _ in range(2):
            layer.forward(x)
            ok &= layer.backward(dy) is None
    agree(ok, f"input_grad=False: results {[type(r) for r in results]}, ops {list(rec.rows)}")


@even_world
@pytest.mark.mpi(min_size=2)
def test_tensor_parallel_attention_ranks_that_differ_raise(clean):
    # Heads change no shape the projections' collectives see: only their labels tell.
    hidden, dtype = 8, np.float64
    x = rng_array(5, (S, B, hidden), dtype)
    manager.initialize_parallel(2)
    first = manager.get_tensor_parallel_rank() == 0
    for heads in (2, 4):  # the correct case
        ref = DistributedAttention(hidden, heads, group=self_group(), dtype=dtype, seed=5)
        layer = ParallelAttention(hidden, heads, dtype=dtype, seed=5)
        assert_close(layer.forward(x), ref.forward(x), what=f"heads={heads} forward")
    layer = ParallelAttention(hidden, 2 if first else 4, dtype=dtype, seed=5)
    start = time.monotonic()
    raises_everywhere(CollectiveMismatchError, r"ParallelAttention\(heads=(2|4)", layer.forward, x)
    layer = ParallelAttention(hidden, 2, dtype=dtype, seed=5, causal=first)
    raises_everywhere(CollectiveMismatchError, r"causal=(True|False)", layer.forward, x)
    agree(time.monotonic() - start < 10, "the mismatches took more than 10 s to raise")
