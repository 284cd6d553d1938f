"""A few float32 rows times a `q8_0` weight, its int8 blocks read as they are, once for all the rows
(engine/kernels/q8_0_rows.c; the interface is engine/kernels/block_rows.py's).

Inductor's own loop for the same sum keeps one accumulator and waits on each addition's latency
(docs/benchmarks.md), so compiled graphs call this kernel as the operator `trio_llm::q8_0_rows`.

`INT8_KERNEL` (`trio_llm::q8_0_rows_int8`, `--q8-0-activations int8`) computes llama.cpp's Q8_0 x
Q8_0 products instead: each row rounded to int8 per block of 32 first, the products summed in int32,
with AVX-512 VNNI where the CPU has it (`int8_fast`), one at a time elsewhere. `TWO_LEVELS` rounds
each row to int8 twice (the remainders in 254ths of a step: ~16 bits a value), and `AUTO_KERNEL`
(`trio_llm::q8_0_rows_auto`, `--q8-0-activations auto`, the default) runs it for a batch of 10 or
more rows through a weight of at most 512 features, float32 rows otherwise; a weight whose tiles
are laid out for it (`pack_tiles`, any width; `trio_llm::q8_0_rows_packed`) takes it at every row
count (q8_0_rows.c `q8_0_rows_auto` and `q8_0_rows_auto_packed` say why).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from engine.kernels import native
from engine.kernels.block_rows import MAX_ROWS, BlockRowsKernel
from engine.kernels.operators import operator

__all__ = ["MAX_ROWS", "INT8_MAX_ROWS", "KERNEL", "INT8_KERNEL", "AUTO_KERNEL", "TWO_LEVELS", "TWO_LEVELS_FROM_ROWS",
           "TWO_LEVELS_UP_TO_K", "available", "int8_fast", "row_times", "int8_row_times", "auto_row_times",
           "graph_row_times", "graph_int8_row_times", "graph_auto_row_times", "pack_tiles", "packed_row_times",
           "graph_packed_row_times", "c_shims"]

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
# q8_0_rows.c's INT8_MAX_ROWS: rows a weight with tiles takes (`packed_row_times`), MAX_ROWS at a time.
# Past 16 rows the weight is read once per 16; up to 1,024 rows that measured faster than the
# dequantized matmul (bfloat16 on a CPU that multiplies it natively, eagerly), and the rows keep two
# int8 levels where that matmul rounds them to 8 bits (docs/benchmarks.md, "Tiles at every width").
INT8_MAX_ROWS = 1024
TWO_LEVELS = BlockRowsKernel("q8_0_rows", torch.int8, 1, entry="q8_0_rows_int8x2")  # eager only (tests)


@functools.cache
def int8_fast() -> bool:
    """Whether `int8_row_times` multiplies with AVX-512 VNNI here (elsewhere it is correct but slow)."""
    library = native.load("q8_0_rows")
    return library is not None and library.q8_0_rows_int8_fast() == 1


PACKED_BLOCK_BYTES = 8 * 64 + 16 * 4  # q8_0_rows.c's: a tile of 16 weight rows' block, and its scales


def pack_tiles(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """The weight's whole tiles of 16 rows laid out once as the two int8 levels read them (each
    block's bytes transposed to VNNI's lanes, 128 added, the 16 scales beside: q8_0_rows.c
    `q8_0_pack_tiles`), so that `packed_row_times` need not at every call. An int8 tensor as large
    as the weight and its scales; None where it would not be read (no AVX-512 VNNI, no kernel,
    fewer than 16 rows)."""
    n, k = qweight.shape
    if (not int8_fast() or n < 16 or qweight.dtype != torch.int8
            or scales.dtype != torch.float32 or not (qweight.is_contiguous() and scales.is_contiguous())):
        return None
    pack = native.int_function("q8_0_rows", "q8_0_pack_tiles", (ctypes.c_void_p,) * 2 + (ctypes.c_long,) * 2 +
                               (ctypes.c_void_p,))
    if pack is None:
        return None
    packed = torch.empty(n // 16 * (k // 32) * PACKED_BLOCK_BYTES, dtype=torch.int8)
    if pack(qweight.data_ptr(), scales.data_ptr(), n, k, packed.data_ptr()) != 0:
        return None
    return packed


def packed_row_times(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, packed: torch.Tensor,
                     threads: int) -> torch.Tensor | None:
    """Auto's product for a weight whose tiles are laid out in `packed` (`pack_tiles`): two int8
    levels at every row count (the tiles make them faster than float32 rows even at one; the same
    sums as `TWO_LEVELS`). None where the kernel does not apply (as `row_times`)."""
    function = native.int_function("q8_0_rows", "q8_0_rows_auto_packed", (ctypes.c_void_p,) * 5 + (ctypes.c_long,) * 4)
    if (function is None or rows.dtype != torch.float32 or rows.dim() != 2 or not 1 <= rows.shape[0] <= INT8_MAX_ROWS
            or rows.shape[1] != qweight.shape[1] or not rows.is_contiguous()):
        return None
    out = torch.empty(rows.shape[0], qweight.shape[0], dtype=torch.float32)
    if function(rows.data_ptr(), qweight.data_ptr(), scales.data_ptr(), packed.data_ptr(), out.data_ptr(),
                rows.shape[0], qweight.shape[0], rows.shape[1], threads) != 0:
        return None
    return out


def lend_cpus(cpus: Sequence[int]) -> bool:
    """Start a helper thread on `cpus` (the CPU the served layout lends the compute steps) that
    takes chunks of one-thread products through a large weight's tiles (an LM head) whenever it
    gets to run there, the calling thread waiting only for chunks it has started (lent_cpu.h).
    Once per process; whether the helper runs."""
    start = native.int_function("q8_0_rows", "q8_0_lend_cpus", (ctypes.c_void_p, ctypes.c_long))
    if start is None or not cpus:
        return False
    listed = (ctypes.c_int * len(cpus))(*cpus)
    return start(ctypes.addressof(listed), len(cpus)) == 0


def lent_chunks(n: int, k: int, rows: int) -> int | None:
    """How many chunks the helper `lend_cpus` started shares a one-thread int8 product of `rows`
    input rows through an `n` x `k` weight in (q8_0_rows.c `q8_0_lent_chunks`): 1 where the call
    runs alone. Past 16 rows (prompts) chunks hold less weight, so narrow layers are shared too.
    None where the kernel cannot be built here."""
    library = native.load("q8_0_rows")
    if library is None:
        return None
    count = library.q8_0_lent_chunks
    count.argtypes, count.restype = (ctypes.c_long,) * 3, ctypes.c_long
    chunks: int = count(n, k, rows)
    return chunks


def lent_share_address() -> int | None:
    """The address of `q8_0_lent_share` (q8_0_rows.c): another kernel's one-thread calls hand their
    work items to it to share them with the helper `lend_cpus` started (paged_decode.c). None
    where the kernel cannot be built here."""
    library = native.load("q8_0_rows")
    if library is None:
        return None
    address: int | None = ctypes.cast(library.q8_0_lent_share, ctypes.c_void_p).value
    return address


@operator("trio_llm::q8_0_rows_packed")
def graph_packed_row_times(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                           packed: torch.Tensor) -> torch.Tensor:
    """`packed_row_times` as an operator of exported graphs (called from Python only where a graph
    runs outside a package; a package calls its C shim, `aoti_torch_cpu_q8_0_rows_packed`)."""
    out = packed_row_times(rows, qweight, scales, packed, torch.get_num_threads())
    if out is None:
        raise RuntimeError(f"the packed q8_0 kernel does not take rows {tuple(rows.shape)} {rows.dtype}")
    return out


@graph_packed_row_times.register_fake
def _packed_shape(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                  packed: torch.Tensor) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], qweight.shape[0]), dtype=torch.float32)


def c_shims() -> dict[torch._ops.OpOverload, list[str]]:
    """Inductor's `aot_inductor.custom_ops_to_c_shims` for the four operators."""
    packed = ["AOTITorchError aoti_torch_cpu_q8_0_rows_packed(AtenTensorHandle rows, AtenTensorHandle qweight, "
              "AtenTensorHandle params, AtenTensorHandle packed, AtenTensorHandle* ret0)"]
    return {**KERNEL.c_shims(), **INT8_KERNEL.c_shims(), **AUTO_KERNEL.c_shims(),
            graph_packed_row_times.overload: packed}
