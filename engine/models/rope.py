"""Rotary position embeddings (neox layout, as in HF Llama/Qwen): llama3, linear, YaRN or LongRoPE frequency
scaling, and partial rotation (the leading `rotary_dim` dims of each head)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.models.hf_config import yarn_mscale


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """`head_dim`: the rotated dims (all of a head's, or its rotary part)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":  # positions divided by the factor
        return inv_freq / float(scaling["factor"])
    return _llama3_scaled(inv_freq, scaling)


def _longrope_freqs(positions: torch.Tensor, rotary_dim: int, theta: float,
                    scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): the angles of `positions` and the factor cos and sin are scaled by. The
    long factors when the engine runs sequences past the window the model was trained on (its
    tables reach past `original_max_position_embeddings`), else the short ones: one choice for the
    whole deployment, as vLLM makes it. transformers switches per sequence, recomputing the whole
    cache with the long factors once a sequence crosses the window; the two agree on every sequence
    that crosses it, and, with a context length inside the window, on every sequence."""
    original = int(scaling["original_max_position_embeddings"])
    factors = scaling["long_factor"] if positions.numel() > original else scaling["short_factor"]
    base = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * base)
    factor = scaling.get("factor") or int(scaling["max_position_embeddings"]) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return torch.outer(positions, inv_freq), float(attention)


def _yarn(rotary_dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss, Qwen's long-context setting, DeepSeek-V3): the inverse frequencies, blended
    between interpolated and original along the dims, and the factor cos and sin are scaled by;
    transformers' `_compute_yarn_parameters`, which vLLM's `YaRNScalingRotaryEmbedding` matches."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or int(scaling["max_position_embeddings"]) / original
    factor = float(factor)

    attention = scaling.get("attention_factor")
    if attention is None:
        big, all_dims = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = yarn_mscale(factor)
        if big and all_dims:
            attention = yarn_mscale(factor, big) / yarn_mscale(factor, all_dims)

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    original_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    extrapolated = 1 - ramp  # the high-frequency dims keep their frequency; the low ones are interpolated
    inv_freq = original_freq / factor * (1 - extrapolated) + original_freq * extrapolated
    return inv_freq, float(attention)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables for every position up to `max_positions`.

    A module whose tables are (non-persistent) buffers: the model's exported decode graph then
    names them among the model's tensors (`rope.cos`, `rope.sin`) and takes them from the live
    model at load, as it takes the weights (engine.worker.precompiled_graph)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, device: torch.device | str, dtype: torch.dtype,
                 rotary_dim: int | None = None) -> None:
        """`rotary_dim`: rotate only each head's first so many dims (default: all of them)."""
        super().__init__()
        dim = rotary_dim or head_dim
        positions = torch.arange(max_positions, dtype=torch.float32)
        scale = 1.0
        kind = None if scaling is None else scaling.get("rope_type")
        if scaling is not None and kind == "longrope":
            freqs, scale = _longrope_freqs(positions, dim, theta, scaling)
        elif scaling is not None and kind == "yarn":
            inv_freq, scale = _yarn(dim, theta, scaling)
            freqs = torch.outer(positions, inv_freq)
        else:
            freqs = torch.outer(positions, inverse_frequencies(dim, theta, scaling))
        self.rotary_dim = None if dim == head_dim else dim
        self.register_buffer("cos", (freqs.cos() * scale).to(device, dtype), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scale).to(device, dtype), persistent=False)

    @property
    def max_positions(self) -> int:
        """Positions the tables hold: the longest sequence the model runs."""
        return int(self.cos.shape[0])

    def rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hkv, D] by their tokens' positions [T]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        if self.rotary_dim is None:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        dim = self.rotary_dim  # the rest of each head passes through
        return (torch.cat((_rotate(q[..., :dim], cos, sin), q[..., dim:]), dim=-1),
                torch.cat((_rotate(k[..., :dim], cos, sin), k[..., dim:]), dim=-1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
