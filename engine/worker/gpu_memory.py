"""`--gpu-memory-utilization`: how much of a GPU the KV cache takes, with vLLM's meaning.

The engine may use `utilization` x the card's memory. From that come, measured at start-up by a
profile run before the cache exists: the weights, the peak of a forward pass at the largest step
the scheduler sends (activations, freed after each step), the captured decode graphs' memory
pool (kept for good), and what is used on the card outside torch's allocator (the CUDA context,
NCCL's buffers; and other processes', as vLLM counts them). What is left is the KV cache. An
explicit `--kv-cache-memory-bytes` is used as given instead.

The arithmetic is `kv_cache_budget`, plain and tested on CPU; the numbers come from a
`MemoryProbe`: `CudaMemory` reads torch's CUDA allocator and the driver.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.errors import ModelLoadError

GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryProfile:
    """One rank's card, in bytes, as the profile run found it."""

    total: int  # the card's memory
    weights: int  # held by torch after loading the model
    activations: int  # a full step's peak above the weights (freed after each step)
    graphs: int  # the captured decode graphs' pool (the largest graph's peak above the weights)
    other: int  # used on the card outside torch's allocator

    def describe(self) -> str:
        return (f"weights {self.weights / GIB:.2f} GiB, activations {self.activations / GIB:.2f} GiB, "
                f"CUDA graphs {self.graphs / GIB:.2f} GiB, outside torch {self.other / GIB:.2f} GiB")


def kv_cache_budget(profile: MemoryProfile, utilization: float) -> int:
    """Bytes left for the KV cache when the engine may use `utilization` of the card; a one-line
    `ModelLoadError` with the numbers when nothing is left."""
    allowed = int(profile.total * utilization)
    left = allowed - profile.weights - profile.activations - profile.graphs - profile.other
    if left <= 0:
        raise ModelLoadError(
            f"no GPU memory left for the KV cache: --gpu-memory-utilization {utilization} allows "
            f"{allowed / GIB:.2f} of {profile.total / GIB:.2f} GiB, and the engine needs {profile.describe()}; "
            "raise --gpu-memory-utilization, or lower --max-num-batched-tokens or --max-num-seqs")
    return left


class MemoryProbe(Protocol):
    def card(self) -> tuple[int, int]:
        """(free, total) bytes on the card, as the driver reports them."""

    def reserved(self) -> int:
        """Bytes torch's allocator holds on the card."""

    def allocated(self) -> int:
        """Bytes in torch's live tensors."""

    def peak_while(self, run: Callable[[], object]) -> int:
        """The most bytes live tensors held while `run` ran (its outputs freed after)."""


class CudaMemory:
    """`MemoryProbe` over torch's CUDA allocator and `cudaMemGetInfo`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def card(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak_while(self, run: Callable[[], object]) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        run()
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))


def measure(probe: MemoryProbe, step: Callable[[], object], decode: Callable[[], object] | None) -> MemoryProfile:
    """Profile a rank whose weights are loaded: `step` is a forward pass at the largest step,
    `decode` one at the largest captured decode graph (None: no graphs)."""
    weights = probe.allocated()
    activations = probe.peak_while(step) - weights
    graphs = probe.peak_while(decode) - weights if decode is not None else 0
    free, total = probe.card()
    other = max(0, total - free - probe.reserved())
    return MemoryProfile(total, weights, max(0, activations), max(0, graphs), other)
