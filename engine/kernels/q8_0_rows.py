"""One float32 row times a `q8_0` weight, its int8 blocks read as they are (engine/kernels/q8_0_rows.c),
for the products outside a compiled graph: a first start's eager steps while the graphs compile,
and `--enforce-eager`. In a graph inductor fuses the same sum (`quantized_linear.q8_0_row_times`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from engine.kernels import native


def _kernel() -> Callable[..., int] | None:
    return native.int_function("q8_0_rows", "q8_0_rows_f32", (ctypes.c_void_p,) * 4 + (ctypes.c_long,) * 4)


def row_times(row: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, threads: int) -> torch.Tensor | None:
    """`row` [1, k] times the weight (`quantize_per_block`'s int8 [n, k] and float32 scales
    [n, k / 32]), summed in float32: [1, n]. The weight's rows are split among `threads` threads
    (the calling one and threads started for the call, on its CPUs). None where the kernel does
    not apply (not one dense float32 row on CPU, a weight not so laid out) or could not be built."""
    if (row.dtype != torch.float32 or row.device.type != "cpu" or row.dim() != 2 or row.shape[0] != 1
            or qweight.dtype != torch.int8 or scales.dtype != torch.float32 or qweight.shape[1] != row.shape[1]
            or not (row.is_contiguous() and qweight.is_contiguous() and scales.is_contiguous())):
        return None
    run = _kernel()
    if run is None:
        return None
    count, features = qweight.shape
    out = torch.empty(1, count, dtype=torch.float32)
    if run(row.data_ptr(), qweight.data_ptr(), scales.data_ptr(), out.data_ptr(), 1, count, features, threads) != 0:
        return None
    return out
