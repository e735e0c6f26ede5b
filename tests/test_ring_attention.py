"""Ring, Ulysses and hybrid context attention (ContextAttention) against a serial NumPy attention.

Every case runs on a context group of exactly ``cp`` ranks made from COMM_WORLD with
``Comm.Split`` (collectively; the other ranks idle), so CP=3 runs on 4 or 8 ranks.
"""

import time

import numpy as np
import pytest
from mpi4py import MPI

from layer_helpers import XPS, get_xp, numeric_grad, rng_array, tolerance
from mpi_helpers import WORLD, agree, raises_everywhere, to_numpy
from pympar import stats
from pympar.debug import CollectiveMismatchError
from pympar.group import Group
from pympar.modules import ContextAttention, blockwise, sequence_segments, split_context_group
from pympar.modules.ring_attention import ring_attention_backward, ring_attention_forward

B, HIDDEN = 2, 6


def reference(x, wqkv, bqkv, wo, bo, heads, causal, lens, dy):
    """Serial attention with masks and its hand-derived backward, per (batch, head) loops.

    Returns y, dx and the gradients of wqkv, bqkv, wo, bo.
    """
    s_len, batch, hidden = x.shape
    dh = hidden // heads
    keys = np.arange(s_len)
    qkv = x @ wqkv.T + bqkv
    q, k, v = (qkv[..., i * hidden:(i + 1) * hidden] for i in range(3))
    o = np.zeros_like(q)
    do = dy @ wo
    dqkv = np.zeros_like(qkv)
    for b in range(batch):
        allowed = np.ones((s_len, s_len), bool)
        if causal:
            allowed &= keys[None, :] <= keys[:, None]
        if lens is not None:
            allowed &= keys[None, :] < lens[b]
        for h in range(heads):
            cols = slice(h * dh, (h + 1) * dh)
            scores = q[:, b, cols] @ k[:, b, cols].T / np.sqrt(dh)
            scores[~allowed] = -np.inf
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            o[:, b, cols] = p @ v[:, b, cols]
            dp = do[:, b, cols] @ v[:, b, cols].T
            ds = p * (dp - (dp * p).sum(axis=1, keepdims=True)) / np.sqrt(dh)
            dqkv[:, b, cols] = ds @ k[:, b, cols]
            dqkv[:, b, hidden:][:, cols] = ds.T @ q[:, b, cols]
            dqkv[:, b, 2 * hidden:][:, cols] = p.T @ do[:, b, cols]
    y = o @ wo.T + bo
    x2, dqkv2, dy2, o2 = (a.reshape(-1, a.shape[-1]) for a in (x, dqkv, dy, o))
    return (y, dqkv @ wqkv, dqkv2.T @ x2, dqkv2.sum(0), dy2.T @ o2, dy2.sum(0))


def sub_group(size):
    """A group of the first ``size`` world ranks (collective); None on the others."""
    color = 0 if WORLD.rank < size else MPI.UNDEFINED
    comm = WORLD.Split(color, WORLD.rank)
    if comm == MPI.COMM_NULL:
        return None
    return Group(comm, "cp-" + "-".join(map(str, range(size))), list(range(size)))


def rows_of(seq_len, cp, rank, layout):
    return np.concatenate([np.arange(a, b) for a, b in sequence_segments(seq_len, cp, rank, layout)])


