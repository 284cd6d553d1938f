"""A few float32 rows times a 4-bit block weight (`q4_0`, `q4_1`, `q4_k`), its packed steps read as
they are, once for all the rows (engine/kernels/q4_rows.c; the interface is
engine/kernels/block_rows.py's). In compiled graphs: the operator `trio_llm::q4_rows`.
"""

from __future__ import annotations

import torch

from engine.kernels.block_rows import MAX_ROWS, BlockRowsKernel
from engine.kernels.operators import operator

__all__ = ["MAX_ROWS", "KERNEL", "available", "row_times", "graph_row_times", "c_shims"]

KERNEL = BlockRowsKernel("q4_rows", torch.uint8, 2)
available = KERNEL.available
row_times = KERNEL.row_times  # uint8 [n, k / 2] (two steps a byte) and float32 (scale, low) [n, k / 32, 2]


@operator("trio_llm::q4_rows")
def graph_row_times(rows: torch.Tensor, qweight: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """`row_times` as an operator of exported graphs, on torch's thread count."""
    return KERNEL.in_graph(rows, qweight, params)


@graph_row_times.register_fake
def _graph_row_times_shape(rows: torch.Tensor, qweight: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], qweight.shape[0]), dtype=torch.float32)


def c_shims() -> dict[torch._ops.OpOverload, list[str]]:
    """Inductor's `aot_inductor.custom_ops_to_c_shims` for this op."""
    return {torch.ops.trio_llm.q4_rows.default: [KERNEL.c_shim()]}
