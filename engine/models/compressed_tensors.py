"""Checkpoints quantized by llm-compressor in the compressed-tensors format, int8 per channel
(`quant_method: compressed-tensors`, format `int-quantized` or `naive-quantized`, weights of 8
bits, symmetric, `channel` strategy): W8A16 (no input activations: our `int8`) or W8A8 with
dynamic per-token int8 activations (our `w8a8`). Each quantized weight is stored as int8 rows
with a `weight_scale` per row; at load they become float rows again (`q * scale`) and the layers
named in the checkpoint are quantized back per channel, which gives the same int8 rows and scales
(each row's largest |q| is 127). Anything else (other bit widths, groups, asymmetric weights,
static activations, other methods) is refused in one line naming it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import ModelLoadError

FORMATS = ("int-quantized", "naive-quantized")


@dataclass(frozen=True)
class CompressedInt8:
    method: str  # the matching --quantization: "int8" (W8A16) or "w8a8"


def read_scheme(config: dict[str, Any], where: str) -> CompressedInt8 | None:
    """The checkpoint's int8 scheme from its `quantization_config` (None: a float checkpoint)."""
    spec = config.get("quantization_config")
    if not spec:
        return None
    method = spec.get("quant_method")
    if method != "compressed-tensors":
        raise ModelLoadError(f"{where}: quantization_config method {method!r} is not supported (compressed-tensors "
                             "int8 is); load a float checkpoint with --quantization int8, or a GGUF file")
    if spec.get("format") not in FORMATS:
        raise ModelLoadError(f"{where}: compressed-tensors format {spec.get('format')!r} is not supported; "
                             f"supported: {', '.join(FORMATS)}")
    methods = {_group_method(group, where) for group in (spec.get("config_groups") or {}).values()}
    if len(methods) != 1:
        raise ModelLoadError(f"{where}: compressed-tensors needs one quantization scheme, got {len(methods)}")
    return CompressedInt8(methods.pop())


def _group_method(group: dict[str, Any], where: str) -> str:
    weights = group.get("weights") or {}
    wanted = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    for key, value in wanted.items():
        if weights.get(key) != value:
            raise ModelLoadError(f"{where}: compressed-tensors weights with {key} {weights.get(key)!r} are not "
                                 f"supported (int8 needs {key} {value!r})")
    activations = group.get("input_activations")
    if activations is None:
        return "int8"
    if activations.get("num_bits") == 8 and activations.get("dynamic") is True and \
            activations.get("strategy") == "token" and activations.get("symmetric", True):
        return "w8a8"
    raise ModelLoadError(f"{where}: compressed-tensors input activations {activations} are not supported "
                         "(none, or dynamic symmetric 8-bit per token)")


def dequantized(weights: Iterator[tuple[str, torch.Tensor]], scales: dict[str, torch.Tensor],
                quantized: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each int8 weight made float again (`q * weight_scale`);
    the names of those weights are added to `quantized`."""
    for name, tensor in weights:
        if name.endswith((".weight_scale", ".weight_zero_point", ".input_scale")):
            continue
        scale = scales.get(f"{name}_scale")
        if scale is None:
            yield name, tensor
            continue
        if tensor.dtype != torch.int8 or scale.numel() != tensor.shape[0]:
            raise ModelLoadError(f"compressed-tensors weight {name} is {tensor.dtype} {tuple(tensor.shape)} with "
                                 f"{scale.numel()} scales; int8 rows with one scale each are expected")
        quantized.add(name)
        yield name, tensor.float() * scale.float().reshape(-1, 1)