def run_case(cp, heads, seq_len, causal, padded, layout, scheme="ring", dtype=np.float64,
             ulysses_size=None, seed=3, xp=np):
    """Compare output, dx and every parameter gradient with the serial reference; agree on WORLD."""
    if WORLD.size < cp:
        pytest.skip(f"needs {cp} ranks")
    group = sub_group(cp)
    problems = []
    if group is not None:
        hidden = 2 * heads
        x = rng_array(seed, (seq_len, B, hidden), dtype)
        dy = rng_array(seed + 1, (seq_len, B, hidden), dtype)
        lens = np.array([seq_len - 2, 3][:B]) if padded else None
        layer = ContextAttention(hidden, heads, scheme, group=group, ulysses_size=ulysses_size,
                                 causal=causal, layout=layout, dtype=dtype, seed=seed, xp=xp)
        params = [layer.qkv.weight, layer.qkv.bias, layer.proj.weight, layer.proj.bias]
        weights = [to_numpy(p.data).astype(np.float64) for p in params]
        expected = reference(x.astype(np.float64), *weights, heads, causal, lens,
                             dy.astype(np.float64))
        rows = rows_of(seq_len, cp, group.rank, layout)
        y = layer.forward(xp.asarray(x[rows]), key_lengths=lens)
        dx = layer.backward(xp.asarray(dy[rows]))
        got = [to_numpy(a) for a in [y, dx] + [group.all_reduce(p.grad) for p in params]]
        want = [expected[0][rows], expected[1][rows], *expected[2:]]
        tol = tolerance(dtype)
        for name, a, e in zip(["y", "dx", "dWqkv", "dbqkv", "dWo", "dbo"], got, want):
            if a.dtype != dtype or not np.allclose(a, e, **tol):
                problems.append(f"{name}: max error {np.max(np.abs(a - e)):.3g}")
        if scheme == "hybrid":
            layer.ulysses.free()
            layer.ring.free()
        group.free()
    agree(not problems, "; ".join(problems))


CASES = [  # heads, seq_len, causal, padded, layout
    pytest.param(1, 11, False, False, "contiguous", id="1head"),
    pytest.param(3, 11, True, False, "contiguous", id="heads3-causal"),
    pytest.param(3, 13, True, False, "zigzag", id="heads3-causal-zigzag"),
    pytest.param(2, 10, False, True, "contiguous", id="padding"),
    pytest.param(3, 13, True, True, "zigzag", id="causal-padding-zigzag"),
]


@pytest.mark.mpi(min_size=1)
def test_reference_matches_finite_differences():
    """The serial reference's hand-derived gradients, checked once by central differences."""
    heads, s_len, dtype = 2, 5, np.float64
    x, dy = rng_array(1, (s_len, B, 4), dtype), rng_array(2, (s_len, B, 4), dtype)
    ws = [rng_array(i + 3, shape, dtype) for i, shape in enumerate([(12, 4), (12,), (4, 4), (4,)])]
    lens = np.array([4, 2])
    _, dx, *dws = reference(x, *ws, heads, True, lens, dy)
    loss = lambda: float((reference(x, *ws, heads, True, lens, dy)[0] * dy).sum())  # noqa: E731
    ok = np.allclose(dx, numeric_grad(loss, x), rtol=1e-6, atol=1e-7)
    ok &= all(np.allclose(g, numeric_grad(loss, w), rtol=1e-6, atol=1e-7) for g, w in zip(dws, ws))
    agree(ok, "reference gradients differ from finite differences")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("heads,seq_len,causal,padded,layout", CASES)
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_ring_attention_f64(cp, heads, seq_len, causal, padded, layout):
    run_case(cp, heads, seq_len, causal, padded, layout)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_ring_attention_f32(cp):
    run_case(cp, 3, 13, True, True, "zigzag", dtype=np.float32)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("xp_name", XPS)
@pytest.mark.parametrize("scheme,ulysses_size", [("ring", None), ("hybrid", 2)])
def test_array_modules(scheme, ulysses_size, xp_name):
    """NumPy and CuPy arrays through ring and hybrid attention, masked, zig-zag."""
    if WORLD.size % 2:
        pytest.skip("needs an even number of ranks")
    run_case(WORLD.size, 3, 13, True, True, "zigzag", scheme=scheme, ulysses_size=ulysses_size,
             xp=get_xp(xp_name))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal,padded", [(False, False), (True, True)], ids=["plain", "masked"])
@pytest.mark.parametrize("scheme,cp,ulysses_size", [("ulysses", 2, None), ("ulysses", 4, None),
                                                    ("hybrid", 4, 2), ("hybrid", 8, 2),
                                                    ("hybrid", 8, 4)])
def test_ulysses_and_hybrid(scheme, cp, ulysses_size, causal, padded, layout):
    run_case(cp, 5, 13, causal, padded, layout, scheme=scheme, ulysses_size=ulysses_size)


