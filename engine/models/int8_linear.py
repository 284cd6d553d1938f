"""int8 linear layers: weight-only (`--quantization int8`, and quantized GGUF files), or with
int8 activations too (`--quantization w8a8`).

Each weight row (an output channel) is stored as int8 with one scale, `max |w| / 127`; the
activations stay in the model's dtype. A decode step reads every weight once, so a quarter of
float32's bytes is most of the win. The matmul is torch's CPU kernel for exactly this layout,
`aten._weight_int8pack_mm` (gpt-fast's, which inductor also calls from compiled graphs). Its
float32 path is slow on this CPU build and its bfloat16 path fast (docs/benchmarks.md,
"Quantized weights"), so with float32 activations the rows are cast to bfloat16 for the
matmul and the result back: bfloat16's rounding of the activations, next to int8's of the
weights, moves logits by about the same as the weights' own rounding.

That kernel is compute-bound beyond a row or two (16 rows of the 0.5B shape's LM head: 47 ms,
against 26 for float32 and 14 for an int8 x int8 matmul), so `w8a8` exists for batched serving:
activations quantized per row at run time, as llama.cpp's Q8_0 does, and `torch._int_mm`.
"""

from __future__ import annotations

import torch

QUANTIZATIONS = ("int8", "w8a8")
# The kernel's bfloat16 path reads the input features in blocks of 16: any other count gives wrong
# sums without an error (measured: 24 or 40 features), so such a layer stays float.
FEATURE_BLOCK = 16


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [N, K], float32 scales [N]): symmetric, one scale per output row."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activation dtype the int8 kernel runs in for a model of `dtype`."""
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ (qweight * scales[:, None]).T + bias`, in x's dtype. `scales` are in the kernel's dtype."""
    rows = x.reshape(-1, x.shape[-1]).to(scales.dtype)
    y = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), qweight, scales)
    y = y.reshape(*x.shape[:-1], qweight.shape[0]).to(x.dtype)
    return y if bias is None else y + bias


def w8a8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """`--quantization w8a8`: the int8 rows times each activation row quantized to int8 with its
    own scale (`max |x| / 127`, per row, so a row's result never depends on the rest of the
    batch), an int8 x int8 -> int32 matmul (`torch._int_mm`, VNNI on this CPU), then both scales.
    llama.cpp's Q8_0 quantizes activations the same way, in blocks of 32 features."""
    rows = x.reshape(-1, x.shape[-1]).float()
    row_scales = (rows.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
    quantized = torch.round(rows / row_scales).clamp(-127, 127).to(torch.int8)
    y = torch._int_mm(quantized, qweight.t()).float() * row_scales * scales
    y = y.reshape(*x.shape[:-1], qweight.shape[0]).to(x.dtype)
    return y if bias is None else y + bias


def can_quantize(weight: torch.Tensor) -> bool:
    """A 2-D CPU weight whose input features the kernel takes (a multiple of FEATURE_BLOCK)."""
    return weight.dim() == 2 and weight.shape[1] % FEATURE_BLOCK == 0 and weight.device.type == "cpu"
