"""The vocabulary-parallel embedding and cross-entropy against serial NumPy.

Vocabulary sizes that no tested TP size divides; repeated token ids; targets ignored and
smoothed. The references are written here in NumPy (the cross-entropy's gradient formula
is itself checked against central differences), not built from pympar's layers.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from layer_helpers import DTYPES, XPS, block, get_xp, rng_array, self_group, tolerance
from mpi_helpers import WORLD, agree, assert_close, assert_equal, raises_everywhere, to_numpy
from pympar import manager
from pympar.debug import CollectiveMismatchError
from pympar.modules import (ColumnParallelLinear, Linear, VocabParallelCrossEntropy,
                            VocabParallelEmbedding)

V, H, S, B = 11, 5, 6, 3  # V = 11: uneven over 2 and 4 ranks
IGNORE = -100


def tp_sizes() -> list[int]:
    return [tp for tp in (1, 2, 4) if WORLD.size % tp == 0]


def token_ids(xp=np, dtype=np.int64) -> np.ndarray:
    """Ids with repeats, the first and the last word included."""
    ids = np.random.default_rng(5).integers(0, V, (S, B)).astype(dtype)
    ids[0, 0], ids[-1, -1], ids[1] = 0, V - 1, ids[2]
    return ids if xp is np else xp.asarray(ids)


# ----------------------------------------------------------------------- embedding
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("xp_name", XPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sequence-parallel"])
def test_embedding_equals_a_serial_lookup(clean_state, xp_name, dtype, sp):
    xp = get_xp(xp_name)
    ids = token_ids(xp)
    host_ids = to_numpy(ids)
    dy = rng_array(7, (S, B, H), dtype, xp)
    tol = tolerance(dtype)
    for tp in tp_sizes():
        manager.initialize_parallel(tp)
        r = manager.get_tensor_parallel_rank()
        layer = VocabParallelEmbedding(V, H, use_sequence_parallel=sp, dtype=dtype, seed=3,
                                       xp=xp)
        table = to_numpy(VocabParallelEmbedding(V, H, dtype=dtype, seed=3,
                                                group=_alone()).weight.data)
        rows = block(V, tp, r)
        what = f"tp={tp} sp={sp}"
        assert_equal(layer.weight.data, table[rows], f"{what} table shard")
        y = layer.forward(ids)
        expected = table[host_ids]
        seq = block(S, tp, r) if sp else slice(None)
        assert_close(y, expected[seq], **tol, what=f"{what} forward")
        assert layer.backward(dy[seq]) is None
        grad = np.zeros((V, H), np.float64)
        np.add.at(grad, host_ids.reshape(-1), to_numpy(dy).reshape(-1, H).astype(np.float64))
        assert_close(layer.weight.grad, grad[rows].astype(dtype), **tol, what=f"{what} dW")
        manager.destroy_parallel()


def _alone():
    """A group of this rank alone: the serial layer."""
    return self_group()


@pytest.mark.mpi(min_size=2)
def test_an_id_outside_the_vocabulary_on_one_rank_raises_on_every_rank(clean_state):
    manager.initialize_parallel(WORLD.size)
    layer = VocabParallelEmbedding(V, H, dtype=np.float64)
    ids = token_ids()
    if WORLD.rank == WORLD.size - 1:
        ids[0, 0] = V
    raises_everywhere(CollectiveMismatchError, "refused", layer.forward, ids)
    raises_everywhere(ValueError, r"must lie in \[0, 11\)", layer.forward,
                      np.full((2, 2), -1))
    raises_everywhere(ValueError, "must be integers", layer.forward, np.zeros((2, 2)))


# ----------------------------------------------------------------------- cross-entropy
def serial_cross_entropy(logits: np.ndarray, target: np.ndarray, smoothing: float,
                         ignore: int) -> tuple[float, np.ndarray]:
    """Loss and dloss/dlogits of torch.nn.CrossEntropyLoss(label_smoothing=s,
    ignore_index=ignore, reduction="mean"), in float64."""
    z = logits.reshape(-1, V).astype(np.float64)
    t = target.reshape(-1)
    kept = t != ignore
    log_p = z - z.max(axis=1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(axis=1, keepdims=True))
    safe = np.where(kept, t, 0)
    nll = -log_p[np.arange(t.size), safe]
    smooth = -log_p.mean(axis=1)
    per_row = (1 - smoothing) * nll + smoothing * smooth
    count = int(kept.sum())
    loss = float(per_row[kept].sum() / count) if count else 0.0
    onehot = np.zeros_like(z)
    onehot[np.arange(t.size), safe] = 1.0
    grad = (np.exp(log_p) - (1 - smoothing) * onehot - smoothing / V) * kept[:, None]
    return loss, (grad / max(count, 1)).reshape(logits.shape)


def ce_inputs(dtype, xp=np, ignore=IGNORE):
    logits = rng_array(9, (S, B, V), dtype) * 3
    target = np.random.default_rng(4).integers(0, V, (S, B))
    target[0, 1] = target[3, 2] = ignore  # two ignored
    target[1, 0], target[2, 0] = 0, V - 1
    return (logits if xp is np else xp.asarray(logits), logits,
            target if xp is np else xp.asarray(target), target)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_the_serial_gradient_is_the_derivative_of_the_serial_loss(smoothing):
    _, logits, _, target = ce_inputs(np.float64)
    logits = logits[:2]
    target = target[:2]
    _, grad = serial_cross_entropy(logits, target, smoothing, IGNORE)
    numeric = np.empty_like(logits)
    flat, out, eps = logits.reshape(-1), numeric.reshape(-1), 1e-6
    for i in range(flat.size):
        keep = flat[i]
        flat[i] = keep + eps
        hi = serial_cross_entropy(logits, target, smoothing, IGNORE)[0]
        flat[i] = keep - eps
        lo = serial_cross_entropy(logits, target, smoothing, IGNORE)[0]
        flat[i] = keep
        out[i] = (hi - lo) / (2 * eps)
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-9)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("xp_name", XPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignore", [IGNORE, 0], ids=["ignore-100", "ignore-class-0"])
def test_cross_entropy_equals_the_serial_loss_and_gradient(clean_state, xp_name, dtype,
                                                           smoothing, ignore):
    xp = get_xp(xp_name)
    logits, host_logits, target, host_target = ce_inputs(dtype, xp, ignore)
    loss_ref, grad_ref = serial_cross_entropy(host_logits, host_target, smoothing, ignore)
    tol = tolerance(dtype)
    for tp in tp_sizes():
        manager.initialize_parallel(tp)
        r = manager.get_tensor_parallel_rank()
        cols = block(V, tp, r)
        loss_fn = VocabParallelCrossEntropy(V, label_smoothing=smoothing, ignore_index=ignore,
                                            dtype=dtype)
        what = f"tp={tp} smoothing={smoothing} ignore={ignore}"
        loss = loss_fn.forward(logits[..., cols], target)
        agree(abs(loss - loss_ref) <= tol["rtol"] * abs(loss_ref) + tol["atol"],
              f"{what}: loss {loss} != {loss_ref}")
        grad = loss_fn.backward(2.0)
        assert_close(grad, (2.0 * grad_ref[..., cols]).astype(dtype), **tol, what=f"{what} grad")
        manager.destroy_parallel()


@pytest.mark.mpi(min_size=1)
def test_all_targets_ignored_give_zero(clean_state):
    manager.initialize_parallel(WORLD.size)
    cols = block(V, WORLD.size, manager.get_tensor_parallel_rank())
    loss_fn = VocabParallelCrossEntropy(V, dtype=np.float64)
    logits = rng_array(1, (3, V), np.float64)
    assert loss_fn.forward(logits[:, cols], np.full(3, IGNORE)) == 0.0
    assert_equal(loss_fn.backward(), np.zeros((3, cols.stop - cols.start)), "zero grad")


@pytest.mark.mpi(min_size=2)
def test_more_ranks_than_words(clean_state):
    """A vocabulary smaller than the group: some ranks hold no word, and still agree."""
    manager.initialize_parallel(WORLD.size)
    vocab = WORLD.size - 1
    cols = block(vocab, WORLD.size, manager.get_tensor_parallel_rank())
    logits = rng_array(2, (4, vocab), np.float64)
    target = np.arange(4) % vocab
    loss_fn = VocabParallelCrossEntropy(vocab, dtype=np.float64)
    z = logits - logits.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    expected = -log_p[np.arange(4), target].mean()
    loss = loss_fn.forward(logits[:, cols], target)
    agree(abs(loss - expected) < 1e-12, f"loss {loss} != {expected}")
    grad = np.exp(log_p)
    grad[np.arange(4), target] -= 1.0
    assert_close(loss_fn.backward(), grad[:, cols] / 4, what="grad")


@pytest.mark.mpi(min_size=2)
def test_an_embedding_with_more_ranks_than_words(clean_state):
    """Ranks that hold no row of the table give zeros and an empty gradient."""
    manager.initialize_parallel(WORLD.size)
    vocab = WORLD.size - 1
    rows = block(vocab, WORLD.size, manager.get_tensor_parallel_rank())
    table = VocabParallelEmbedding(vocab, H, dtype=np.float64, seed=2, group=_alone()).weight.data
    layer = VocabParallelEmbedding(vocab, H, dtype=np.float64, seed=2)
    ids = np.arange(6).reshape(3, 2) % vocab
    assert_equal(layer.forward(ids), table[ids], "forward")
    dy = rng_array(4, (3, 2, H), np.float64)
    layer.backward(dy)
    grad = np.zeros((vocab, H))
    np.add.at(grad, ids.reshape(-1), dy.reshape(-1, H))
    assert_close(layer.weight.grad, grad[rows], what="dW")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("int_dtype", [np.uint8, np.int16, np.uint32])
def test_narrow_integer_ids_and_targets(clean_state, int_dtype):
    """Ids of a dtype that cannot hold a rank's first word (uint8 ids, words 300 on) are
    looked up and scored as int64 ones."""
    vocab, tokens = 600, 8
    ids = np.array([0, 1, 254, 255, 7, 7, 100, 3], int_dtype)
    logits = rng_array(6, (tokens, vocab), np.float64)
    loss_ref, grad_ref = _dense_cross_entropy(logits, ids.astype(np.int64))
    for tp in tp_sizes():
        manager.initialize_parallel(tp)
        r = manager.get_tensor_parallel_rank()
        table = VocabParallelEmbedding(vocab, H, dtype=np.float64, seed=1,
                                       group=_alone()).weight.data
        layer = VocabParallelEmbedding(vocab, H, dtype=np.float64, seed=1)
        assert_equal(layer.forward(ids), table[ids.astype(np.int64)], f"tp={tp} lookup")
        cols = block(vocab, tp, r)
        loss_fn = VocabParallelCrossEntropy(vocab, dtype=np.float64)
        loss = loss_fn.forward(logits[:, cols], ids)
        agree(abs(loss - loss_ref) < 1e-12, f"tp={tp}: loss {loss} != {loss_ref}")
        assert_close(loss_fn.backward(), grad_ref[:, cols], what=f"tp={tp} grad")
        manager.destroy_parallel()


def _dense_cross_entropy(logits: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy (no smoothing, nothing ignored) and its gradient, in float64."""
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    rows = np.arange(len(target))
    grad = np.exp(log_p)
    grad[rows, target] -= 1.0
    return float(-log_p[rows, target].mean()), grad / len(target)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("tokens,vocab", [(4, 70_000), (40_000, 8)],
                         ids=["row-sum-past-65504", "loss-sum-past-65504"])
