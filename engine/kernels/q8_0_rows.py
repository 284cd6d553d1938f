"""A few float32 rows times a `q8_0` weight, its int8 blocks read as they are, once for all the rows
(engine/kernels/q8_0_rows.c; the interface is engine/kernels/block_rows.py's).

Inductor's own loop for the same sum keeps one accumulator and waits on each addition's latency
(docs/benchmarks.md), so compiled graphs call this kernel as the operator `trio_llm::q8_0_rows`.
"""

from __future__ import annotations

import torch

from engine.kernels.block_rows import MAX_ROWS, BlockRowsKernel

__all__ = ["MAX_ROWS", "KERNEL", "available", "row_times", "graph_row_times", "c_shims"]

KERNEL = BlockRowsKernel("q8_0_rows", torch.int8, 1)
available = KERNEL.available
row_times = KERNEL.row_times  # int8 [n, k] and float32 scales [n, k / 32]
graph_row_times = KERNEL.define_operator()
c_shims = KERNEL.c_shims
