"""The load statistics: tokens routed to each physical expert, summed over a sliding window of
steps, and the balance of that load over the ranks."""

from __future__ import annotations

from collections import deque

import torch


class LoadWindow:
    """The last `size` steps' loads ([moe layers, physical experts] each) and their running sum."""

    def __init__(self, size: int, num_layers: int, num_physical: int) -> None:
        self._steps: deque[torch.Tensor] = deque()
        self._size = size
        self.total = torch.zeros(num_layers, num_physical, dtype=torch.long)

    def add(self, load: torch.Tensor) -> None:
        if len(self._steps) == self._size:
            self.total -= self._steps.popleft()
        self._steps.append(load)
        self.total += load

    def clear(self) -> None:
        """Forget the loads: after a rebalance they describe a placement that no longer exists."""
        self._steps.clear()
        self.total.zero_()

    def __len__(self) -> int:
        return len(self._steps)


def logical_load(physical_load: torch.Tensor, phy2log: torch.Tensor, num_logical: int) -> torch.Tensor:
    """[layers, logical]: each expert's load, summed over its replicas."""
    load = torch.zeros(physical_load.shape[0], num_logical, dtype=physical_load.dtype)
    return load.scatter_add_(1, phy2log, physical_load)


def rank_loads(physical_load: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """[layers, ranks]: the load each rank's slots carry."""
    return physical_load.view(physical_load.shape[0], num_ranks, -1).sum(-1)


def balancedness(physical_load: torch.Tensor, num_ranks: int) -> list[float]:
    """Per layer: mean over max of the load per rank (1.0: perfectly even; 1.0 too when idle)."""
    per_rank = rank_loads(physical_load, num_ranks).double()
    top = per_rank.max(-1).values
    mean = per_rank.mean(-1)
    return [1.0 if float(m) == 0 else float(a / m) for a, m in zip(mean, top, strict=True)]
