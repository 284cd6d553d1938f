"""The building blocks the decoders share: uninitialised linear layers (plain, row-parallel; their
weights packed for oneDNN once loaded), the vocab-parallel embedding, RMSNorm and the SwiGLU MLP."""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.packed_linear import pack_weight, packed_linear
from engine.models.parallel import TensorParallel
from engine.models.quantized_linear import QUANTIZED_MATMULS, can_quantize, quantize_weight


class OutputDelta(Protocol):
    """What a layer's LoRA adapters add to its output (engine/lora/serving.py's `LinearLoRA`)."""

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


class Linear(nn.Module):
    """y = x W^T + b with uninitialised parameters: every weight comes from the checkpoint.

    nn.Linear/nn.Embedding would random-initialise first: wasted work at load, and
    their init functions import torch._dynamo (measured: half of server start-up)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        # The weight in oneDNN's layout once `pack` ran (engine/models/packed_linear.py). A plain
        # attribute, not a buffer: the compiled decode graph takes it as an input.
        self.packed: torch.Tensor | None = None
        # Beside `packed`, the weight as [in, out] rows (`transpose_for_one_row`): for one row on one
        # compute thread, MKL's product over it beats oneDNN's over the packed weight.
        self.row_weight: torch.Tensor | None = None
        # The LoRA adapters that change this layer's output, when the engine serves any
        # (engine/lora/serving.py): their delta is added for the rows of each adapter's requests.
        self.lora: OutputDelta | None = None
        # Once `quantize` ran (engine/models/quantized_linear.py): the quantized rows and their scales.
        self.qweight: torch.Tensor | None
        self.qscales: torch.Tensor | None
        self.register_buffer("qweight", None)
        self.register_buffer("qscales", None)
        self.qmethod: str | None = None  # "int8", "w8a8" or "int4" once quantized

    def quantize(self, method: str = "int8", keep_weight: bool = False) -> bool:
        """Store the weight quantized as `method` ("int8" weight-only, "w8a8" with activations
        quantized per row too, "int4"; engine/models/quantized_linear.py) where its kernel takes the
        weight's shape; returns whether it did. As with `pack`, the float weight is then dropped
        unless `keep_weight` (a tied LM head: the embedding still reads it)."""
        if not can_quantize(self.weight, method):
            return False
        self.qmethod = method
        self.qweight, self.qscales = quantize_weight(self.weight, method)
        if not keep_weight:
            self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)
        return True

    def pack(self, keep_weight: bool = False) -> bool:
        """Lay the weight out for oneDNN, where that applies (`packed_linear.can_pack`); returns
        whether it did. The stored weight is then dropped (a meta tensor keeps its shape) unless
        `keep_weight` (a tied LM head: the embedding still reads it). Call once the weights are
        final: loading into a packed layer is an error."""
        packed = None if self.qweight is not None else pack_weight(self.weight)
        if packed is None:
            return False
        self.packed = packed
        if not keep_weight:
            self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)
        return True

    def transpose_for_one_row(self) -> torch.Tensor | None:
        """Keep the (packed, float32) weight as [in, out] rows too, for one row on one compute thread,
        and return them; None where that does not apply. The caller owns the memory question: a
        tied LM head trades its [out, in] copy for these rows (`DecoderForCausalLM.hold_tied_table_as_rows`).

        Why: one row times a weight is a read of the weight, and on one thread oneDNN's kernel over
        the packed layout reads it at ~14 GB/s where MKL's product of the row with [in, out] rows
        reads ~24 (docs/benchmarks.md, "One compute thread: the LM head at one row, ..."): 2.3 against 1.4 ms for a
        [32000, 256] head, 31 against 24 ms for [151936, 896]. On two threads, at more rows, and in
        bfloat16 the packed weight is as fast or faster, so it stays for those."""
        if self.packed is None or self.weight.device.type == "meta" or self.weight.dtype != torch.float32:
            return None
        self.row_weight = self.weight.detach().t().contiguous()
        return self.row_weight

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.qweight is not None:
            assert self.qmethod is not None and self.qscales is not None
            y = QUANTIZED_MATMULS[self.qmethod](x, self.qweight, self.qscales, bias)
        elif self.row_weight is not None and x.dim() == 2 and x.shape[0] == 1 and torch.get_num_threads() == 1:
            y = torch.mm(x, self.row_weight) if bias is None else torch.addmm(bias, x, self.row_weight)
        elif self.packed is not None:
            y = packed_linear(x, self.packed, bias)
        else:
            y = F.linear(x, self.weight, bias)
        return y if self.lora is None else self.lora.add_delta(x, y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class RowParallelLinear(Linear):
    """A Linear whose input features are split across ranks: partial sums are all-reduced,
    then the (unsplit) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, reduce: bool = True,
                 **factory: Any) -> None:
        super().__init__(in_features, out_features, bias, **factory)
        self.tp = tp
        self.reduce = reduce  # False: leave the partial sum for the caller's one all-reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, None)
        if self.reduce:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows [start, start + n) of the table; ids elsewhere read zeros, and the
    all-reduce adds the one rank that holds each id."""

    def __init__(self, num_embeddings: int, dim: int, tp: TensorParallel, **factory: Any) -> None:
        super().__init__()
        rows = tp.split(num_embeddings, "vocab_size")
        self.start, self.tp = tp.rank * rows, tp
        self.weight = nn.Parameter(torch.empty(rows, dim, **factory))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DenseMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul. `reduce=False`
    leaves this rank's partial sum (a shared expert inside an MoE block, reduced with it)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, tp: TensorParallel, reduce: bool = True,
                 **factory: Any) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias, **factory)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, tp=tp, reduce=reduce, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