@pytest.mark.mpi(min_size=2)
def test_ring_bytes_and_no_input_gradient():
    """Per-rank bytes equal the ring formulas; input_grad=False returns None with the same
    parameter gradients; frozen QKV with no input gradient skips the ring backward entirely."""
    cp, seq_len, dtype = WORLD.size, 2 * WORLD.size + 1, np.float64
    group = Group(WORLD, "cp-world", list(range(cp)), owns_comm=False)
    x = rng_array(5, (seq_len, B, HIDDEN), dtype)
    dy = rng_array(6, (seq_len, B, HIDDEN), dtype)
    rows = rows_of(seq_len, cp, group.rank, "contiguous")
    xl, dyl = np.ascontiguousarray(x[rows]), np.ascontiguousarray(dy[rows])
    grads = []
    for input_grad in (True, False):
        layer = ContextAttention(HIDDEN, 3, group=group, dtype=dtype, input_grad=input_grad)
        with stats.record() as rec:
            layer.forward(xl)
            dx = layer.backward(dyl)
        grads.append([p.grad.copy() for p in layer.parameters()])
    sizes = [len(rows_of(seq_len, cp, r, "contiguous")) for r in range(cp)]
    kv = lambda r: 2 * sizes[r % cp] * B * HIDDEN * 8  # noqa: E731 - bytes of rank r's k and v
    me = group.rank
    fwd = sum(kv(me - t) for t in range(cp - 1))
    bwd = fwd + sum(kv(me - t) for t in range(cp))
    sent = {op: row[1] for (name, op), row in rec.rows.items() if name == "cp-world"}
    ok = dx is None and sent == {"ring_attention.forward": fwd, "ring_attention.backward": bwd}
    ok &= all(np.array_equal(a, b) for a, b in zip(*grads))
    layer.qkv.weight.requires_grad = layer.qkv.bias.requires_grad = False
    layer.qkv.weight.grad = layer.qkv.bias.grad = None
    with stats.record() as rec:
        layer.forward(xl)
        ok &= layer.backward(dyl) is None
    ok &= all(op != "ring_attention.backward" for _, op in rec.rows)
    ok &= layer.qkv.weight.grad is None and layer.qkv.bias.grad is None
    agree(ok, f"sent {sent}, expected forward {fwd} backward {bwd}; dx {type(dx)}")


@pytest.mark.mpi(min_size=2)
def test_keys_and_values_of_any_strides():
    """A Fortran-ordered kv on every rank, and a strided one on one rank only: the ring's
    results (forward and every gradient) equal those of the C-ordered kv."""
    cp = WORLD.size
    group = Group(WORLD, "cp-world", list(range(cp)), owns_comm=False)
    segments = [sequence_segments(2 * cp + 1, cp, c) for c in range(cp)]
    n = sum(b - a for a, b in segments[group.rank])
    rng = np.random.default_rng(group.rank)
    qh, kv = rng.standard_normal((2, 2, n, 4)), rng.standard_normal((2, 2, 2, n, 4))
    dout = rng.standard_normal(qh.shape)
    out, lse = ring_attention_forward(qh, kv, group, segments, causal=True)
    grads = ring_attention_backward(dout, qh, kv, out, lse, group, segments, causal=True)
    strided = np.repeat(kv, 2, axis=-1)[..., ::2]
    for other in (np.asfortranarray(kv), strided if group.rank == 0 else kv):
        o, l = ring_attention_forward(qh, other, group, segments, causal=True)
        g = ring_attention_backward(dout, qh, other, o, l, group, segments, causal=True)
        agree(np.array_equal(o, out) and all(np.array_equal(a, b) for a, b in zip(g, grads)),
              f"kv of strides {other.strides}: results differ from the C-ordered kv's")


