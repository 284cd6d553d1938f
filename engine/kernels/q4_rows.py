"""A few float32 rows times a 4-bit block weight (`q4_0`, `q4_1`, `q4_k`), its packed steps read as
they are, once for all the rows (engine/kernels/q4_rows.c; the interface is
engine/kernels/block_rows.py's). In compiled graphs: the operator `trio_llm::q4_rows`.
"""

from __future__ import annotations

import torch

from engine.kernels.block_rows import MAX_ROWS, BlockRowsKernel

__all__ = ["MAX_ROWS", "KERNEL", "available", "row_times", "graph_row_times", "c_shims"]

KERNEL = BlockRowsKernel("q4_rows", torch.uint8, 2)
available = KERNEL.available
row_times = KERNEL.row_times  # uint8 [n, k / 2] (two steps a byte) and float32 (scale, low) [n, k / 32, 2]
graph_row_times = KERNEL.define_operator()
c_shims = KERNEL.c_shims
