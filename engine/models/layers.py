"""The building blocks the decoders share: uninitialised linear layers (plain, row-parallel; their
weights packed for oneDNN once loaded), the vocab-parallel embedding, RMSNorm and the SwiGLU MLP."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import q8_0_rows
from engine.models.packed_linear import pack_weight, packed_linear
from engine.models.parallel import TensorParallel
from engine.models.quantized_linear import (
    QUANTIZED_MATMULS,
    can_quantize,
    empty_block_storage,
    q8_0_linear,
    quantize_weight,
)


class OutputDelta(Protocol):
    """What a layer's LoRA adapters add to its output (engine/lora/serving.py's `LinearLoRA`)."""

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


class LinearMethod(Protocol):
    """How a `Linear` computes x W^T + b from what it holds: chosen once, when the weights become
    final (`Linear.pack`, `Linear.quantize`), never per call by an if-chain. A method holds no
    tensors: they stay on the layer (parameters and buffers, so `.to()` moves them and a compiled
    graph sees them), and the method says which it reads."""

    @property
    def name(self) -> str:
        """What it is, for logs and tests: "unquantized", "packed", or a quantization method's name."""

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's product of `x` (without LoRA deltas: `WithLoRA` adds those)."""


class Unquantized:
    """The float weight as loaded, through torch's own kernel (any device)."""

    name = "unquantized"

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class Packed:
    """The weight in oneDNN's layout (`layer.packed`, engine/models/packed_linear.py); one row on
    one compute thread reads `layer.row_weight` instead where the layer keeps it (faster there:
    `Linear.transpose_for_one_row`)."""

    name = "packed"

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = layer.row_weight
        if rows is not None and x.dim() == 2 and x.shape[0] == 1 and torch.get_num_threads() == 1:
            return torch.mm(x, rows) if bias is None else torch.addmm(bias, x, rows)
        assert layer.packed is not None
        return packed_linear(x, layer.packed, bias)


@dataclass(frozen=True)
class Quantized:
    """Quantized rows and their scales (`layer.qweight`, `layer.qscales`), multiplied by the
    method's kernel: "int8" weight-only, "w8a8" with activations quantized per row, "int4", "q8_0"
    or "q4_0", "q4_1", "q4_k" (engine/models/quantized_linear.py `QUANTIZED_MATMULS`)."""

    name: str
    # q8_0 only (`--q8-0-activations`): how a batch of decodes' rows meet the weight, "auto" (float32
    # rows, or two int8 levels for many rows through short ones), "float32" or "int8" (llama.cpp's
    # arithmetic; `quantized_linear.q8_0_linear`).
    activations: str = "auto"

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert layer.qweight is not None and layer.qscales is not None
        if self.name == "q8_0":
            return q8_0_linear(x, layer.qweight, layer.qscales, bias, self.activations, layer.qtiles)
        return QUANTIZED_MATMULS[self.name](x, layer.qweight, layer.qscales, bias)


@dataclass(frozen=True)
class WithLoRA:
    """Any method, with the output delta of the layer's LoRA adapters added (engine/lora)."""

    inner: LinearMethod
    delta: OutputDelta

    @property
    def name(self) -> str:
        return self.inner.name

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.delta.add_delta(x, self.inner.apply(layer, x, bias))


UNQUANTIZED, PACKED = Unquantized(), Packed()


