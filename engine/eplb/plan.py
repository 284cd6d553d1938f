"""What one MoE layer's rebalance moves: for every slot whose expert changes, where its weights
come from. Computed identically by the engine and every rank, so all ranks walk the same
transfers in the same order (a pairwise send/receive never waits on a rank doing something else)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertMove:
    dst_slot: int  # physical slot that will hold the expert
    src_slot: int  # a slot that holds it now (on the destination's own rank when one does)


@dataclass(frozen=True)
class LayerPlan:
    """One layer's transfer: the new placement row and the moves that realise it."""

    layer: int  # index among the model's MoE layers
    new_phy2log: tuple[int, ...]
    moves: tuple[ExpertMove, ...]
    slots_per_rank: int

    def rank_of(self, slot: int) -> int:
        return slot // self.slots_per_rank

    def moves_to(self, rank: int) -> list[ExpertMove]:
        return [m for m in self.moves if self.rank_of(m.dst_slot) == rank]

    @property
    def num_cross_rank(self) -> int:
        return sum(self.rank_of(m.src_slot) != self.rank_of(m.dst_slot) for m in self.moves)


def plan_layer(layer: int, old_row: list[int], new_row: list[int], num_ranks: int) -> LayerPlan:
    """The moves that turn `old_row` into `new_row` (both physical slot -> logical expert)."""
    if len(old_row) != len(new_row) or len(new_row) % num_ranks:
        raise ValueError("old and new placements must have the same number of slots, split evenly over ranks")
    per_rank = len(new_row) // num_ranks
    holders: dict[int, list[int]] = {}
    for slot, expert in enumerate(old_row):
        holders.setdefault(expert, []).append(slot)
    moves = []
    for dst, expert in enumerate(new_row):
        if old_row[dst] == expert:
            continue
        sources = holders.get(expert)
        if not sources:
            raise ValueError(f"expert {expert} has no slot in the old placement of layer {layer}")
        same_rank = [s for s in sources if s // per_rank == dst // per_rank]
        moves.append(ExpertMove(dst, (same_rank or sources)[0]))
    return LayerPlan(layer, tuple(new_row), tuple(moves), per_rank)
