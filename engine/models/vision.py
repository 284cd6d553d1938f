"""The vision side of LLaVA: a CLIP vision tower and the multi-modal projector.

`LlavaVision.encode(pixel_values)` turns preprocessed images [N, 3, H, W] into the rows that
replace each image's placeholder tokens, [N, rows, text hidden]: the tower's hidden states at
`vision_feature_layer` (the class token dropped with the "default" select strategy), through
the projector (linear, activation, linear). Only the tower layers up to the chosen one run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.models.layers import Linear
from engine.models.weights import checked_copy, load_named_weights


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> VisionConfig:
        try:
            return cls(int(raw["hidden_size"]), int(raw["intermediate_size"]), int(raw["num_hidden_layers"]),
                       int(raw["num_attention_heads"]), int(raw["image_size"]), int(raw["patch_size"]),
                       int(raw.get("num_channels", 3)), float(raw.get("layer_norm_eps", 1e-5)),
                       str(raw.get("hidden_act", "quick_gelu")))
        except KeyError as exc:
            raise ModelLoadError(f"vision_config lacks the field {exc.args[0]!r}") from exc

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str) -> Any:
    if name not in _ACTIVATIONS:
        raise ModelLoadError(f"unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, **factory))
        self.bias = nn.Parameter(torch.empty(size, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class VisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig, **factory: Any) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.layer_norm1 = LayerNorm(h, cfg.layer_norm_eps, **factory)
        self.q_proj = Linear(h, h, bias=True, **factory)
        self.k_proj = Linear(h, h, bias=True, **factory)
        self.v_proj = Linear(h, h, bias=True, **factory)
        self.out_proj = Linear(h, h, bias=True, **factory)
        self.layer_norm2 = LayerNorm(h, cfg.layer_norm_eps, **factory)
        self.fc1 = Linear(h, cfg.intermediate_size, bias=True, **factory)
        self.fc2 = Linear(cfg.intermediate_size, h, bias=True, **factory)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, h = x.shape
        y = self.layer_norm1(x)

        def heads(p: Linear) -> torch.Tensor:
            return p(y).view(n, t, self.num_heads, -1).transpose(1, 2)

        attn = F.scaled_dot_product_attention(heads(self.q_proj), heads(self.k_proj), heads(self.v_proj))
        x = x + self.out_proj(attn.transpose(1, 2).reshape(n, t, h))
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))


class ClipVisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig, **factory: Any) -> None:
        super().__init__()
        self.config = cfg
        h, p = cfg.hidden_size, cfg.patch_size
        self.patch_embedding = nn.Parameter(torch.empty(h, cfg.num_channels, p, p, **factory))
        self.class_embedding = nn.Parameter(torch.empty(h, **factory))
        self.position_embedding = nn.Parameter(torch.empty(cfg.num_patches + 1, h, **factory))
        self.pre_layrnorm = LayerNorm(h, cfg.layer_norm_eps, **factory)
        self.layers = nn.ModuleList(VisionLayer(cfg, **factory) for _ in range(cfg.num_layers))
        self.post_layernorm = LayerNorm(h, cfg.layer_norm_eps, **factory)  # loaded, unused by LLaVA

    def hidden_states(self, pixel_values: torch.Tensor, index: int) -> torch.Tensor:
        """The hidden states after layer `index` (0: the embeddings after pre_layrnorm; negative
        counts from the last layer, as transformers' `hidden_states[index]`)."""
        if index < 0:
            index += self.config.num_layers + 1
        x = F.conv2d(pixel_values.to(self.patch_embedding.dtype), self.patch_embedding,
                     stride=self.config.patch_size)
        x = x.flatten(2).transpose(1, 2)
        x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1) + self.position_embedding
        x = self.pre_layrnorm(x)
        for layer in self.layers[:index]:
            x = layer(x)
        return x


class LlavaVision(nn.Module):
    """Tower + projector, and how LLaVA picks the features."""

    def __init__(self, vision: VisionConfig, text_hidden: int, feature_layer: int, select_strategy: str,
                 projector_act: str, projector_bias: bool, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        if select_strategy not in ("default", "full"):
            raise ModelLoadError(f"unsupported vision_feature_select_strategy {select_strategy!r}")
        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        self.tower = ClipVisionTower(vision, **factory)
        self.linear_1 = Linear(vision.hidden_size, text_hidden, bias=projector_bias, **factory)
        self.linear_2 = Linear(text_hidden, text_hidden, bias=projector_bias, **factory)
        self.act = activation(projector_act)
        self.feature_layer = feature_layer
        self.select_strategy = select_strategy
        self.dtype = dtype

    @property
    def rows_per_image(self) -> int:
        return self.tower.config.num_patches + (1 if self.select_strategy == "full" else 0)

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] preprocessed images -> [N, rows_per_image, text hidden]."""
        features = self.tower.hidden_states(pixel_values, self.feature_layer)
        if self.select_strategy == "default":
            features = features[:, 1:]
        return self.linear_2(self.act(self.linear_1(features)))

    # ---- weights ---------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], architecture: str) -> None:
        """The vision tower's and projector's tensors (names already without their prefix:
        `embeddings.patch_embedding.weight`, `encoder.layers.0...`, `linear_1.weight`)."""
        params = dict(self.named_parameters())
        load_named_weights(params, weights, self._map_name, _copy_whole, {(n, None) for n in params}, architecture)

    @staticmethod
    def _map_name(name: str) -> tuple[str, int | None] | None:
        if name.endswith("position_ids"):
            return None
        if name.startswith("linear_"):
            return name, None
        name = name.removeprefix("embeddings.").removeprefix("encoder.")
        name = name.replace("self_attn.", "").replace("mlp.", "")
        if name in ("patch_embedding.weight", "position_embedding.weight"):
            name = name.removesuffix(".weight")
        return "tower." + name, None


def _copy_whole(param: torch.Tensor, name: str, slot: int | None, tensor: torch.Tensor, hf_name: str) -> None:
    checked_copy(param.data, tensor, hf_name)
