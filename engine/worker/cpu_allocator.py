"""Keep glibc malloc from returning large tensors to the OS between steps; zeroed memory that
costs nothing until it is written (`lazily_zeroed`).

Measured (docs/benchmarks.md): by default glibc serves allocations above its
mmap threshold with fresh `mmap`s and unmaps them on free, so every step's
multi-megabyte activations (gathered K/V blocks, attention outputs) are page
faulted in anew; a 64-sequence decode step of the default model took 42 ms
instead of 18 ms. Raising the mmap and trim thresholds keeps that memory in
the heap for reuse. This is the in-process equivalent of the
`MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` environment variables
(vLLM's CPU backend preloads tcmalloc for the same reason).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit
_TRIM_THRESHOLD = 1 << 30

_done = False


def keep_freed_memory_in_heap() -> bool:
    """Raise glibc's thresholds once per process; returns False where glibc is not available."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1)
    logger.debug("glibc malloc thresholds raised: %s", ok)
    _done = ok
    return ok


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros over an anonymous mapping of its own: the kernel hands out zeroed
    pages as they are first written, so nothing is written now. For the KV cache: `torch.zeros`
    wrote all of it at start-up (1 GB, 0.4 s of the 0.5B shape's warm start), and blocks no
    request ever reaches cost no memory. The mapping lives as long as the tensor (it holds it)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
