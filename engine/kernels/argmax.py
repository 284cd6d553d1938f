"""Each row's argmax of float32 CPU logits on our kernel (engine/kernels/argmax_rows.c): torch's
`max(dim=-1).indices` exactly (the first maximum; the first NaN where a row has one), without
torch's per-element index tracking, which does not vectorise.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from engine.kernels import native

ROWS_PER_THREAD = 16  # a thread started for fewer rows costs more than it saves (~5 us a row of 32,000)


def _kernel() -> Callable[..., int] | None:
    return native.int_function("argmax_rows", "argmax_rows_f32", (ctypes.c_void_p,) * 2 + (ctypes.c_long,) * 3)


def prepare() -> bool:
    """Build (once per machine) and load the kernel now, rather than in the first step that
    samples; whether it is there. Blocks while it builds: not on an event loop."""
    return _kernel() is not None


def argmax_rows(rows: torch.Tensor, threads: int) -> torch.Tensor | None:
    """int64 [rows] of a float32 [rows, n] CPU tensor, on up to `threads` threads (one per 16 rows);
    None where the kernel does not apply (another dtype or device) or could not be built."""
    if rows.dtype != torch.float32 or rows.device.type != "cpu" or rows.dim() != 2 or 0 in rows.shape:
        return None
    run = _kernel()
    if run is None:
        return None
    rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    threads = max(1, min(threads, rows.shape[0] // ROWS_PER_THREAD))
    if run(rows.data_ptr(), out.data_ptr(), rows.shape[0], rows.shape[1], threads) != 0:
        return None
    return out
