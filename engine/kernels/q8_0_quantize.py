"""A float32 weight quantized to `q8_0` in one pass (engine/kernels/q8_0_quantize.c): what
`quantized_linear.quantize_per_block` computes with torch, bit for bit, for finite weights.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from engine.kernels import native


def _kernel() -> Callable[..., int] | None:
    return native.int_function("q8_0_quantize", "q8_0_quantize_f32", (ctypes.c_void_p,) * 3 + (ctypes.c_long,) * 3)


def quantize(weight: torch.Tensor, threads: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 [n, k], float32 scales [n, k / 32]) of a float32 [n, k] CPU weight, on `threads`
    threads; None where the kernel does not apply (another dtype or device, k not a multiple of 32)
    or could not be built."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2 or weight.shape[1] % 32:
        return None
    run = _kernel()
    if run is None:
        return None
    weight = weight.detach().contiguous()
    rows, features = weight.shape
    q = torch.empty(rows, features, dtype=torch.int8)
    scales = torch.empty(rows, features // 32, dtype=torch.float32)
    if run(weight.data_ptr(), q.data_ptr(), scales.data_ptr(), rows, features, threads) != 0:
        return None
    return q, scales
