"""DeepSeek's multi-head latent attention (MLA) over the paged KV cache.

Each token's keys and values come from one latent vector (`kv_lora_rank` wide, normalised) and one
rotated key part shared by every head (`qk_rope_head_dim`). The KV cache holds exactly those two,
one "head" each: the layer's key cache the latents, its value cache the rotated parts. So a token
costs (kv_lora_rank + qk_rope_head_dim) values per layer, DeepSeek's own figure, where per-head keys
and values would cost 2 x heads x head size (for DeepSeek-V3, 576 against 40,960).

Two forms of the same maths, as vLLM and DeepSeek run them:
- prompts *expand* the latents they read into per-head keys and values with the layer's
  `kv_b_proj`, then attend as usual (the keys are the expanded part and the shared rotated part
  side by side): the expansion is shared by every query of the chunk;
- decodes *absorb* `kv_b_proj` into the query and the output instead (`absorbed_attention`): the
  query's non-rotated part goes through the key half of `kv_b_proj` into latent space, attends over
  the cached latents directly, and the result goes through the value half. One query per sequence
  then costs heads x latent per position, where expanding would cost heads x latent x head size
  (for DeepSeek-V3 at 4,096 positions, ~0.6 against ~68 GFLOP a layer a token).
`kv_b_proj` stays a float weight (`FloatProjection`: neither packed nor quantized) since both forms
read it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import (
    AttentionGroup,
    AttentionMetadata,
    DecodeMetadata,
    GraphedAttention,
    decode_allowed,
    gather_blocks,
    write_kv,
)
from engine.models.hf_config import DecoderConfig, MlaConfig
from engine.models.layers import Linear, RMSNorm, RowParallelLinear
from engine.models.parallel import TensorParallel
from engine.models.rope import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]
# latents [..., L, rank], rotated key parts [..., L, rope] -> keys [..., L, H, qk], values [..., L, H, v]
Expand = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
LORA_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which the low-rank norms keep


class FloatProjection(nn.Module):
    """A linear layer's weight kept as stored: packing and quantization (which act on `Linear`s)
    leave it alone, so its halves can be read as matrices (the absorbed form)."""

    def __init__(self, in_features: int, out_features: int, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MlaAttention(nn.Module):
    """One layer's MLA, this rank's heads (tensor parallelism splits the heads; the latent
    projection and the cache are whole on every rank)."""

    def __init__(self, cfg: DecoderConfig, mla: MlaConfig, tp: TensorParallel, **factory: Any) -> None:
        super().__init__()
        self.mla = mla
        self.num_heads = tp.split(cfg.num_heads, "num_attention_heads")
        heads, hidden = self.num_heads, cfg.hidden_size
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * mla.qk_head_dim, bias=False, **factory)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=cfg.qkv_bias, **factory)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS, **factory)
            self.q_b_proj = Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False, **factory)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=cfg.qkv_bias,
                                         **factory)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LORA_NORM_EPS, **factory)
        self.kv_b_proj = FloatProjection(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), **factory)
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, hidden, bias=cfg.o_bias, tp=tp, **factory)
        assert cfg.attention_scale is not None
        self.scale = cfg.attention_scale

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, kv_cache: KVCache,
                meta: AttentionMetadata | DecodeMetadata | GraphedAttention) -> torch.Tensor:
        mla, tokens = self.mla, h.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(h)
        else:
            assert self.q_a_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        q_nope, q_rot = q.view(tokens, self.num_heads, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(h).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).view(tokens, 1, mla.kv_lora_rank)
        k_rot = k_rot.reshape(tokens, 1, mla.qk_rope_head_dim)
        if mla.rope_interleave:  # pairs (x0, x1), (x2, x3)... as the halves rope rotates
            q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
        q_rot, k_rot = rope.rotate(positions, q_rot, k_rot)
        if isinstance(meta, GraphedAttention):
            raise NotImplementedError("MLA does not run in the compiled step graph (MoE models' prompts run eagerly)")
        write_kv(kv_cache[0], kv_cache[1], meta.slot_mapping, latent, k_rot)
        if isinstance(meta, DecodeMetadata):
            out = mla_decode_attention(q_nope, q_rot, kv_cache, meta, self.absorbed)
        else:
            out = mla_paged_attention(q_nope, q_rot, latent, k_rot, kv_cache, meta, self)
        return self.o_proj(out.reshape(tokens, -1))

    def absorbed(self, q_nope: torch.Tensor, q_rot: torch.Tensor, latents: torch.Tensor, rotated: torch.Tensor,
                 allowed: torch.Tensor) -> torch.Tensor:
        """One query per sequence, q_nope [B, H, nope] and q_rot [B, H, rope], over latents [B, L, rank]
        and rotated key parts [B, L, rope] where `allowed` [B, L] -> [B, H, v]."""
        mla = self.mla
        halves = self.kv_b_proj.weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        to_keys, to_values = torch.split(halves, [mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
        # In float32 throughout: the absorbed products round differently from the expanded ones, and
        # in bfloat16 that parted greedy tokens from transformers' (which expands) before its first tie.
        latents = latents.float()
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope.float(), to_keys.float())
        scores = torch.einsum("bhr,blr->bhl", q_latent, latents) + \
            torch.einsum("bhd,bld->bhl", q_rot.float(), rotated.float())
        scores = scores.mul_(self.scale).masked_fill_(~allowed[:, None, :], float("-inf"))
        context = torch.einsum("bhl,blr->bhr", torch.softmax(scores, dim=-1), latents)
        return torch.einsum("bhr,hvr->bhv", context, to_values.float()).to(q_nope.dtype)

    def expand(self, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys and values of latents [..., L, rank] and rotated key parts [..., L, rope]."""
        mla = self.mla
        kv = self.kv_b_proj(latent).view(*latent.shape[:-1], self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, values = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        shared = k_rot.unsqueeze(-2).expand(*k_nope.shape[:-1], mla.qk_rope_head_dim)
        return torch.cat((k_nope, shared), dim=-1), values


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def mla_paged_attention(q_nope: torch.Tensor, q_rot: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor,
                        kv_cache: KVCache, meta: AttentionMetadata, layer: MlaAttention) -> torch.Tensor:
    """[T, H, v]: each token over its sequence's positions, in the groups `paged_attention` forms;
    `latent` [T, 1, rank] and `k_rot` [T, 1, rope] are this step's (already in the cache). The
    decodes absorb (`MlaAttention.absorbed`), the prompt chunks expand."""
    outputs = []
    for group in meta.groups:
        rows = slice(group.token_start, group.token_end)
        if group.q_index is None and group.block_table is not None:  # decodes: one query per sequence
            latents, rotated = (gather_blocks(cache, group, meta.block_size)[:, 0] for cache in kv_cache)
            if group.seq_lens is None:  # shared by the layers, as the decode kernel's are
                group.seq_lens = torch.tensor([c.start_position + 1 for c in group.chunks], dtype=torch.long)
            allowed = decode_allowed(latents.shape[1], group.seq_lens.to(latents.device), None)
            outputs.append(layer.absorbed(q_nope[rows], q_rot[rows], latents, rotated, allowed))
            continue
        q = torch.cat((q_nope[rows], q_rot[rows]), dim=-1)
        outputs.append(_group_attention(q, latent[rows, 0], k_rot[rows, 0], kv_cache, group, meta.block_size,
                                        layer.expand, layer.scale))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _group_attention(q: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor, kv_cache: KVCache,
                     group: AttentionGroup, block_size: int, expand: Expand, scale: float) -> torch.Tensor:
    """A group of prompt chunks, their latents expanded into keys and values."""
    if group.mask is None:  # one fresh sequence: causal over its own tokens
        keys, values = expand(latent, k_rot)  # [T, H, *]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                             is_causal=True, scale=scale)
        return out.transpose(0, 1)
    q_batch = q.unsqueeze(1) if group.q_index is None else q[group.q_index]  # [B, Lq, H, qk]
    if group.block_table is None:  # fresh prompts: their own rows of this step
        keys, values = expand(latent[group.q_index], k_rot[group.q_index])
    else:
        keys, values = expand(gather_blocks(kv_cache[0], group, block_size, q.dtype)[:, 0],
                              gather_blocks(kv_cache[1], group, block_size, q.dtype)[:, 0])
    out = F.scaled_dot_product_attention(q_batch.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=group.mask, scale=scale).transpose(1, 2)  # [B, Lq, H, v]
    return out.squeeze(1) if group.q_index is None else out[group.q_valid]


Absorbed = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def mla_decode_attention(q_nope: torch.Tensor, q_rot: torch.Tensor, kv_cache: KVCache, meta: DecodeMetadata,
                         absorbed: Absorbed) -> torch.Tensor:
    """[B, H, v] for one query per sequence over each sequence's table, absorbed (plain tensor
    operations, for the compiled decode graph and any device)."""
    batch, length = q_nope.shape[0], meta.block_table.shape[1] * meta.block_size
    latents, rotated = (cache.view(-1, meta.block_size, cache.shape[-1])[meta.block_table].view(batch, length, -1)
                        .to(q_nope.dtype) for cache in kv_cache)
    return absorbed(q_nope, q_rot, latents, rotated, decode_allowed(length, meta.seq_lens, None))
