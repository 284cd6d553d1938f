"""A few float32 rows times a `q8_0` weight, its int8 blocks read as they are, once for all the rows
(engine/kernels/q8_0_rows.c; the interface is engine/kernels/block_rows.py's).

Inductor's own loop for the same sum keeps one accumulator and waits on each addition's latency
(docs/benchmarks.md), so compiled graphs call this kernel as the operator `trio_llm::q8_0_rows`.

`INT8_KERNEL` (`trio_llm::q8_0_rows_int8`, `--q8-0-activations int8`) computes llama.cpp's Q8_0 x
Q8_0 products instead: each row rounded to int8 per block of 32 first, the products summed in int32,
with AVX-512 VNNI where the CPU has it (`int8_fast`), one at a time elsewhere.
"""

from __future__ import annotations

import functools

import torch

from engine.kernels import native
from engine.kernels.block_rows import MAX_ROWS, BlockRowsKernel

__all__ = ["MAX_ROWS", "KERNEL", "INT8_KERNEL", "available", "int8_fast", "row_times", "int8_row_times",
           "graph_row_times", "graph_int8_row_times", "c_shims"]

KERNEL = BlockRowsKernel("q8_0_rows", torch.int8, 1)
available = KERNEL.available
row_times = KERNEL.row_times  # int8 [n, k] and float32 scales [n, k / 32]
graph_row_times = KERNEL.define_operator()

INT8_KERNEL = BlockRowsKernel("q8_0_rows", torch.int8, 1, entry="q8_0_rows_int8")
int8_row_times = INT8_KERNEL.row_times  # the same arguments; the rows rounded to int8 per block
graph_int8_row_times = INT8_KERNEL.define_operator()


@functools.cache
def int8_fast() -> bool:
    """Whether `int8_row_times` multiplies with AVX-512 VNNI here (elsewhere it is correct but slow)."""
    library = native.load("q8_0_rows")
    return library is not None and library.q8_0_rows_int8_fast() == 1


def c_shims() -> dict[torch._ops.OpOverload, list[str]]:
    """Inductor's `aot_inductor.custom_ops_to_c_shims` for both operators."""
    return {**KERNEL.c_shims(), **INT8_KERNEL.c_shims()}
