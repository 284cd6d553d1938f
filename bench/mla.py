"""`trio-llm bench mla`: one MLA layer's decode attention over a long cached context, the two forms of
the same maths side by side (engine/models/mla.py): *expanded* (the latents of every cached position
through `kv_b_proj` into per-head keys and values, then attention) against *absorbed* (`kv_b_proj`
folded into the query and the output; what the engine runs for decodes). DeepSeek's dimensions
(latent 512, rotated key part 64, heads of 128 + 64 / 128), random weights and cache, bfloat16,
the same thread count for both; the largest difference between their outputs is printed too."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.models.attention import DecodeMetadata
from engine.models.hf_config import DecoderConfig, MlaConfig
from engine.models.mla import MlaAttention, mla_decode_attention
from engine.models.parallel import TensorParallel

MLA = MlaConfig(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                rope_interleave=True)


def _layer(heads: int) -> MlaAttention:
    cfg = DecoderConfig("DeepseekV3ForCausalLM", "deepseek_v3", 1024, 2048, 1, 1, heads, heads, MLA.qk_rope_head_dim,
                        1e-6, 1e4, None, 1, False, False, False, False, False, "bfloat16", None, (),
                        attention_scale=MLA.qk_head_dim ** -0.5, mla=MLA)
    layer = MlaAttention(cfg, MLA, TensorParallel(), dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.kv_b_proj.weight, std=0.05)
    return layer


def _median_ms(step: Callable[[], torch.Tensor], repeats: int) -> float:
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def run(heads: int, context: int, batch: int, threads: int | None, repeats: int, block_size: int = 16) -> str:
    if threads is not None:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    layer, blocks = _layer(heads), -(-context // block_size)
    caches = (torch.randn(batch * blocks * block_size, 1, MLA.kv_lora_rank, dtype=torch.bfloat16),
              torch.randn(batch * blocks * block_size, 1, MLA.qk_rope_head_dim, dtype=torch.bfloat16))
    meta = DecodeMetadata(torch.zeros(batch, dtype=torch.long), torch.arange(batch * blocks).view(batch, blocks),
                          torch.full((batch,), context), block_size)
    q_nope = torch.randn(batch, heads, MLA.qk_nope_head_dim, dtype=torch.bfloat16)
    q_rot = torch.randn(batch, heads, MLA.qk_rope_head_dim, dtype=torch.bfloat16)
    length = blocks * block_size

    def expanded() -> torch.Tensor:
        latents, rotated = (c.view(-1, block_size, c.shape[-1])[meta.block_table].view(batch, length, -1)
                            for c in caches)
        keys, values = layer.expand(latents, rotated)
        scores = torch.einsum("bhd,blhd->bhl", torch.cat((q_nope, q_rot), -1).float(), keys.float()) * layer.scale
        return torch.einsum("bhl,blhd->bhd", torch.softmax(scores, -1), values.float()).to(torch.bfloat16)

    def absorbed() -> torch.Tensor:
        return mla_decode_attention(q_nope, q_rot, caches, meta, layer.absorbed)

    with torch.inference_mode():
        difference = (expanded().float() - absorbed().float()).abs().max().item()
        rounds: dict[str, list[float]] = {"expanded": [], "absorbed": []}  # alternating which goes first
        for round_ in range(3):
            for name in (("expanded", "absorbed") if round_ % 2 == 0 else ("absorbed", "expanded")):
                rounds[name].append(_median_ms(expanded if name == "expanded" else absorbed, repeats))
    expanded_ms, absorbed_ms = (sorted(rounds[name])[1] for name in ("expanded", "absorbed"))
    return (f"one MLA layer's decode attention: {heads} heads, {batch} sequence(s) of {context} cached tokens, "
            f"bfloat16, {threads} threads (medians of 3 alternating rounds of {repeats})\n"
            f"expanded {expanded_ms:.2f} ms | absorbed {absorbed_ms:.2f} ms | {expanded_ms / absorbed_ms:.1f}x | "
            f"largest output difference {difference:.3g}")
