"""A few float32 rows times a weight held in blocks (int8 with a scale per 32 for `q8_0`, 4-bit
steps with a scale and a low per 32 for `q4_*`), the blocks read as they are, once for all the rows:
what engine/kernels/q8_0_rows.c and q4_rows.c compute, as one Python interface for either.

Eagerly (a first start's steps while the graphs compile, `--enforce-eager`) `row_times` calls the
kernel through ctypes. In a compiled graph the same kernel is an operator (`trio_llm::q8_0_rows`,
`trio_llm::q4_rows`): an AOTInductor package calls its C shim directly, on torch's OpenMP threads
(`c_shims`, passed to inductor by engine/worker/precompiled_graph.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kernels import native
from engine.kernels.operators import Operator, operator

MAX_ROWS = 16  # the C kernels' MAX_ROWS: a batch of decodes


@dataclass(frozen=True)
class BlockRowsKernel:
    """Kernel `library` (engine/kernels/<library>.c), whose `<library>_f32` function (or `entry`)
    takes (x, weight, params, out, rows, n, k, threads), and whose weight is `weight_dtype` [n, k /
    `features_per_item`] with float32 params [n, k / 32, ...]."""

    library: str
    weight_dtype: torch.dtype
    features_per_item: int
    entry: str = ""  # the library's function and the operator's name, if not `<library>_f32` and `<library>`

    @property
    def name(self) -> str:
        """The operator's name (`trio_llm::<name>`) and its C shim's (`aoti_torch_cpu_<name>`)."""
        return self.entry or self.library

    def _function(self) -> Callable[..., int] | None:
        return native.int_function(self.library, self.entry or f"{self.library}_f32",
                                   (ctypes.c_void_p,) * 4 + (ctypes.c_long,) * 4)

    def available(self) -> bool:
        """Whether the kernel is built here (it builds on first call): a graph exported now may call its op."""
        return self._function() is not None

    def row_times(self, row: torch.Tensor, qweight: torch.Tensor, params: torch.Tensor,
                  threads: int) -> torch.Tensor | None:
        """`row` [rows, k] (1 to `MAX_ROWS` rows) times the weight, summed in float32: [rows, n].
        The weight's rows are split among `threads` threads of OpenMP's team. None where the kernel
        does not apply (not dense float32 rows on CPU, a weight not so laid out, more rows) or
        could not be built."""
        if (row.dtype != torch.float32 or row.device.type != "cpu" or row.dim() != 2
                or not 1 <= row.shape[0] <= MAX_ROWS or qweight.dtype != self.weight_dtype
                or params.dtype != torch.float32 or qweight.shape[1] * self.features_per_item != row.shape[1]
                or not (row.is_contiguous() and qweight.is_contiguous() and params.is_contiguous())):
            return None
        run = self._function()
        if run is None:
            return None
        count = qweight.shape[0]
        out = torch.empty(row.shape[0], count, dtype=torch.float32)
        if run(row.data_ptr(), qweight.data_ptr(), params.data_ptr(), out.data_ptr(), row.shape[0], count,
               row.shape[1], threads) != 0:
            return None
        return out

    def in_graph(self, rows: torch.Tensor, qweight: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """`row_times` on torch's thread count, for the kernel's operator where a graph runs outside
        a package (dynamo, tracing); a package calls the C shim."""
        out = self.row_times(rows, qweight, params, torch.get_num_threads())
        if out is None:
            raise RuntimeError(f"the {self.name} kernel does not take rows {tuple(rows.shape)} {rows.dtype} "
                               f"times {tuple(qweight.shape)} {qweight.dtype}")
        return out

    def define_operator(self) -> Operator:
        """`trio_llm::<name>`: the kernel as an operator of exported graphs, with its shapes for
        tracing. Called from Python only where a graph runs outside a package (dynamo, tracing); a
        package calls the C shim (`c_shims`)."""

        def graph_row_times(rows: torch.Tensor, qweight: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
            return self.in_graph(rows, qweight, params)

        defined = operator(f"trio_llm::{self.name}")(graph_row_times)

        @defined.register_fake
        def _shape(rows: torch.Tensor, qweight: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
            return rows.new_empty((rows.shape[0], qweight.shape[0]), dtype=torch.float32)

        return defined

    def c_shims(self) -> dict[torch._ops.OpOverload, list[str]]:
        """Inductor's `aot_inductor.custom_ops_to_c_shims` for the kernel's operator."""
        return {getattr(torch.ops.trio_llm, self.name).default: [self.c_shim()]}

    def c_shim(self) -> str:
        """The shim's declaration, as inductor writes it into a package that calls the op."""
        return (f"AOTITorchError aoti_torch_cpu_{self.name}(AtenTensorHandle rows, AtenTensorHandle qweight, "
                "AtenTensorHandle params, AtenTensorHandle* ret0)")