def test_float16_logits_sum_in_float32(clean_state, tokens, vocab):
    """float16 logits whose row sums of exponentials (a large vocabulary near uniform) or
    whose summed token losses pass float16's largest number give the float64 loss."""
    logits = (rng_array(8, (tokens, vocab), np.float64) * 0.01).astype(np.float16)
    target = np.random.default_rng(2).integers(0, vocab, tokens)
    loss_ref, grad_ref = _dense_cross_entropy(logits, target)
    for tp in tp_sizes():
        manager.initialize_parallel(tp)
        cols = block(vocab, tp, manager.get_tensor_parallel_rank())
        loss_fn = VocabParallelCrossEntropy(vocab, dtype=np.float16)
        loss = loss_fn.forward(logits[:, cols], target)
        agree(abs(loss - loss_ref) < 1e-3 * loss_ref, f"tp={tp}: loss {loss} != {loss_ref}")
        grad = loss_fn.backward()
        agree(grad.dtype == np.float16, f"tp={tp}: gradient of dtype {grad.dtype}")
        assert_close(grad, grad_ref[:, cols], rtol=2e-2, atol=1e-3 / tokens,
                     what=f"tp={tp} grad")
        manager.destroy_parallel()


@pytest.mark.mpi(min_size=1)
def test_a_column_parallel_head_and_the_loss_train_like_the_serial_model(clean_state):
    """x -> ColumnParallelLinear(gather_output=False) -> VocabParallelCrossEntropy: the
    input's and the weight's gradients equal the serial Linear + cross-entropy's."""
    x = rng_array(3, (S, B, H), np.float64)
    _, _, _, target = ce_inputs(np.float64)
    serial = Linear(H, V, dtype=np.float64, seed=8)
    loss_ref, dlogits = serial_cross_entropy(serial.forward(x), target, 0.1, IGNORE)
    dx_ref = serial.backward(dlogits)
    for tp in tp_sizes():
        manager.initialize_parallel(tp)
        cols = block(V, tp, manager.get_tensor_parallel_rank())
        head = ColumnParallelLinear(H, V, gather_output=False, dtype=np.float64, seed=8)
        loss_fn = VocabParallelCrossEntropy(V, label_smoothing=0.1, dtype=np.float64)
        loss = loss_fn.forward(head.forward(x), target)
        agree(abs(loss - loss_ref) < 1e-12, f"tp={tp}: loss {loss} != {loss_ref}")
        dx = head.backward(loss_fn.backward())
        assert_close(dx, dx_ref, rtol=1e-10, atol=1e-12, what=f"tp={tp} dx")
        assert_close(head.weight.grad, serial.weight.grad[cols], rtol=1e-10, atol=1e-12,
                     what=f"tp={tp} dW")
        manager.destroy_parallel()


