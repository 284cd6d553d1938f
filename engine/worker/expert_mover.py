"""The worker side of a rebalance: stage one MoE layer's moving experts, then commit them.

`stage(plan)` copies the weights of every slot this rank will receive into a staging buffer
(whole, or in parts: `stage(plan, first, count)`):
from its own slots, or from the rank that holds them (send/receive over the process group,
every rank walking the plan's moves in the same order). On CUDA the copies run on a side
stream and a CUDA event marks their end. The live weights are untouched, so inference goes on
with the old placement meanwhile. `commit(plan)`, called at a step boundary (inside the step,
before the forward pass), makes the main stream wait for that event on the device, copies the
buffer into the live slots and swaps the layer's maps. The staging memory is one layer's moving
experts, freed at commit.

Blocking torch code, called by the executor one call at a time; `stage` may run in a thread
next to a forward pass (it only reads live weights; nothing else touches its buffers until the
engine has handed the staged layer over to a step).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.eplb.maps import ExpertMaps
from engine.eplb.plan import ExpertMove, LayerPlan
from engine.models.moe import ExpertLayout, FusedExperts


@dataclass
class StagedLayer:
    local_slots: torch.Tensor  # this rank's slots that change
    # their new weights (and biases), in the same order: one tensor per `FusedExperts.per_slot`
    tensors: list[torch.Tensor]
    ready: Any = None  # the CUDA event after the staging copies (None on CPU)


class ExpertMover:
    def __init__(self, layers: list[FusedExperts], layout: ExpertLayout, device: torch.device) -> None:
        self.layers = layers
        self.layout = layout
        self.rank = layout.ep_rank
        # torch leaves Stream and Event untyped
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self.staged: dict[int, StagedLayer] = {}

    def stage(self, plan: LayerPlan, first: int = 0, count: int | None = None) -> int:
        """Stage `plan.moves[first:first + count]` (all by default) into this rank's buffer for the
        layer, allocated on the first part; returns how many of this rank's slots the part fills.
        Worker processes stage a layer in parts between steps, so no step waits for a whole layer."""
        experts = self.layers[plan.layer]
        first_slot = self.layout.first_slot
        mine = plan.moves_to(self.rank)
        if first == 0:
            slots = torch.tensor([m.dst_slot - first_slot for m in mine], dtype=torch.long,
                                 device=experts.w13.device)
            self.staged[plan.layer] = StagedLayer(slots, [torch.empty((len(mine), *live.shape[1:]), dtype=live.dtype,
                                                                      device=slots.device)
                                                          for live in experts.per_slot])
        staged = self.staged[plan.layer]
        part = plan.moves[first:] if count is None else plan.moves[first:first + count]
        filled = 0
        with torch.cuda.stream(self.side_stream) if self.side_stream is not None else nullcontext():
            for move in part:
                filled += self._move(plan, experts, move, mine, staged)
            if self.side_stream is not None:
                staged.ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
                staged.ready.record(self.side_stream)
        return filled

    def _move(self, plan: LayerPlan, experts: FusedExperts, move: ExpertMove, mine: list[ExpertMove],
              staged: StagedLayer) -> int:
        """One move as this rank sees it: a local copy, a send, a receive, or nothing. Every rank
        walks the plan's moves in the same order, so each send meets its receive."""
        src, dst = plan.rank_of(move.src_slot), plan.rank_of(move.dst_slot)
        first_slot = self.layout.first_slot
        if dst == self.rank:
            i = mine.index(move)
            for new, live in zip(staged.tensors, experts.per_slot, strict=True):
                if src == self.rank:
                    new[i].copy_(live[move.src_slot - first_slot])
                else:
                    dist.recv(new[i], src)
            return 1
        if src == self.rank:
            for live in experts.per_slot:
                dist.send(live[move.src_slot - first_slot].contiguous(), dst)
        return 0

    def commit(self, plan: LayerPlan) -> None:
        """Copy the staged weights into the live slots and adopt the layer's new maps."""
        staged = self.staged.pop(plan.layer)
        experts = self.layers[plan.layer]
        if staged.ready is not None:
            torch.cuda.current_stream().wait_event(staged.ready)  # on the device: the CPU does not wait
        for live, new in zip(experts.per_slot, staged.tensors, strict=True):
            live.data.index_copy_(0, staged.local_slots, new)
        experts.set_maps(ExpertMaps.from_phy2log(torch.tensor([plan.new_phy2log]), self.layout.num_logical))

