"""BERT encoders (`BertModel`, `BertForSequenceClassification`, ColBERT) for pooling.

Absolute position embeddings, token type ids, GELU, post-layer-norm. Every
request is encoded whole in one step (attention is bidirectional, so there
is no KV cache to continue from): the runner pads the step's sequences into
one batch and masks the padding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.models.weights import load_named_weights

# ColBERT checkpoints are a BertModel plus a bias-free projection `linear` (hidden -> dim) applied to
# every token; they are scored by late interaction (MaxSim). "HF_ColBERT" is what colbert-ai saves.
LATE_INTERACTION_ARCHITECTURES = ("HF_ColBERT", "ColBERTModel")
ENCODER_ARCHITECTURES = ("BertModel", "BertForSequenceClassification", *LATE_INTERACTION_ARCHITECTURES)


@dataclass(frozen=True)
class EncoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    num_labels: int  # classification heads only
    torch_dtype: str
    projection_dim: int | None = None  # ColBERT: None until read from the checkpoint's `linear.weight`
    labels: tuple[str, ...] = ()  # a classification head's label names (id2label), by index

    @property
    def late_interaction(self) -> bool:
        return self.architecture in LATE_INTERACTION_ARCHITECTURES

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> EncoderConfig:
        arch = next(a for a in raw.get("architectures") or ["BertModel"] if a in ENCODER_ARCHITECTURES)
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(f"position_embedding_type {raw['position_embedding_type']!r} is not supported")
        labels = raw.get("id2label") or {}
        return cls(arch, raw["vocab_size"], raw["hidden_size"], raw["intermediate_size"], raw["num_hidden_layers"],
                   raw["num_attention_heads"], raw["max_position_embeddings"], raw.get("type_vocab_size", 2),
                   raw.get("layer_norm_eps", 1e-12), raw.get("hidden_act", "gelu"),
                   raw.get("num_labels", len(labels) or 1), raw.get("torch_dtype") or raw.get("dtype") or "float32",
                   raw.get("colbert_dim") or raw.get("dim") or raw.get("projection_dim"),
                   tuple(str(labels[k]) for k in sorted(labels, key=int)))


def is_encoder_config(raw: dict[str, Any]) -> bool:
    archs = raw.get("architectures") or []
    return any(a in ENCODER_ARCHITECTURES for a in archs) or (not archs and raw.get("model_type") == "bert")


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


def _empty_linear(inp: int, out: int, **factory: Any) -> nn.Linear:
    layer = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = inp, out
    layer.weight = nn.Parameter(torch.empty(out, inp, **factory))
    layer.bias = nn.Parameter(torch.empty(out, **factory))
    return layer


def _empty_norm(size: int, eps: float, **factory: Any) -> nn.Module:
    norm = nn.LayerNorm.__new__(nn.LayerNorm)
    nn.Module.__init__(norm)
    norm.normalized_shape, norm.eps, norm.elementwise_affine = (size,), eps, True
    norm.weight = nn.Parameter(torch.empty(size, **factory))
    norm.bias = nn.Parameter(torch.empty(size, **factory))
    return norm


class BertLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig, **factory: Any) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        self.qkv = _empty_linear(cfg.hidden_size, 3 * cfg.hidden_size, **factory)
        self.attn_out = _empty_linear(cfg.hidden_size, cfg.hidden_size, **factory)
        self.attn_norm = _empty_norm(cfg.hidden_size, cfg.layer_norm_eps, **factory)
        self.intermediate = _empty_linear(cfg.hidden_size, cfg.intermediate_size, **factory)
        self.output = _empty_linear(cfg.intermediate_size, cfg.hidden_size, **factory)
        self.output_norm = _empty_norm(cfg.hidden_size, cfg.layer_norm_eps, **factory)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = self.attn_norm(x + self.attn_out(attn.transpose(1, 2).reshape(batch, length, hidden)))
        return self.output_norm(x + self.output(self.act(self.intermediate(x))))


class BertEncoder(nn.Module):
    """Token ids (+ token types) of a padded batch -> last hidden states [B, L, H]."""

    def __init__(self, cfg: EncoderConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        self.config, self.dtype = cfg, dtype
        self.word_embeddings = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **factory))
        self.position_embeddings = nn.Parameter(torch.empty(cfg.max_position_embeddings, cfg.hidden_size, **factory))
        self.token_type_embeddings = nn.Parameter(torch.empty(cfg.type_vocab_size, cfg.hidden_size, **factory))
        self.embed_norm = _empty_norm(cfg.hidden_size, cfg.layer_norm_eps, **factory)
        self.layers = nn.ModuleList(BertLayer(cfg, **factory) for _ in range(cfg.num_layers))
        self.classifier: nn.Module | None = None
        if cfg.architecture == "BertForSequenceClassification":
            self.pooler = _empty_linear(cfg.hidden_size, cfg.hidden_size, **factory)
            self.classifier = _empty_linear(cfg.hidden_size, cfg.num_labels, **factory)
        self.projection: nn.Parameter | None = None  # ColBERT's per-token projection [dim, hidden]
        if cfg.late_interaction:
            if not cfg.projection_dim:
                raise ModelLoadError(f"{cfg.architecture}: the projection size is unknown (no `linear.weight`)")
            self.projection = nn.Parameter(torch.empty(cfg.projection_dim, cfg.hidden_size, **factory))

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device)
        x = (F.embedding(input_ids, self.word_embeddings) + self.position_embeddings[positions]
             + F.embedding(token_type_ids, self.token_type_embeddings))
        x = self.embed_norm(x)
        keep = positions.unsqueeze(0) < lengths.unsqueeze(1)  # [B, L]: real tokens
        mask = torch.zeros(batch, 1, 1, length, dtype=x.dtype, device=x.device)
        mask.masked_fill_(~keep[:, None, None, :], -math.inf if x.dtype == torch.float32 else torch.finfo(x.dtype).min)
        for layer in self.layers:
            x = layer(x, mask)
        return x

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """The sequence-classification head over the CLS token's hidden state: logits [B, labels]."""
        assert self.classifier is not None
        return self.classifier(torch.tanh(self.pooler(cls_hidden))).float()

    def project_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Per-token vectors for late interaction: ColBERT's projection, or the hidden states as they are."""
        return hidden if self.projection is None else F.linear(hidden, self.projection)

    # ---- weight loading ---------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        expected = {(n, s) for n in params for s in ((0, 1, 2) if ".qkv." in n else (None,))}
        load_named_weights(params, weights, self._map_name, self._copy_into, expected, self.config.architecture)

    def _copy_into(self, param: torch.Tensor, name: str, slot: int | None, tensor: torch.Tensor,
                   hf_name: str) -> None:
        dest = param.data
        if slot is not None:  # q, k or v inside the fused projection
            size = self.config.hidden_size
            dest = dest.narrow(0, slot * size, size)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(dest.shape)}")
        dest.copy_(tensor)

    _LAYER_NAMES = {
        "attention.self.query": ("qkv", 0), "attention.self.key": ("qkv", 1), "attention.self.value": ("qkv", 2),
        "attention.output.dense": ("attn_out", None), "attention.output.LayerNorm": ("attn_norm", None),
        "intermediate.dense": ("intermediate", None), "output.dense": ("output", None),
        "output.LayerNorm": ("output_norm", None),
    }
    _TOP_NAMES = {
        "embeddings.word_embeddings.weight": "word_embeddings",
        "embeddings.position_embeddings.weight": "position_embeddings",
        "embeddings.token_type_embeddings.weight": "token_type_embeddings",
        "embeddings.LayerNorm.weight": "embed_norm.weight", "embeddings.LayerNorm.bias": "embed_norm.bias",
        "pooler.dense.weight": "pooler.weight", "pooler.dense.bias": "pooler.bias",
        "classifier.weight": "classifier.weight", "classifier.bias": "classifier.bias",
        "linear.weight": "projection", "colbert_linear.weight": "projection",
    }

    def _map_name(self, hf_name: str) -> tuple[str, int | None] | None:
        name = hf_name.removeprefix("bert.").removeprefix("model.")
        if name.endswith("position_ids"):
            return None
        if name.startswith("pooler.") and self.classifier is None:
            return None  # BertModel checkpoints carry a pooler that sentence embeddings do not use
        if name in self._TOP_NAMES:
            return self._TOP_NAMES[name], None
        parts = name.split(".")
        if len(parts) >= 5 and parts[0] == "encoder" and parts[1] == "layer":
            key = ".".join(parts[3:-1])
            if key in self._LAYER_NAMES:
                ours, slot = self._LAYER_NAMES[key]
                return f"layers.{parts[2]}.{ours}.{parts[-1]}", slot
        return name, None
