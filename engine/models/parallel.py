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

Pipeline parallelism (`PipelineStage`) splits the layers into consecutive
stages; a stage's ranks form their own tensor-parallel group, and a step's
hidden states go from each stage's rank to the next stage's rank of the same
tensor-parallel rank (`send_to_next_stage` / `receive_from_previous_stage`).
Global rank = stage * tensor_parallel_size + tensor-parallel rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the stage's process group under pipeline parallelism (None: the whole world)

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
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class PipelineStage:
    """Which consecutive layers this rank's stage holds, and its neighbours' global ranks."""

    rank: int = 0
    size: int = 1
    tp_size: int = 1  # ranks per stage
    partition: tuple[int, ...] | None = None  # layers per stage, when not an even split

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layer_range(self, num_layers: int, partition: Sequence[int] | None = None) -> range:
        """This stage's layers: `partition[i]` layers on stage i when given (vLLM's
        VLLM_PP_LAYER_PARTITION), else an even split, the first stages taking one more when it
        does not divide (so stage 0, whose KV cache the engine sizes by, holds the most)."""
        if num_layers < self.size:
            raise ValueError(f"pipeline_parallel_size ({self.size}) is larger than the model's {num_layers} layers")
        if partition is not None:
            if len(partition) != self.size or sum(partition) != num_layers or min(partition) < 1:
                raise ValueError(f"a layer partition must give each of the {self.size} stages at least one layer "
                                 f"and {num_layers} in all, got {list(partition)}")
            start = sum(partition[:self.rank])
            return range(start, start + partition[self.rank])
        base, extra = divmod(num_layers, self.size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (1 if self.rank < extra else 0))

    def send_to_next_stage(self, hidden: torch.Tensor, tp_rank: int) -> None:
        dist.send(hidden.contiguous(), (self.rank + 1) * self.tp_size + tp_rank)

    def receive_from_previous_stage(self, rows: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                                    tp_rank: int) -> torch.Tensor:
        hidden = torch.empty(rows, hidden_size, dtype=dtype, device=device)
        dist.recv(hidden, (self.rank - 1) * self.tp_size + tp_rank)
        return hidden


def init_distributed(tp: TensorParallel, init_method: str, device: torch.device,
                     stage: PipelineStage = PipelineStage()) -> TensorParallel:
    """Join the process group of every rank (blocks until all have joined); with pipeline stages
    of more than one rank, make each stage's group (every rank makes all of them, in order) and
    return `tp` with this stage's."""
    world = tp.size * stage.size
    if world == 1:
        return tp
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=stage.rank * tp.size + tp.rank,
                                world_size=world)
    if stage.size == 1 or tp.size == 1:
        return tp
    groups = [dist.new_group(list(range(s * tp.size, (s + 1) * tp.size))) for s in range(stage.size)]
    return TensorParallel(tp.rank, tp.size, groups[stage.rank])
