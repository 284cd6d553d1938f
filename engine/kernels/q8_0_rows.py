"""A few float32 rows times a `q8_0` weight, its int8 blocks read as they are, once for all the rows
(engine/kernels/q8_0_rows.c; the interface is engine/kernels/block_rows.py's).

Inductor's own loop for the same sum keeps one accumulator and waits on each addition's latency
(docs/benchmarks.md), so compiled graphs call this kernel as the operator `trio_llm::q8_0_rows`.

`INT8_KERNEL` (`trio_llm::q8_0_rows_int8`, `--q8-0-activations int8`) computes llama.cpp's Q8_0 x
Q8_0 products instead: each row rounded to int8 per block of 32 first, the products summed in int32,
with AVX-512 VNNI where the CPU has it (`int8_fast`), one at a time elsewhere. `TWO_LEVELS` rounds
each row to int8 twice (the remainders in 254ths of a step: ~16 bits a value), and `AUTO_KERNEL`
(`trio_llm::q8_0_rows_auto`, `--q8-0-activations auto`, the default) runs it for a batch of 10 or
more rows through a weight of at most 512 features, float32 rows otherwise (q8_0_rows.c
`q8_0_rows_auto` says why).
"""

from __future__ import annotations

import functools

import torch

from engine.kernels import native
from engine.kernels.block_rows import MAX_ROWS, BlockRowsKernel

__all__ = ["MAX_ROWS", "KERNEL", "INT8_KERNEL", "AUTO_KERNEL", "TWO_LEVELS", "TWO_LEVELS_FROM_ROWS",
           "TWO_LEVELS_UP_TO_K", "available", "int8_fast", "row_times", "int8_row_times", "auto_row_times",
           "graph_row_times", "graph_int8_row_times", "graph_auto_row_times", "c_shims"]

KERNEL = BlockRowsKernel("q8_0_rows", torch.int8, 1)
available = KERNEL.available
row_times = KERNEL.row_times  # int8 [n, k] and float32 scales [n, k / 32]
graph_row_times = KERNEL.define_operator()

INT8_KERNEL = BlockRowsKernel("q8_0_rows", torch.int8, 1, entry="q8_0_rows_int8")
int8_row_times = INT8_KERNEL.row_times  # the same arguments; the rows rounded to int8 per block
graph_int8_row_times = INT8_KERNEL.define_operator()

AUTO_KERNEL = BlockRowsKernel("q8_0_rows", torch.int8, 1, entry="q8_0_rows_auto")
auto_row_times = AUTO_KERNEL.row_times  # float32 rows, or two int8 levels for many rows through short ones
graph_auto_row_times = AUTO_KERNEL.define_operator()

TWO_LEVELS_FROM_ROWS, TWO_LEVELS_UP_TO_K = 10, 512  # q8_0_rows.c's: where AUTO_KERNEL takes two levels
TWO_LEVELS = BlockRowsKernel("q8_0_rows", torch.int8, 1, entry="q8_0_rows_int8x2")  # eager only (tests)


@functools.cache
def int8_fast() -> bool:
    """Whether `int8_row_times` multiplies with AVX-512 VNNI here (elsewhere it is correct but slow)."""
    library = native.load("q8_0_rows")
    return library is not None and library.q8_0_rows_int8_fast() == 1


def c_shims() -> dict[torch._ops.OpOverload, list[str]]:
    """Inductor's `aot_inductor.custom_ops_to_c_shims` for the three operators."""
    return {**KERNEL.c_shims(), **INT8_KERNEL.c_shims(), **AUTO_KERNEL.c_shims()}