@pytest.mark.mpi(min_size=2)
def test_context_attention_bad_input():
    group = Group(WORLD, "cp-world", list(range(WORLD.size)), owns_comm=False)
    raises_everywhere(ValueError, "scheme must be one of", ContextAttention, 6, 2, "rings",
                      group=group)
    raises_everywhere(ValueError, "needs ulysses_size= or groups=", ContextAttention, 6, 2,
                      "hybrid", group=group)
    raises_everywhere(ValueError, "layout must be 'contiguous' or 'zigzag'", ContextAttention,
                      6, 2, group=group, layout="snake")
    if WORLD.size % 3:
        raises_everywhere(ValueError, "ulysses_size 3 does not divide", ContextAttention, 6, 2,
                          "hybrid", group=group, ulysses_size=3)
    layer = ContextAttention(6, 2, group=group, dtype=np.float64)
    n = 3 if WORLD.rank == 0 else 1  # not the balanced split of the total
    raises_everywhere(ValueError, "are not the balanced split", layer.forward,
                      np.zeros((n, B, 6)))
    x = np.zeros((2, B, 6))
    raises_everywhere(ValueError, r"key_lengths must lie in \[1, ", layer.forward, x,
                      key_lengths=np.array([0, 1]))
    raises_everywhere(ValueError, "key_lengths must be integers of shape", layer.forward, x,
                      key_lengths=np.array([1.0, 2.0]))


@pytest.mark.mpi(min_size=2)
def test_hybrid_groups_argument():
    """Groups passed in give the results of the groups split inside; wrong ones are refused."""
    if WORLD.size % 2:
        pytest.skip("needs an even number of ranks")
    group = Group(WORLD, "cp-world", list(range(WORLD.size)), owns_comm=False)
    groups = split_context_group(group, 2)
    x = rng_array(7, (2, B, HIDDEN), np.float64)
    a = ContextAttention(HIDDEN, 3, "hybrid", group=group, groups=groups, causal=True,
                         dtype=np.float64).forward(x)
    b = ContextAttention(HIDDEN, 3, "hybrid", group=group, ulysses_size=2, causal=True,
                         dtype=np.float64).forward(x)
    agree(np.array_equal(a, b), "groups= and ulysses_size= differ")
    swapped = (groups[0], groups[0])
    raises_everywhere(ValueError, "groups= must be Ulysses groups", ContextAttention, HIDDEN, 3,
                      "hybrid", group=group, groups=swapped)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_query_tiles(monkeypatch, layout):
    """Score tiles smaller than a block (TILE_ROWS=2) give the same results."""
    monkeypatch.setattr(blockwise, "TILE_ROWS", 2)
    run_case(min(WORLD.size, 4), 3, 13, True, True, layout)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("scheme,cp,ulysses_size", [("ulysses", 2, None), ("hybrid", 4, 2)])
def test_fewer_heads_than_ulysses_ranks(scheme, cp, ulysses_size):
    """One head over two Ulysses ranks: one rank gets no head and still takes part."""
    run_case(cp, 1, 7, True, True, "zigzag", scheme=scheme, ulysses_size=ulysses_size)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tile", [2, 512])
