"""A few float32 rows times a `q8_0` weight, its int8 blocks read as they are, once for all the rows
(engine/kernels/q8_0_rows.c; the interface is engine/kernels/block_rows.py's).

Inductor's own loop for the same sum keeps one accumulator and waits on each addition's latency
(docs/benchmarks.md), so compiled graphs call this kernel as the operator `trio_llm::q8_0_rows`.
"""

from __future__ import annotations

import torch

from engine.kernels.block_rows import MAX_ROWS, BlockRowsKernel
from engine.kernels.operators import operator

__all__ = ["MAX_ROWS", "KERNEL", "available", "row_times", "graph_row_times", "c_shims"]

KERNEL = BlockRowsKernel("q8_0_rows", torch.int8, 1)
available = KERNEL.available
row_times = KERNEL.row_times  # int8 [n, k] and float32 scales [n, k / 32]


@operator("trio_llm::q8_0_rows")
def graph_row_times(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`row_times` as an operator of exported graphs, on torch's thread count."""
    return KERNEL.in_graph(rows, qweight, scales)


@graph_row_times.register_fake
def _graph_row_times_shape(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], qweight.shape[0]), dtype=torch.float32)


def c_shims() -> dict[torch._ops.OpOverload, list[str]]:
    """Inductor's `aot_inductor.custom_ops_to_c_shims` for this op."""
    return {torch.ops.trio_llm.q8_0_rows.default: [KERNEL.c_shim()]}
