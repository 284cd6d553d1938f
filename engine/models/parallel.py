"""Tensor parallelism over `torch.distributed` (gloo on CPU, NCCL on GPU).

Megatron-style sharding, decided per parameter at load time:
- column-parallel (output rows split): the q, k and v projections (by
  heads), gate and up;
- row-parallel (input columns split, outputs summed with `all_reduce`):
  the attention output projection and down;
- vocab-parallel: the embedding (each rank looks up its own vocabulary
  range, zeros elsewhere, then `all_reduce`) and the LM head (each rank's
  logits for its range, then `all_gather`).

With a size of 1 every operation is the identity, so the single-process
model runs the same code with no communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` (which must divide evenly)."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({self.size})")
        return total // self.size

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous slice of a full checkpoint tensor along `dim`."""
        if self.size == 1:
            return tensor
        part = tensor.shape[dim] // self.size
        return tensor.narrow(dim, self.rank * part, part)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def init_distributed(tp: TensorParallel, init_method: str, device: torch.device) -> None:
    """Join the process group (blocks until every rank has joined)."""
    if tp.size == 1 or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=tp.rank, world_size=tp.size)
