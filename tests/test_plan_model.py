"""The planner's arithmetic: per-algorithm costs, checks, machines, fits and the ranking.

Pure arithmetic, checked against figures worked out by hand from the formulas of
:mod:`pympar.plan.costs` (and the machines' stated latencies and bandwidths); one rank.
"""

from __future__ import annotations

import math
import time

import pytest

from mpi_helpers import WORLD
from pympar.plan import costs
from pympar.plan.kernels import fit
from pympar.plan.ledger import canonical
from pympar.plan.machines import PRESETS, Link, Machine, machine
from pympar.plan.models import Layout, run_step
from pympar.plan.ranking import predict, rank, work_seconds
from pympar.plan.presets import BurgersModel, FNOModel
from pympar.plan.program import Work

pytestmark = pytest.mark.skipif(WORLD.size > 1, reason="arithmetic; one rank is enough")

FLAT = Machine("flat", "1 us and 1 GB/s everywhere", cores=4, intra=Link(1e-6, 1e9),
               inter=Link(10e-6, 1e8), memory_bandwidth=1e10, flop_rate=1e10,
               op_overhead=1e-5, call_overhead=2e-6, check_intra=1e-6, node_size=4)


@pytest.mark.parametrize("primitive, name, p, n, rounds, sent", [
    ("all_reduce", "ring", 4, 1024, 6, 1536),
    ("all_reduce", "recursive doubling", 8, 8, 3, 24),
    ("all_reduce", "Rabenseifner", 8, 8192, 6, 14336),
    ("all_gather", "ring", 4, 4096, 3, 3072),
    ("all_gather", "recursive doubling", 8, 4096, 3, 3584),
    ("reduce_scatter", "pairwise", 4, 4096, 3, 3072),
    ("reduce_scatter", "recursive halving", 4, 4096, 2, 3072),
    ("all_to_all", "pairwise", 4, 4096, 3, 3072),
    ("all_to_all", "Bruck", 8, 1024, 3, 1536),
    ("broadcast", "binomial tree", 8, 100, 3, 100),
])
def test_messages_bytes_and_round_trips_follow_the_table(primitive, name, p, n, rounds, sent):
    t = costs.traffic(primitive, p, p, n, name)
    assert (t.rounds, t.messages, t.nbytes, t.inter_bytes) == (rounds, rounds, sent, 0)
    assert (t.intra_rounds, t.inter_rounds) == (rounds, 0)


def test_algorithms_follow_the_models_thresholds():
    assert costs.algorithm("all_reduce", 8, 2048) == "recursive doubling"
    assert costs.algorithm("all_reduce", 8, 2049) == "Rabenseifner"
    assert costs.algorithm("all_reduce", 6, 2**20) == "recursive doubling"  # not a power of 2
    assert costs.algorithm("all_gather", 8, 2**19 - 1) == "recursive doubling"
    assert costs.algorithm("all_gather", 8, 2**19) == "ring"
    assert costs.algorithm("all_to_all", 8, 8 * 256) == "Bruck"
    assert costs.algorithm("all_to_all", 4, 8) == "pairwise"


def test_rounds_across_nodes_are_the_last_ones_and_share_the_nodes_link():
    # 16 ranks, 4 a node: recursive doubling of 8 bytes, 2 rounds inside, 2 across
    t = costs.traffic("all_reduce", 16, 4, 8.0)
    assert (t.intra_rounds, t.inter_rounds, t.intra_path, t.inter_path) == (2, 2, 16, 64)
    assert costs.seconds(t, FLAT) == pytest.approx(2e-6 + 16e-9 + 20e-6 + 64e-8)
    # a ring across nodes waits for a node boundary every round
    ring = costs.traffic("all_gather", 8, 2, 8000.0, "ring")
    assert (ring.inter_rounds, ring.inter_path, ring.nbytes) == (7, 7000, 7000)
    assert costs.seconds(ring, FLAT) == pytest.approx(7 * 10e-6 + 7000 / 1e8)
    # pairwise: 3 partners on my node, 4 on the other, the link shared by my node's 4
    pair = costs.traffic("all_to_all", 8, 4, 8000.0, "pairwise")
    assert (pair.intra_rounds, pair.inter_rounds, pair.inter_path) == (3, 4, 4 * 1000 * 4)
    assert costs.traffic("ring_transfer", 1, 1, 100.0).rounds == 0


def test_the_check_is_a_word_on_one_node_and_one_exchange_among_leaders():
    assert costs.check_seconds("board", 1, 1, FLAT) == 0
    assert costs.check_seconds("board", 4, 4, FLAT) == pytest.approx(1e-6)
    # 4 nodes: the words inside, then the leaders' one direct exchange (<= 16 leaders)
    assert costs.check_seconds("board", 16, 4, FLAT) == pytest.approx(2e-6 + 10e-6)
    # 64 leaders: an all-gather among them, log2(64) = 6 rounds
    assert costs.check_seconds("board", 256, 4, FLAT) == pytest.approx(2e-6 + 60e-6)
    assert costs.check_seconds("neighbours", 256, 4, FLAT) == pytest.approx(1e-6 + 10e-6)
    extents = costs.check_seconds("extents", 4, 4, FLAT)
    assert extents == pytest.approx(1e-6 + 2e-6 + 48 / 1e9)  # and a 64-byte all-gather


def test_a_checkpoint_is_the_slower_of_the_ranks_and_the_file_systems_writes():
    m = PRESETS["hdr"]
    one = costs.checkpoint_seconds(64e9, 64, 64, m)
    assert one >= 64e9 / m.disk_bandwidth and one >= 1e9 / m.disk_rank_bandwidth