@pytest.mark.parametrize("scheme,ulysses_size", [("ring", None), ("hybrid", 2)])
def test_zigzag_causal_work_is_equal(monkeypatch, scheme, ulysses_size, tile):
    """Zig-zag causal: every rank computes the same number of score elements.

    The elements are counted in the block kernels during a forward + backward that run_case
    also checks against the serial reference. Each query tile must compute exactly the keys
    before its end (its visible keys and the upper triangle of its diagonal square), which the
    zig-zag order makes equal over ranks; the contiguous order's counts differ, which shows
    that the counter sees the work.
    """
    cp, u = WORLD.size, ulysses_size or 1
    if scheme == "hybrid" and (cp < 4 or cp % u):
        pytest.skip("hybrid with a ring of 2 or more needs 4 ranks, an even number")
    monkeypatch.setattr(blockwise, "TILE_ROWS", tile)
    computed = [0]
    scores = blockwise._scores

    def counting(*args):
        s = scores(*args)
        computed[0] += s.size
        return s
    monkeypatch.setattr(blockwise, "_scores", counting)
    heads, chunk = 2, 5
    seq_len = 2 * cp * chunk
    ring_rank = WORLD.rank // u
    rows = [s for c in range(ring_rank * u, (ring_rank + 1) * u)
            for s in sequence_segments(seq_len, cp, c, "zigzag")]
    # a query tile [qa, qb) computes the keys [0, qb): (qb - qa) * qb elements per head
    tiles = [(qa, min(qa + tile, b)) for a, b in rows for qa in range(a, b, tile)]
    expected = 2 * B * (heads // u) * sum((qb - qa) * qb for qa, qb in tiles)  # fwd and bwd
    counts = {}
    for layout in ("contiguous", "zigzag"):
        computed[0] = 0
        run_case(cp, heads, seq_len, True, False, layout, scheme=scheme, ulysses_size=ulysses_size)
        counts[layout] = WORLD.allgather(computed[0])
    zigzag, contiguous = counts["zigzag"], counts["contiguous"]
    agree(len(set(zigzag)) == 1 and zigzag[WORLD.rank] == expected and len(set(contiguous)) > 1,
          f"score elements per rank: zigzag {zigzag} (expected {expected} here), "
          f"contiguous {contiguous}")


@pytest.mark.mpi(min_size=2)
def test_ranks_that_differ_raise_everywhere():
    """The ring's point-to-point messages are checked: ranks passing another batch, dtype or
    head count, or calling backward with another mask, raise instead of mixing blocks."""
    cp, seq_len = WORLD.size, 2 * WORLD.size + 1
    group = Group(WORLD, "cp-world", list(range(cp)), owns_comm=False)
    rows = rows_of(seq_len, cp, group.rank, "contiguous")
    first = WORLD.rank == 0
    start = time.monotonic()

    def run(heads=3, batch=B, dtype=np.float64, lens=None):
        layer = ContextAttention(HIDDEN, heads, group=group, dtype=dtype, seed=4)
        x = rng_array(8, (seq_len, batch, HIDDEN), dtype)
        return layer, x, layer.forward(x[rows], key_lengths=lens)

    layer, x, y = run()  # the correct case, against the serial reference
    dy = rng_array(9, (seq_len, B, HIDDEN), np.float64)
    weights = [p.data for p in (layer.qkv.weight, layer.qkv.bias, layer.proj.weight,
                                layer.proj.bias)]
    expected = reference(x, *weights, 3, False, None, dy)
    dx = layer.backward(dy[rows])
    agree(np.allclose(y, expected[0][rows], rtol=1e-12, atol=1e-12)
          and np.allclose(dx, expected[1][rows], rtol=1e-12, atol=1e-12), "y or dx is wrong")
    mismatch = CollectiveMismatchError
    # The layer's agreement (its label, input and key lengths) meets them first.
    layer_call = r"ContextAttention\(hidden=6, heads=3.*\.forward"
    raises_everywhere(mismatch, layer_call, run, batch=B + first)
    raises_everywhere(mismatch, "float32", run, dtype=np.float32 if first else np.float64)
    raises_everywhere(mismatch, r"ContextAttention\(hidden=6, heads=1", run,
                      heads=1 if first else 3)
    raises_everywhere(mismatch, "key_lengths", run, lens=np.array([1 + first, 2]))
    raises_everywhere(mismatch, "key_lengths", run,  # out of range on rank 0 alone
                      lens=np.array([1, 2 * seq_len if first else 2]))
    raises_everywhere(mismatch, r"(?s)refused by this rank: .*expected input of shape",
                      layer.forward, np.zeros((len(rows), B, 5 if first else 6)))
    # Direct calls: backward with another mask on one rank.
    qh = rng_array(10, (B, 2, len(rows), 3), np.float64)
    kv = rng_array(11, (2, B, 2, len(rows), 3), np.float64)
    segments = [sequence_segments(seq_len, cp, c) for c in range(cp)]
    out, lse = ring_attention_forward(qh, kv, group, segments)
    raises_everywhere(mismatch, "ring_attention.backward", ring_attention_backward, out, qh, kv,
                      out, lse, group, segments, causal=first)
    # A rank whose arrays do not fit its rows makes every rank raise.
    raises_everywhere(mismatch, "arrays fit=False", ring_attention_forward,
                      qh[:, :, :-1] if first else qh, kv, group, segments)
    agree(time.monotonic() - start < 10, "the mismatches took more than 10 s to raise")
