"""A few float32 rows times a `q8_0` weight, its int8 blocks read as they are, once for all the rows
(engine/kernels/q8_0_rows.c).

Eagerly (a first start's steps while the graphs compile, `--enforce-eager`) `row_times` calls the
kernel through ctypes. In a compiled graph the same kernel is the operator `trio_llm::q8_0_rows`:
an AOTInductor package calls its C shim (`aoti_torch_cpu_q8_0_rows`) directly, on torch's OpenMP
threads (`c_shims`, passed to inductor by engine/worker/precompiled_graph.py). Inductor's own loop
for the same sum keeps one accumulator and waits on each addition's latency (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from engine.kernels import native
from engine.kernels.operators import operator

MAX_ROWS = 16  # the C kernel's MAX_ROWS: a batch of decodes
# The shim's declaration, as inductor writes it into a package that calls the op.
C_SHIM = ("AOTITorchError aoti_torch_cpu_q8_0_rows(AtenTensorHandle rows, AtenTensorHandle qweight, "
          "AtenTensorHandle scales, AtenTensorHandle* ret0)")


def _kernel() -> Callable[..., int] | None:
    return native.int_function("q8_0_rows", "q8_0_rows_f32", (ctypes.c_void_p,) * 4 + (ctypes.c_long,) * 4)


def available() -> bool:
    """Whether the kernel is built here (it builds on first call): a graph exported now may call the op."""
    return _kernel() is not None


def row_times(row: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, threads: int) -> torch.Tensor | None:
    """`row` [rows, k] (1 to `MAX_ROWS` rows) times the weight (`quantize_per_block`'s int8 [n, k]
    and float32 scales [n, k / 32]), summed in float32: [rows, n]. The weight's rows are split
    among `threads` threads of OpenMP's team. None where the kernel does not apply (not dense
    float32 rows on CPU, a weight not so laid out, more rows) or could not be built."""
    if (row.dtype != torch.float32 or row.device.type != "cpu" or row.dim() != 2 or not 1 <= row.shape[0] <= MAX_ROWS
            or qweight.dtype != torch.int8 or scales.dtype != torch.float32 or qweight.shape[1] != row.shape[1]
            or not (row.is_contiguous() and qweight.is_contiguous() and scales.is_contiguous())):
        return None
    run = _kernel()
    if run is None:
        return None
    count, features = qweight.shape
    out = torch.empty(row.shape[0], count, dtype=torch.float32)
    if run(row.data_ptr(), qweight.data_ptr(), scales.data_ptr(), out.data_ptr(), row.shape[0], count, features,
           threads) != 0:
        return None
    return out


@operator("trio_llm::q8_0_rows")
def graph_row_times(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`row_times` as an operator of exported graphs, on torch's thread count. Called from Python
    only where a graph runs outside a package (dynamo, tracing); a package calls the C shim."""
    out = row_times(rows, qweight, scales, torch.get_num_threads())
    if out is None:
        raise RuntimeError(f"the q8_0 kernel does not take rows {tuple(rows.shape)} {rows.dtype} "
                           f"times {tuple(qweight.shape)}")
    return out


@graph_row_times.register_fake
def _graph_row_times_shape(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], qweight.shape[0]), dtype=torch.float32)


def c_shims() -> dict[torch._ops.OpOverload, list[str]]:
    """Inductor's `aot_inductor.custom_ops_to_c_shims` for this op."""
    return {torch.ops.trio_llm.q8_0_rows.default: [C_SHIM]}
