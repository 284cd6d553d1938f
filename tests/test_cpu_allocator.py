"""`lazily_zeroed`: the KV cache's zeros without writing them at start-up."""

from __future__ import annotations

import os

import torch

from engine.worker.cpu_allocator import lazily_zeroed


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_lazily_zeroed_tensor_takes_memory_only_where_written_and_reads_as_zeros():
    before = resident_bytes()
    cache = lazily_zeroed((64, 1024, 1024), torch.float32)  # 256 MiB
    assert resident_bytes() - before < 32 << 20  # torch.zeros would have written all of it
    cache[3].fill_(2.0)  # 4 MiB written
    assert cache.shape == (64, 1024, 1024) and cache.dtype == torch.float32
    assert torch.count_nonzero(cache) == 1024 * 1024 and float(cache.sum()) == 2.0 * 1024 * 1024
    assert lazily_zeroed((0, 8), torch.bfloat16).shape == (0, 8)
