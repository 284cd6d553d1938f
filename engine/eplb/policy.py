"""Where each expert's replicas go: the hierarchical rebalancing policy of DeepSeek's EPLB.

`rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks)` takes the load of
every logical expert per MoE layer and returns `phy2log` [layers, num_replicas]: the logical
expert each physical slot holds, slots numbered rank by rank. The algorithm:

1. pack expert groups onto nodes, balancing the load per node (groups stay whole so that
   group-limited routing keeps its traffic on one node);
2. within each node, give the spare slots one at a time to the expert with the highest load
   per replica;
3. pack the node's physical experts onto its ranks with balanced packing (heaviest first, to
   the lightest rank that still has a free slot).

When the groups do not divide by the nodes it falls back to the global policy (one group, one
node). With `old_phy2log`, experts that stay on a rank keep their slot there, so a rebalance
copies only the weights that really move. Pure functions on CPU tensors; deterministic.
"""

from __future__ import annotations

import torch


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack n weighted items per row into `num_packs` packs of n / num_packs items each.

    Returns (pack index, rank within the pack) per item, both [rows, n]."""
    rows, items = weight.shape
    if items % num_packs:
        raise ValueError(f"{items} items do not pack evenly into {num_packs} packs")
    per_pack = items // num_packs
    if per_pack == 1:
        return torch.arange(items).expand(rows, items).clone(), torch.zeros(rows, items, dtype=torch.long)
    pack_index = torch.empty(rows, items, dtype=torch.long)
    rank_in_pack = torch.empty(rows, items, dtype=torch.long)
    order = weight.float().sort(dim=-1, descending=True, stable=True).indices
    for row in range(rows):
        loads = [0.0] * num_packs
        counts = [0] * num_packs
        for item in order[row].tolist():
            pack = min((p for p in range(num_packs) if counts[p] < per_pack), key=loads.__getitem__)
            pack_index[row, item] = pack
            rank_in_pack[row, item] = counts[pack]
            loads[pack] += float(weight[row, item])
            counts[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give the `num_physical - num_logical` spare slots, one at a time, to the expert whose load
    per replica is highest. Returns (phy2log, replica index, replica count per logical)."""
    rows, num_logical = weight.shape
    phy2log = torch.arange(num_physical).repeat(rows, 1)
    replica = torch.zeros(rows, num_physical, dtype=torch.long)
    count = torch.ones(rows, num_logical, dtype=torch.long)
    every_row = torch.arange(rows)
    for slot in range(num_logical, num_physical):
        hottest = (weight / count).max(dim=-1).indices
        phy2log[:, slot] = hottest
        replica[:, slot] = count[every_row, hottest]
        count[every_row, hottest] += 1
    return phy2log, replica, count


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(perm)
    inverse.scatter_(1, perm, torch.arange(perm.size(1)).expand(perm.shape))
    return inverse


def _hierarchical(weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int,
                  num_ranks: int) -> torch.Tensor:
    layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    slots_per_rank = num_physical // num_ranks
    # 1. expert groups onto nodes
    group_load = weight.view(layers, num_groups, group_size).sum(-1)
    group_pack, group_rank = balanced_packing(group_load, num_nodes)
    log2mlog = (((group_pack * groups_per_node + group_rank) * group_size).unsqueeze(-1)
                + torch.arange(group_size)).flatten(-2)  # logical -> node-major ("meta-logical") order
    mlog2log = _inverse(log2mlog)
    # 2. replicas within each node
    node_load = weight.gather(-1, mlog2log).view(-1, num_logical // num_nodes)
    phy2mlog, _, mlog_count = replicate_experts(node_load, num_physical // num_nodes)
    # 3. physical experts onto the node's ranks
    phy_load = (node_load / mlog_count).gather(-1, phy2mlog)
    pack, rank_in_pack = balanced_packing(phy_load, num_ranks // num_nodes)
    pphy2phy = _inverse(pack * slots_per_rank + rank_in_pack)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy)
    node_offsets = torch.arange(0, num_logical, num_logical // num_nodes).view(1, -1, 1)
    pphy2mlog = (pphy2mlog.view(layers, num_nodes, -1) + node_offsets).flatten(-2)
    return mlog2log.gather(-1, pphy2mlog)


def keep_slots(new: torch.Tensor, old: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Reorder each rank's slots of `new` so that an expert the rank already held stays in the slot
    it had: the same experts per rank, fewer copies."""
    layers, num_physical = new.shape
    per_rank = num_physical // num_ranks
    result = new.clone()
    for layer in range(layers):
        for rank in range(num_ranks):
            span = slice(rank * per_rank, (rank + 1) * per_rank)
            wanted = new[layer, span].tolist()
            had = old[layer, span].tolist()
            slots: list[int | None] = [None] * per_rank
            for i, expert in enumerate(had):
                if expert in wanted:
                    wanted.remove(expert)
                    slots[i] = expert
            rest = iter(wanted)
            result[layer, span] = torch.tensor([s if s is not None else next(rest) for s in slots])
    return result


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
                      old_phy2log: torch.Tensor | None = None) -> torch.Tensor:
    """The new placement: `phy2log` [layers, num_replicas] of logical expert ids.

    `weight` [layers, num_logical]: load per logical expert (tokens routed over the window).
    `num_replicas` physical slots in all, split evenly over `num_ranks` ranks on `num_nodes` nodes;
    `num_groups` expert groups (1 for models without group-limited routing)."""
    layers, num_logical = weight.shape
    if num_replicas < num_logical:
        raise ValueError(f"{num_replicas} physical slots cannot hold {num_logical} logical experts")
    if num_replicas % num_ranks or num_ranks % num_nodes or num_logical % num_groups:
        raise ValueError(f"{num_replicas} slots, {num_ranks} ranks, {num_nodes} nodes and {num_groups} groups "
                         f"of {num_logical} experts do not divide evenly")
    weight = weight.float().cpu()
    if num_groups % num_nodes == 0:
        phy2log = _hierarchical(weight, num_replicas, num_groups, num_nodes, num_ranks)
    else:  # the global policy
        phy2log = _hierarchical(weight, num_replicas, 1, 1, num_ranks)
    if old_phy2log is not None:
        phy2log = keep_slots(phy2log, old_phy2log.cpu(), num_ranks)
    return phy2log