@pytest.mark.mpi(min_size=2)
def test_no_rank_allocates_the_full_logits(clean_state):
    """The peak of what the loss allocates (forward and backward) stays below one
    (tokens, vocabulary) array: only blocks of the vocabulary exist."""
    manager.initialize_parallel(WORLD.size)
    tokens, vocab = 256, 2048 + 3
    cols = block(vocab, WORLD.size, manager.get_tensor_parallel_rank())
    logits = np.random.default_rng(0).standard_normal((tokens, cols.stop - cols.start))
    target = np.random.default_rng(1).integers(0, vocab, tokens)
    loss_fn = VocabParallelCrossEntropy(vocab, label_smoothing=0.1, dtype=np.float64)
    full = tokens * vocab * 8
    tracemalloc.start()
    try:
        loss_fn.forward(logits, target)
        loss_fn.backward()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    block_bytes = logits.nbytes
    agree(peak < min(full, 1.6 * block_bytes),
          f"peak {peak} bytes: a block is {block_bytes}, the full logits {full}")


@pytest.mark.mpi(min_size=2)
def test_bad_targets_on_one_rank_raise_on_every_rank(clean_state):
    manager.initialize_parallel(WORLD.size)
    cols = block(V, WORLD.size, manager.get_tensor_parallel_rank())
    loss_fn = VocabParallelCrossEntropy(V, dtype=np.float64)
    logits = np.zeros((3, cols.stop - cols.start))
    target = np.array([1, 2, 3])
    if WORLD.rank == WORLD.size - 1:
        target[1] = V
    raises_everywhere(CollectiveMismatchError, "refused", loss_fn.forward, logits, target)
    raises_everywhere(ValueError, "do not match logits", loss_fn.forward, logits,
                      np.array([1, 2]))
    raises_everywhere(CollectiveMismatchError, "", loss_fn.forward, logits,
                      np.array([1, 2, 3], np.int32 if WORLD.rank == 0 else np.int64))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="label_smoothing"):
        VocabParallelCrossEntropy(V, label_smoothing=1.5, group=_alone())
    with pytest.raises(ValueError, match="positive"):
        VocabParallelEmbedding(0, H, group=_alone())