def test_canonical_labels_drop_the_settings():
    assert canonical("Linear3D(8->16, bias=True, dtype=float64).forward:all_gather") == \
        "Linear3D.forward:all_gather"
    assert canonical("allreduce_gradients[3 params, layout 1c2f9e0a] sum:all_reduce") == \
        "allreduce_gradients sum:all_reduce"
    assert canonical("SpectralConv.forward(4->4, modes=(3, 3), grid (10,))") == \
        "SpectralConv.forward"
    assert canonical("copy_to_all.backward") == "copy_to_all.backward"


def test_machines_by_name_and_json():
    assert machine("hdr") is PRESETS["hdr"]
    assert Machine.from_json(FLAT.to_json()) == FLAT
    with pytest.raises(ValueError, match="unknown machine 'x': choose this, vm, hdr, 25gbe, gpu"):
        machine("x")


def test_a_fit_finds_the_coefficients_it_was_made_with():
    a, b, c = 5e-6, 1e-11, 2e-10
    data = [([Work("k", f, n)], a + b * f + c * n)
            for f, n in ((1e6, 1e4), (1e8, 1e5), (1e7, 1e7), (1e9, 1e6), (1e5, 1e8))]
    data += [([Work("k", 1e6, 1e4), Work("j", 0, 1e6)], a + b * 1e6 + c * 1e4 + 3e-4)]
    fitted = fit(data)
    assert fitted["k"] == pytest.approx([a, b, c], rel=1e-6)
    assert fitted["j"][0] + fitted["j"][2] * 1e6 == pytest.approx(3e-4, rel=1e-6)
    roofline = work_seconds(Work("unknown", 1e9, 1e6), FLAT)
    assert roofline == pytest.approx(1e-5 + 0.1)


def test_ranking_is_fastest_first_and_shares_add_up():
    fitting, unfit = rank(BurgersModel(), 8, FLAT)
    steps = [p.step for p in fitting]
    assert steps == sorted(steps) and len(fitting) + len(unfit) == len(BurgersModel().layouts(8))
    for p in fitting:
        s = p.seconds
        assert s["step"] == pytest.approx(s["compute"] + s["communication"] + s["checks"])
        assert 0 <= p.communication_share <= 1 and p.memory["total"] > 0


def test_ranks_sharing_cores_take_turns():
    one = predict(BurgersModel(), Layout(dp=4), FLAT)
    shared = predict(BurgersModel(), Layout(dp=4), FLAT, node_size=8)  # 4 ranks, 4 cores
    assert shared.seconds == one.seconds
    two = Machine(**{**FLAT.__dict__, "cores": 2, "shared": {"2": 1e-3},
                     "shared_check": {"2": 5e-4}})
    slow = predict(BurgersModel(), Layout(dp=4), two)
    assert slow.seconds["compute"] == pytest.approx(2 * one.seconds["compute"])
    calls = sum(1 for c in run_step(BurgersModel(), Layout(dp=4)).env.calls)
    assert slow.seconds["communication"] == pytest.approx(one.seconds["communication"]
                                                          + calls * 1e-3)


def test_meetings_wait_a_share_of_the_work_up_to_a_bound():
    waits = Machine(**{**FLAT.__dict__, "jitter": 0.1, "wait_cap": 2e-3,
                       "shared_waits": {"2": [0.2, 4e-3], "4": [0.4, 8e-3]}})
    assert Machine.from_json(waits.to_json()) == waits
    assert waits.meeting_wait(1, 0.01) == pytest.approx(1e-3)
    assert waits.meeting_wait(1, 0.1) == pytest.approx(2e-3)  # the bound
    assert waits.meeting_wait(2, 0.01) == pytest.approx(2e-3)
    assert waits.meeting_wait(4, 1.0) == pytest.approx(8e-3)
    assert waits.meeting_wait(8, 0.01) == pytest.approx(0.4 * 0.01)  # 4's share
    assert waits.meeting_wait(8, 1.0) == pytest.approx(16e-3)  # 4's bound, twice
    assert waits.meeting_wait(1.5, 1.0) == pytest.approx(3e-3)  # 2's, three quarters
    assert FLAT.meeting_wait(4, 1.0) == 0.0  # no jitter measured: none
    # Priced at every meeting: each call or check after work waits for the slowest.
    base = predict(BurgersModel(), Layout(dp=4), FLAT)
    late = predict(BurgersModel(), Layout(dp=4), Machine(**{**FLAT.__dict__, "jitter": 1.0,
                                                            "wait_cap": 1e-3}))
    meetings = sum(1 for e in run_step(BurgersModel(), Layout(dp=4)).env.timeline
                   if not isinstance(e, Work))
    extra = late.step - base.step
    assert 0 < extra <= meetings * 1e-3 + 1e-12


def test_too_little_memory_is_the_reason_a_layout_does_not_fit():
    small = predict(BurgersModel(), Layout(), FLAT, memory=2**20)
    assert not small.fits and "MiB per rank, more than 1.0 MiB" in small.reason
    assert BurgersModel().unfit(Layout(tp=2, mode="3d")) == \
        "3d needs a cube tp (1, 8, 27, ...), not 2"
    assert FNOModel().unfit(Layout(cp=64)) == "grid 32 has fewer rows than spatial 64"


def test_sixteen_thousand_ranks_on_paper_without_mpi():
    model = BurgersModel(hidden=1024, heads=16, layers=4, grid=16384, batch=256)
    start = time.perf_counter()
    pred = predict(model, Layout(tp=8, cp=8, dp=256), PRESETS["hdr"])
    assert pred.fits and time.perf_counter() - start < 10
    assert pred.seconds["checks"] > 0 and pred.bytes_sent > 0
    # the data-parallel group crosses nodes: its rank 0 sends over the network
    assert math.isfinite(pred.step)
