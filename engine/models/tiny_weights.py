"""The random weights of a tiny checkpoint (`engine.models.tiny`), in HF names and layouts."""

from __future__ import annotations

from typing import Any

import torch

from engine.models.tiny_spec import TinyModelSpec


def _mlp_weights(spec: TinyModelSpec, prefix: str, normal: Any) -> dict[str, torch.Tensor]:
    """A dense SwiGLU MLP, or the router and experts in the checkpoint layout of the architecture."""
    if spec.arch == "gpt_oss":  # stacked experts, gate and up interleaved, with biases; a biased router
        block, experts = prefix + "mlp.", spec.experts
        return {block + "router.weight": normal(experts, spec.hidden) * 20, block + "router.bias": normal(experts),
                block + "experts.gate_up_proj": normal(experts, spec.hidden, 2 * spec.intermediate),
                block + "experts.gate_up_proj_bias": normal(experts, 2 * spec.intermediate),
                block + "experts.down_proj": normal(experts, spec.intermediate, spec.hidden),
                block + "experts.down_proj_bias": normal(experts, spec.hidden)}
    if spec.arch not in ("mixtral", "qwen3_moe"):
        return {prefix + "mlp.gate_proj.weight": normal(spec.intermediate, spec.hidden),
                prefix + "mlp.up_proj.weight": normal(spec.intermediate, spec.hidden),
                prefix + "mlp.down_proj.weight": normal(spec.hidden, spec.intermediate)}
    block = prefix + ("block_sparse_moe." if spec.arch == "mixtral" else "mlp.")
    names = ("w1", "w3", "w2") if spec.arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    weights = {block + "gate.weight": normal(spec.experts, spec.hidden) * 20}  # a router with preferences
    for e in range(spec.experts):
        weights[f"{block}experts.{e}.{names[0]}.weight"] = normal(spec.intermediate, spec.hidden)
        weights[f"{block}experts.{e}.{names[1]}.weight"] = normal(spec.intermediate, spec.hidden)
        weights[f"{block}experts.{e}.{names[2]}.weight"] = normal(spec.hidden, spec.intermediate)
    return weights


def random_weights(spec: TinyModelSpec, vocab_size: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(spec.seed)
    head_dim = spec.head_size
    # Gemma scales by (1 + w): its unit norms are zeros
    unit = torch.zeros if spec.arch == "gemma3" else torch.ones
    dtype = getattr(torch, spec.dtype)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.05).to(dtype)

    weights = {"model.embed_tokens.weight": normal(vocab_size, spec.hidden),
               "model.norm.weight": unit(spec.hidden, dtype=dtype)}
    if spec.arch == "gpt_oss":  # an LM head of its own
        weights["lm_head.weight"] = normal(vocab_size, spec.hidden)
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": normal(spec.heads * head_dim, spec.hidden),
            p + "self_attn.k_proj.weight": normal(spec.kv_heads * head_dim, spec.hidden),
            p + "self_attn.v_proj.weight": normal(spec.kv_heads * head_dim, spec.hidden),
            p + "self_attn.o_proj.weight": normal(spec.hidden, spec.heads * head_dim),
            **_mlp_weights(spec, p, normal),
            p + "input_layernorm.weight": unit(spec.hidden, dtype=dtype),
            p + "post_attention_layernorm.weight": unit(spec.hidden, dtype=dtype),
        })
        if spec.arch == "gemma3":
            weights[p + "pre_feedforward_layernorm.weight"] = unit(spec.hidden, dtype=dtype)
            weights[p + "post_feedforward_layernorm.weight"] = unit(spec.hidden, dtype=dtype)
        if spec.arch in ("qwen2", "gpt_oss"):
            for proj, size in (("q", spec.heads), ("k", spec.kv_heads), ("v", spec.kv_heads)):
                weights[p + f"self_attn.{proj}_proj.bias"] = normal(size * head_dim)
        if spec.arch == "gpt_oss":
            weights[p + "self_attn.o_proj.bias"] = normal(spec.hidden)
            weights[p + "self_attn.sinks"] = normal(spec.heads) * 20
        if spec.arch in ("qwen3", "qwen3_moe", "gemma3"):
            weights[p + "self_attn.q_norm.weight"] = unit(head_dim, dtype=dtype)
            weights[p + "self_attn.k_norm.weight"] = unit(head_dim, dtype=dtype)
    return weights
