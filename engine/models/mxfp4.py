"""MXFP4 checkpoints (gpt-oss as OpenAI publishes it): the experts' weights stored as 4-bit floats
(e2m1, two to a byte, the low nibble first) in groups of 32 sharing one power-of-two scale (an
8-bit exponent biased by 127), as `*_blocks` [..., rows, groups, 16] and `*_scales` [..., rows,
groups] tensors. They are dequantized at load into the float experts the other checkpoints hold
(then `--quantization int8` may quantize them again), the way transformers loads them without
its Triton kernels (`convert_moe_packed_tensors`), so the values are the ones it computes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.errors import ModelLoadError

# The 16 values of an e2m1 code: sign bit, then two exponent bits and one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
ROWS_PER_CHUNK = 1 << 16  # rows dequantized at once: bounds the index tensors' memory


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [..., groups, 16] (uint8), scales [..., groups] (uint8) -> [..., groups * 32]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ModelLoadError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    *prefix, groups, _ = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    codes = blocks.to(torch.uint8).reshape(-1, 16)
    exponents = (scales.to(torch.int32) - SCALE_BIAS).reshape(-1, 1)
    out = torch.empty(codes.shape[0], 32, dtype=dtype)
    for start in range(0, codes.shape[0], ROWS_PER_CHUNK):
        part = slice(start, start + ROWS_PER_CHUNK)
        values = out[part]
        values[:, 0::2] = lut[(codes[part] & 0x0F).long()]
        values[:, 1::2] = lut[(codes[part] >> 4).long()]
        torch.ldexp(values, exponents[part], out=values)
    return out.view(*prefix, groups * 32)


def mxfp4_dequantized(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each `X_blocks` / `X_scales` pair made float `X`, laid out as
    transformers stores gpt-oss's float experts ([experts, in, out]: the stored rows are the
    outputs, so the dequantized matrix is transposed). A pair missing its other half is an error."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        base, _, kind = name.rpartition("_")
        if kind not in ("blocks", "scales") or not base.endswith(("gate_up_proj", "down_proj")):
            yield name, tensor
            continue
        pair = halves.setdefault(base, {})
        pair[kind] = tensor
        if len(pair) == 2:
            del halves[base]
            yield base, dequantize_mxfp4(pair["blocks"], pair["scales"]).transpose(-1, -2)
    if halves:
        name, pair = next(iter(halves.items()))
        raise ModelLoadError(f"MXFP4 tensor {name}_{next(iter(pair))} has no matching "
                             f"{'scales' if 'blocks' in pair else 'blocks'}")