class Linear(nn.Module):
    """y = x W^T + b with uninitialised parameters: every weight comes from the checkpoint.

    nn.Linear/nn.Embedding would random-initialise first: wasted work at load, and
    their init functions import torch._dynamo (measured: half of server start-up)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        # How the product is computed (`LinearMethod`): chosen by `pack` and `quantize`, wrapped
        # with the LoRA delta when adapters change this layer (`lora`).
        self.method: LinearMethod = UNQUANTIZED
        # The weight in oneDNN's layout once `pack` ran (engine/models/packed_linear.py). A plain
        # attribute, not a buffer: the compiled decode graph takes it as an input.
        self.packed: torch.Tensor | None = None
        # Beside `packed`, the weight as [in, out] rows (`transpose_for_one_row`): for one row on one
        # compute thread, MKL's product over it beats oneDNN's over the packed weight.
        self.row_weight: torch.Tensor | None = None
        # Once `quantize` ran (engine/models/quantized_linear.py): the quantized rows and their scales.
        self.qweight: torch.Tensor | None
        self.qscales: torch.Tensor | None
        self.register_buffer("qweight", None)
        self.register_buffer("qscales", None)
        # q8_0 under --q8-0-activations auto: the weight's tiles laid out for its two int8 levels
        # (`pack_q8_0_tiles`), a second copy of the weight, read by every decode.
        self.qtiles: torch.Tensor | None
        self.register_buffer("qtiles", None)

    @property
    def lora(self) -> OutputDelta | None:
        """The LoRA adapters' delta added to this layer's output, when the engine serves any
        (engine/lora/serving.py): their delta for the rows of each adapter's requests."""
        return self.method.delta if isinstance(self.method, WithLoRA) else None

    @lora.setter
    def lora(self, delta: OutputDelta | None) -> None:
        base = self.method.inner if isinstance(self.method, WithLoRA) else self.method
        self.method = base if delta is None else WithLoRA(base, delta)

    @property
    def qmethod(self) -> str | None:
        """The quantization method's name ("int8", "w8a8", "int4", "q8_0", "q4_0", "q4_1", "q4_k") once
        quantized; else None."""
        base = self.method.inner if isinstance(self.method, WithLoRA) else self.method
        return base.name if isinstance(base, Quantized) else None

    @property
    def q8_0_activations(self) -> str | None:
        """A `q8_0` layer's `--q8-0-activations` ("auto", "float32" or "int8"); None for any other."""
        base = self.method.inner if isinstance(self.method, WithLoRA) else self.method
        return base.activations if isinstance(base, Quantized) and base.name == "q8_0" else None

    def multiply_q8_0_activations_as(self, activations: str) -> bool:
        """A `q8_0` layer: from now on a batch of decodes' rows (up to 16) meet the weight as
        `activations` says ("int8": rounded to int8 per block of 32, as llama.cpp multiplies;
        `Quantized.activations`); returns whether this layer is one. Prompts take
        `q8_0_dequantized_mm`, except under auto with tiles (up to 1,024 rows on them)."""
        if self.qmethod != "q8_0":
            return False
        self._choose(Quantized("q8_0", activations))
        if activations != "auto":
            self.qtiles = None  # only auto's two levels read them
        return True

    def pack_q8_0_tiles(self) -> bool:
        """A `q8_0` layer under auto (on a CPU with AVX-512 VNNI): lay the weight's tiles out for
        its two int8 levels once (`q8_0_rows.pack_tiles`), a second copy of the weight and its
        scales, instead of transposing each tile at every call; every row count up to 1,024 then
        reads them. Which layers get them is the worker's budget (engine/worker/q8_0_tiles.py).
        Call once the weights are final; returns whether it did."""
        if self.q8_0_activations != "auto" or self.qweight is None or self.qscales is None:
            return False
        self.qtiles = q8_0_rows.pack_tiles(self.qweight, self.qscales)
        return self.qtiles is not None

    def _choose(self, method: LinearMethod) -> None:
        """`method` computes the product from now on (still under the LoRA delta, if any)."""
        delta = self.lora
        self.method = method if delta is None else WithLoRA(method, delta)

    def quantize(self, method: str = "int8", keep_weight: bool = False) -> bool:
        """Store the weight quantized as `method` ("int8" weight-only, "w8a8" with activations
        quantized per row too, "int4", "q8_0", "q4_0"; engine/models/quantized_linear.py) where its kernel takes the
        weight's shape; returns whether it did. As with `pack`, the float weight is then dropped
        unless `keep_weight` (a tied LM head: the embedding still reads it)."""
        if not can_quantize(self.weight, method):
            return False
        self._hold_quantized(method, *quantize_weight(self.weight, method), keep_weight=keep_weight)
        return True

    def hold_file_blocks(self, method: str, keep_weight: bool = False) -> bool:
        """Before loading: hold empty `method` storage ("q8_0", or "q4_0", "q4_1", "q4_k") in place
        of the float weight, for loading to fill with a GGUF file's blocks as they are
        (`engine.models.weights.copied_blocks`); returns whether the kernel takes the weight's shape
        (if not, nothing changed). `keep_weight` as in `quantize`."""
        if not can_quantize(self.weight, method):
            return False
        self._hold_quantized(method, *empty_block_storage(method, *self.weight.shape), keep_weight=keep_weight)
        return True

    def _hold_quantized(self, method: str, qweight: torch.Tensor, qscales: torch.Tensor, keep_weight: bool) -> None:
        self.qweight, self.qscales = qweight, qscales
        self.packed = self.row_weight = self.qtiles = None  # a method's tensors go with it
        self._choose(Quantized(method))
        if not keep_weight:
            self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)

    def pack(self, keep_weight: bool = False) -> bool:
        """Lay the weight out for oneDNN, where that applies (`packed_linear.can_pack`); returns
        whether it did. The stored weight is then dropped (a meta tensor keeps its shape) unless
        `keep_weight` (a tied LM head: the embedding still reads it). Call once the weights are
        final: loading into a packed layer is an error."""
        packed = None if self.qweight is not None else pack_weight(self.weight)
        if packed is None:
            return False
        self.packed = packed
        self._choose(PACKED)
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
        return self.method.apply(self, x, bias)

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
    """Llama's: normalised in float32, cast back, then scaled by the weight. With `weight_offset`
    (Gemma's), scaled by (1 + weight) in float32, then cast back, as transformers does each."""

    def __init__(self, size: int, eps: float, weight_offset: bool = False, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, **factory))
        self.eps = eps
        self.weight_offset = weight_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


GATE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,  # SwiGLU (Llama, Qwen, Mistral)
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),  # GeGLU (Gemma)
}


class DenseMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU, or GeGLU with `act="gelu_pytorch_tanh"`; gate and up fused
    into one matmul. `reduce=False` leaves this rank's partial sum (a shared expert inside an MoE
    block, reduced with it)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, tp: TensorParallel, reduce: bool = True,
                 act: str = "silu", **factory: Any) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias, **factory)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, tp=tp, reduce=reduce, **factory)
        self.act = GATE_ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
