"""pympar.partition against NumPy's own splitting and fancy indexing (no MPI)."""

import itertools

import numpy as np
import pytest

from pympar.partition import Placement, Split, balanced_sizes, block_slice, strided_slices


@pytest.mark.parametrize("n, parts", [(0, 1), (0, 3), (1, 4), (5, 3), (10, 2), (23, 4), (64, 8)])
def test_blocks_match_array_split(n, parts):
    expected = np.array_split(np.arange(n), parts)
    assert balanced_sizes(n, parts) == tuple(len(e) for e in expected)
    for index, e in enumerate(expected):
        np.testing.assert_array_equal(np.arange(n)[block_slice(n, parts, index)], e)


@pytest.mark.parametrize("n, parts, stride", [(10, 2, 2), (23, 4, 3), (12, 3, 1), (7, 2, 3)])
def test_strided_slices_are_pieces_of_each_fused_part(n, parts, stride):
    fused = np.array_split(np.arange(n), stride)
    for index in range(parts):
        got = np.concatenate([np.arange(n)[s] for s in strided_slices(n, parts, index, stride)])
        expected = np.concatenate([np.array_split(f, parts)[index] for f in fused])
        np.testing.assert_array_equal(got, expected)


def _reference_indices(n, splits_of_axis):
    """Global indices kept by a chain of splits of one axis, by plain NumPy splitting."""
    held = np.arange(n)
    for s in splits_of_axis:
        fused = np.array_split(held, s.stride)
        held = np.concatenate([np.array_split(f, s.parts)[s.index] for f in fused])
    return held


@pytest.mark.parametrize("shape, layout", [
    ((7, 5), [(0, 3, 1), (1, 2, 1)]),        # 2-D blocks
    ((11, 6), [(0, 2, 3)]),                  # fused (stride 3) rows
    ((13, 9), [(0, 2, 1), (0, 2, 1), (1, 2, 1)]),  # nested rows (3D weights) and columns
    ((10, 4), [(0, 2, 2), (0, 3, 1)]),       # a share of a strided shard (sharded optimizer)
    ((5,), []),                              # replicated
])
def test_placement_take_put_match_fancy_indexing(shape, layout):
    full = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    sizes = [parts for _, parts, _ in layout]
    for indices in itertools.product(*(range(p) for p in sizes)):
        splits = tuple(Split(axis, parts, index, stride)
                       for (axis, parts, stride), index in zip(layout, indices))
        placement = Placement(shape, splits)
        rows = [_reference_indices(n, [s for s in splits if s.axis == axis])
                for axis, n in enumerate(shape)]
        expected = full[np.ix_(*rows)]
        assert placement.local_shape == expected.shape
        np.testing.assert_array_equal(placement.take(full), expected)
        rebuilt = np.full(shape, -1.0)
        placement.put(expected, rebuilt)
        mask = np.zeros(shape, bool)
        mask[np.ix_(*rows)] = True
        np.testing.assert_array_equal(rebuilt[mask], full[mask])
        assert (rebuilt[~mask] == -1).all()


def test_placement_tiles_the_full_array_once():
    shape = (13, 9)
    counts = np.zeros(shape, int)
    for a, w, c in itertools.product(range(2), repeat=3):
        placement = Placement(shape, (Split(0, 2, a), Split(0, 2, w), Split(1, 2, c)))
        for g, _ in placement.pieces():
            counts[g] += 1
    assert (counts == 1).all()


def test_bad_split_and_shape_raise():
    with pytest.raises(ValueError, match="index"):
        Split(0, 2, 2)
    with pytest.raises(ValueError, match="axis"):
        Placement((4,), (Split(1, 2, 0),))
    with pytest.raises(ValueError, match="full array of shape"):
        Placement((4, 2)).take(np.zeros((2, 4)))


def test_explicit_sizes_cut_consecutive_blocks_also_of_a_cut_shard():
    full = np.arange(13 * 2 * 4).reshape(13 * 2, 4)
    sizes = (0, 6, 1, 6)  # of the 13 rows of a half (Split(0, 2, 1) first), some empty
    starts = np.cumsum((0,) + sizes)
    for k in range(4):
        placement = Placement(full.shape, (Split(0, 2, 1), Split(0, 4, k, sizes=sizes)))
        assert placement.local_shape == (sizes[k], 4)
        np.testing.assert_array_equal(placement.take(full),
                                      full[13 + starts[k]:13 + starts[k + 1]])
    with pytest.raises(ValueError, match="one extent >= 0 per part"):
        Split(0, 3, 0, sizes=(1, 2))
    with pytest.raises(ValueError, match="add up to 12, the axis holds 13"):
        Placement((26, 4), (Split(0, 2, 0), Split(0, 2, 0, sizes=(6, 6)))).local_shape
