"""The EPLB policy, maps, plan and load window: pure functions, no event loop."""

from __future__ import annotations

import random

import pytest
import torch

from engine.eplb.maps import ExpertMaps, initial_phy2log, logical_replica_count, logical_to_physical_map, max_replicas
from engine.eplb.plan import plan_layer
from engine.eplb.policy import keep_slots, rebalance_experts
from engine.eplb.window import LoadWindow, balancedness, logical_load, rank_loads

# The example published with the reference algorithm (DeepSeek's EPLB README), and its output.
EXAMPLE_LOAD = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                             [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
REFERENCE_PHY2LOG = torch.tensor([[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])


def per_rank_load(load: torch.Tensor, phy2log: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Each rank's load when every expert's load splits evenly over its replicas."""
    count = logical_replica_count(phy2log, load.shape[1])
    per_slot = load.float().gather(1, phy2log) / count.float().gather(1, phy2log)
    return rank_loads(per_slot, num_ranks)


def test_published_example_is_as_balanced_as_the_reference():
    ours = rebalance_experts(EXAMPLE_LOAD, num_replicas=16, num_groups=4, num_nodes=2, num_ranks=8)
    assert ours.shape == (2, 16)
    ours_max = per_rank_load(EXAMPLE_LOAD, ours, 8).max(-1).values
    reference_max = per_rank_load(EXAMPLE_LOAD, REFERENCE_PHY2LOG, 8).max(-1).values
    assert torch.all(ours_max <= reference_max + 1e-6), (ours_max, reference_max)
    # and far better than no rebalancing at all (expert i in slot i, spares round-robin)
    naive_max = per_rank_load(EXAMPLE_LOAD, initial_phy2log(2, 12, 16), 8).max(-1).values
    assert torch.all(ours_max < naive_max)


def check_invariants(phy2log: torch.Tensor, num_logical: int) -> None:
    maps = ExpertMaps.from_phy2log(phy2log, num_logical)
    assert int(maps.replica_count.min()) >= 1  # every logical expert has a slot
    assert torch.equal(maps.replica_count.sum(-1), torch.full((phy2log.shape[0],), phy2log.shape[1]))
    for layer in range(phy2log.shape[0]):
        for expert in range(num_logical):
            slots = [s for s in maps.log2phy[layer, expert].tolist() if s >= 0]
            assert len(slots) == int(maps.replica_count[layer, expert])
            assert all(int(phy2log[layer, s]) == expert for s in slots)  # the maps are mutually inverse
            assert maps.log2phy[layer, expert, len(slots):].eq(-1).all()  # padded with -1


@pytest.mark.parametrize("seed", range(12))
def test_invariants_hold_on_random_loads(seed):
    rng = random.Random(seed)
    num_ranks = rng.choice([1, 2, 4])
    num_nodes = rng.choice([n for n in (1, 2) if num_ranks % n == 0])
    num_groups = rng.choice([g for g in (1, 2, 4) if 16 % g == 0])
    num_logical = 16
    num_physical = num_logical + num_ranks * rng.randint(0, 3)
    load = torch.tensor([[rng.randint(0, 1000) for _ in range(num_logical)] for _ in range(3)])
    phy2log = rebalance_experts(load, num_physical, num_groups, num_nodes, num_ranks)
    check_invariants(phy2log, num_logical)
    old = initial_phy2log(3, num_logical, num_physical)
    kept = rebalance_experts(load, num_physical, num_groups, num_nodes, num_ranks, old_phy2log=old)
    check_invariants(kept, num_logical)
    per_rank = num_physical // num_ranks
    for layer in range(3):  # the same experts on each rank, with or without slot keeping
        for rank in range(num_ranks):
            span = slice(rank * per_rank, (rank + 1) * per_rank)
            assert sorted(kept[layer, span].tolist()) == sorted(phy2log[layer, span].tolist())


def test_experts_that_stay_on_a_rank_keep_their_slot():
    old = torch.tensor([[0, 1, 2, 3, 4, 5]])
    new = torch.tensor([[3, 0, 1, 5, 4, 2]])  # rank 0 keeps 0 and 1, takes 3; rank 1 keeps 4 and 5, takes 2
    kept = keep_slots(new, old, num_ranks=2)
    assert kept.tolist() == [[0, 1, 3, 2, 4, 5]]
    assert len(plan_layer(0, old[0].tolist(), kept[0].tolist(), 2).moves) == 2  # only the swapped pair
    assert len(plan_layer(0, old[0].tolist(), new[0].tolist(), 2).moves) == 5


def test_a_skewed_load_is_spread_and_its_hottest_expert_replicated():
    load = torch.tensor([[1000, 1000, 10, 10, 10, 10, 10, 10]])  # both hot experts start on rank 0
    before = per_rank_load(load, initial_phy2log(1, 8, 8), 2)[0]
    after = per_rank_load(load, rebalance_experts(load, 8, 1, 1, 2), 2)[0]
    assert before.tolist() == [2020, 40]
    assert after.tolist() == [1030, 1030]
    hot = torch.tensor([[1000, 10, 10, 10, 10, 10, 10, 10]])
    assert int(logical_replica_count(rebalance_experts(hot, 12, 1, 1, 2), 8)[0, 0]) == 5  # every spare slot


def test_plan_moves_only_changed_slots_and_prefers_a_source_on_the_same_rank():
    old = [0, 1, 2, 3, 0, 1, 2, 3]
    new = [0, 0, 2, 3, 1, 1, 3, 3]
    plan = plan_layer(0, old, new, num_ranks=2)
    moves = {m.dst_slot: m.src_slot for m in plan.moves}
    assert moves == {1: 0, 4: 5, 6: 7}  # all three have a source on their own rank
    assert plan.num_cross_rank == 0
    crossing = plan_layer(0, [0, 1, 2, 3], [0, 2, 1, 3], num_ranks=2)
    assert {(m.dst_slot, m.src_slot) for m in crossing.moves} == {(1, 2), (2, 1)}
    assert crossing.num_cross_rank == 2
    with pytest.raises(ValueError, match="no slot"):
        plan_layer(0, [0, 1], [0, 2], num_ranks=1)


def test_maps_from_a_placement():
    phy2log = torch.tensor([[0, 1, 2, 0, 0, 1]])
    assert logical_replica_count(phy2log, 3).tolist() == [[3, 2, 1]]
    assert max_replicas(3, 6) == 4
    assert logical_to_physical_map(phy2log, 3).tolist() == [[[0, 3, 4, -1], [1, 5, -1, -1], [2, -1, -1, -1]]]
    with pytest.raises(ValueError, match="at least one"):
        ExpertMaps.from_phy2log(torch.tensor([[0, 0, 1]]), 3)


def test_load_window_slides_and_sums_replicas_into_logical_load():
    window = LoadWindow(size=2, num_layers=1, num_physical=3)
    for step in ([1, 0, 0], [0, 2, 0], [0, 0, 4]):
        window.add(torch.tensor([step]))
    assert window.total.tolist() == [[0, 2, 4]]  # the first step slid out
    assert len(window) == 2
    assert logical_load(window.total, torch.tensor([[0, 1, 0]]), 2).tolist() == [[4, 2]]
    assert balancedness(torch.tensor([[1, 1, 2, 0]]), 2) == [1.0]
    assert balancedness(torch.tensor([[3, 1, 0, 0]]), 2) == [0.5]
    assert balancedness(torch.zeros(1, 4, dtype=torch.long), 2) == [1.0]
    window.clear()
    assert window.total.sum() == 0 and len(window) == 0
