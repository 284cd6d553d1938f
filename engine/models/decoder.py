"""Llama / Qwen2 / Qwen3 decoder-only transformers over the paged KV cache.

One module covers the three families; they differ only in where attention has
biases (Qwen2: q/k/v) and in Qwen3's per-head RMSNorm of q and k. q/k/v and
gate/up projections are fused into one matmul each, filled at load time from
the checkpoint's separate tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.models.attention import AttentionMetadata, paged_attention, write_kv
from engine.models.hf_config import DecoderConfig
from engine.models.parallel import TensorParallel
from engine.models.rope import RotaryEmbedding
from engine.models.weights import load_named_weights

KVCache = tuple[torch.Tensor, torch.Tensor]


class Linear(nn.Module):
    """y = x W^T + b with uninitialised parameters: every weight comes from the checkpoint.

    nn.Linear/nn.Embedding would random-initialise first: wasted work at load, and
    their init functions import torch._dynamo (measured: half of server start-up)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """A Linear whose input features are split across ranks: partial sums are all-reduced,
    then the (unsplit) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, **factory: Any) -> None:
        super().__init__(in_features, out_features, bias, **factory)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
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


class DecoderLayer(nn.Module):
    """One transformer block; under tensor parallelism it holds this rank's heads and
    intermediate features."""

    def __init__(self, cfg: DecoderConfig, tp: TensorParallel, **factory: Any) -> None:
        super().__init__()
        self.num_heads = tp.split(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.split(cfg.num_kv_heads, "num_key_value_heads")
        self.head_dim = cfg.head_dim
        intermediate = tp.split(cfg.intermediate_size, "intermediate_size")
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias, **factory)
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, bias=cfg.o_bias, tp=tp, **factory)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * intermediate, bias=cfg.mlp_bias, **factory)
        self.down_proj = RowParallelLinear(intermediate, cfg.hidden_size, bias=cfg.mlp_bias, tp=tp, **factory)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **factory)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **factory)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self._attention(self.input_layernorm(x), positions, rope, kv_cache, meta)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)

    def _attention(self, h: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                   kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        T = h.shape[0]
        q, k, v = self.qkv_proj(h).split(self.split, dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(positions, q, k)
        write_kv(kv_cache[0], kv_cache[1], meta.slot_mapping, k, v)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(T, -1))


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: DecoderConfig, dtype: torch.dtype, device: torch.device | str,
                 tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.config = cfg
        self.dtype = dtype
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, **factory)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, **factory) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        self.lm_head = Linear(cfg.hidden_size, self.embed_tokens.weight.shape[0], bias=False, **factory)
        self.rope: RotaryEmbedding | None = None

    def setup_rope(self, max_positions: int) -> None:
        cfg = self.config
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                    self.embed_tokens.weight.device, self.dtype)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """hidden: input embeddings [T, H] of the flat batch -> final hidden states [T, H]."""
        assert self.rope is not None, "setup_rope() must run before forward()"
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, positions, self.rope, kv_cache, meta)
        return self.norm(hidden)

    @property
    def first_layer(self) -> DecoderLayer:
        layer = self.layers[0]
        assert isinstance(layer, DecoderLayer)
        return layer

    @property
    def num_local_kv_heads(self) -> int:
        return self.first_layer.num_kv_heads

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (gathered from every rank: a collective, so all ranks call it)."""
        return self.tp.all_gather_last_dim(self.lm_head(hidden)).float()

    # ---- weight loading ---------------------------------------------------------------
    # Fused parameters are filled from several checkpoint tensors: HF name -> (ours, slot).
    _FUSED = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into our (partly fused) parameters.

        Raises `ModelLoadError` naming the tensor for a shape mismatch, an
        unexpected tensor, or parameters the checkpoint never provided.
        """
        params = dict(self.named_parameters())
        expected = {slot for name in params for slot in self._slots_of(name)}
        load_named_weights(params, weights, self._map_name, self._copy_into, expected, self.config.architecture)
        self.tie_weights()

    def _slots_of(self, name: str) -> list[tuple[str, int | None]]:
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return []
        if ".qkv_proj." in name:
            return [(name, 0), (name, 1), (name, 2)]
        if ".gate_up_proj." in name:
            return [(name, 0), (name, 1)]
        return [(name, None)]

    def _map_name(self, hf_name: str) -> tuple[str, int | None] | None:
        if "rotary_emb.inv_freq" in hf_name:
            return None
        if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        name = hf_name.removeprefix("model.").replace("self_attn.", "").replace("mlp.", "")
        parts = name.split(".")
        if len(parts) >= 3 and parts[0] == "layers" and parts[2] in self._FUSED:
            fused, slot = self._FUSED[parts[2]]
            return ".".join([parts[0], parts[1], fused, *parts[3:]]), slot
        return name, None

    def _copy_into(self, param: torch.Tensor, name: str, slot: int | None,
                   tensor: torch.Tensor, hf_name: str) -> None:
        target = param.data
        if slot is not None:
            sizes = self._slot_sizes(name)
            target = target.narrow(0, sum(sizes[:slot]), sizes[slot])
        tensor = self._shard(name, tensor)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(target.shape)}")
        target.copy_(tensor)

    def _slot_sizes(self, name: str) -> list[int]:
        layer = self.first_layer
        if ".gate_up_proj." in name:
            return [layer.down_proj.weight.shape[1]] * 2
        return list(layer.split)

    _ROW_PARALLEL = (".o_proj.weight", ".down_proj.weight")
    _COLUMN_PARALLEL = (".qkv_proj.", ".gate_up_proj.", "embed_tokens.weight", "lm_head.weight")

    def _shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full checkpoint tensor (the identity without tensor parallelism)."""
        if name.endswith(self._ROW_PARALLEL):
            return self.tp.shard(tensor, 1)
        if any(part in name for part in self._COLUMN_PARALLEL):
            return self.tp.shard(tensor, 0)
        return tensor
