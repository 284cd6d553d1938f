"""Keep glibc malloc from returning large tensors to the OS between steps.

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
