"""The expert maps derived from a placement (`phy2log`), and the placement a model starts with."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def initial_phy2log(num_layers: int, num_logical: int, num_physical: int) -> torch.Tensor:
    """Before any load is known: expert i in slot i, then the spare slots round-robin (as vLLM)."""
    return (torch.arange(num_physical) % num_logical).repeat(num_layers, 1)


def max_replicas(num_logical: int, num_physical: int) -> int:
    """The most replicas one expert can have: every spare slot."""
    return num_physical - num_logical + 1


def logical_replica_count(phy2log: torch.Tensor, num_logical: int) -> torch.Tensor:
    """[layers, logical]: how many physical slots hold each logical expert."""
    count = torch.zeros(phy2log.shape[0], num_logical, dtype=torch.long)
    return count.scatter_add_(1, phy2log, torch.ones_like(phy2log))


def logical_to_physical_map(phy2log: torch.Tensor, num_logical: int) -> torch.Tensor:
    """[layers, logical, max_replicas]: each expert's slots in slot order, padded with -1."""
    layers, num_physical = phy2log.shape
    result = torch.full((layers, num_logical, max_replicas(num_logical, num_physical)), -1, dtype=torch.long)
    for layer in range(layers):
        filled = [0] * num_logical
        for slot, expert in enumerate(phy2log[layer].tolist()):
            result[layer, expert, filled[expert]] = slot
            filled[expert] += 1
    return result


@dataclass(frozen=True)
class ExpertMaps:
    """One placement in the three forms routing and rebalancing use (all CPU tensors)."""

    phy2log: torch.Tensor  # [layers, physical]
    log2phy: torch.Tensor  # [layers, logical, max_replicas], -1 padded
    replica_count: torch.Tensor  # [layers, logical]

    @classmethod
    def from_phy2log(cls, phy2log: torch.Tensor, num_logical: int) -> ExpertMaps:
        if int(phy2log.min()) < 0 or int(phy2log.max()) >= num_logical:
            raise ValueError(f"phy2log names experts outside 0..{num_logical - 1}")
        count = logical_replica_count(phy2log, num_logical)
        if int(count.min()) < 1:
            raise ValueError("every logical expert needs at least one physical slot")
        return cls(phy2log.clone(), logical_to_physical_map(phy2log, num_logical), count)

    def layer(self, index: int) -> ExpertMaps:
        """This placement's row for one MoE layer (each tensor keeps a leading dimension of 1)."""
        span = slice(index, index + 1)
        return ExpertMaps(self.phy2log[span], self.log2phy[span], self.replica_count[span])
