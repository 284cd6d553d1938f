"""Numerical reference: tiny random checkpoints made by transformers itself, compared with its own logits."""

from __future__ import annotations

import random

import pytest
import torch
import trio
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from engine import EngineConfig, open_engine
from engine.models.loader import load_decoder
from tests.helpers import final_output, greedy
from tests.model_helpers import paged_logits, save_hf_checkpoint

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}, rope_theta=5000.0)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32)),
    # a window shorter than most prompts here, so chunks, decodes and the compiled graphs all cut it
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=12, rope_theta=5000.0)),
    # one sliding and one global layer, each with its rope base, the global one scaled; soft-capped logits
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        head_dim=16, query_pre_attn_scalar=32, sliding_window=12, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}},
        final_logit_softcapping=30.0, pad_token_id=None)),
    # fused qkv and gate_up in the checkpoint, half of each head rotated, LongRoPE (inside its
    # original window here: the short factors; test_longrope_* runs past it) and a sliding window
    "phi3": (Phi3Config, Phi3ForCausalLM, dict(
        partial_rotary_factor=0.5, original_max_position_embeddings=256, sliding_window=20, pad_token_id=None,
        initializer_range=0.1,  # wider logit margins: at 0.02 bfloat16 near-ties left too few tokens decided
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.2, 2.0, 3.0],
                      "long_factor": [1.0, 3.0, 6.0, 12.0]})),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_checkpoint(request, tmp_path_factory):
    config_cls, model_cls, extra = FAMILIES[request.param]
    return save_hf_checkpoint(tmp_path_factory, request.param, config_cls, model_cls, {**COMMON, **extra})


def _our_logits(model_dir, token_ids: list[int], chunks: list[tuple[int, int]]) -> torch.Tensor:
    """Run our model over the paged cache in the given (start, end) chunks; returns logits [T, V]."""
    blocks = random.Random(0).sample(range(64), 64)  # scattered block table
    return paged_logits(load_decoder(model_dir, "float32"), token_ids, chunks, blocks)


def test_logits_match_transformers_over_chunked_prefill_and_decode(hf_checkpoint):
    path, hf_model = hf_checkpoint
    token_ids = random.Random(1).choices(range(VOCAB), k=40)
    with torch.no_grad():
        expected = hf_model(torch.tensor([token_ids])).logits[0].float()
    ours = _our_logits(path, token_ids, [(0, 17), (17, 18), (18, 31), (31, 32), (32, 40)])
    assert torch.allclose(ours, expected, atol=1e-4, rtol=1e-4), (ours - expected).abs().max()


async def test_greedy_batch_of_mixed_lengths_is_token_identical(hf_checkpoint):
    path, hf_model = hf_checkpoint
    rng = random.Random(2)
    prompts = [rng.choices(range(3, VOCAB), k=n) for n in (3, 11, 17, 29, 40, 64)]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            generated = hf_model.generate(torch.tensor([prompt]),
                                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                          max_new_tokens=32, do_sample=False)
            expected.append(generated[0, len(prompt):].tolist())
    got = {}
    # Eager: the compiled graphs of every family are checked against transformers in
    # test_compiled_decode, and compiling each family twice cost the suite ~2 minutes cold.
    config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=48,
                          enforce_eager=True)
    async with open_engine(config) as engine:
        async def run(i):
            got[i] = (await final_output(engine, prompts[i], greedy(32, ignore_eos=True))).outputs[0].token_ids

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(run, i)
    assert [got[i] for i in range(len(prompts))] == expected


def test_longrope_past_the_original_window_is_transformers_long_rope(tmp_path_factory):
    """Phi-3's LongRoPE with a context past its original window (64 here): the long factors and the
    attention factor, as transformers computes a sequence that long, the engine's cache filled in
    chunks and decodes."""
    config_cls, model_cls, extra = FAMILIES["phi3"]
    path, hf_model = save_hf_checkpoint(tmp_path_factory, "phi3-longrope", config_cls, model_cls,
                                        {**COMMON, **extra, "original_max_position_embeddings": 64})
    token_ids = random.Random(1).choices(range(VOCAB), k=80)
    with torch.no_grad():
        expected = hf_model(torch.tensor([token_ids])).logits[0].float()
    ours = _our_logits(path, token_ids, [(0, 17), (17, 64), (64, 65), (65, 80)])
    assert torch.allclose(ours, expected, atol=1e-4, rtol=1e-4), (ours - expected).abs().max()


def test_yarn_as_qwen_configures_it_is_transformers_yarn(tmp_path_factory):
    """YaRN with its correction range truncated (the default; gpt-oss's untruncated one is
    tests/test_gpt_oss.py's) and the attention factor from the scaling factor, past the original window."""
    config_cls, model_cls, extra = FAMILIES["qwen2"]
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    path, hf_model = save_hf_checkpoint(tmp_path_factory, "qwen2-yarn", config_cls, model_cls,
                                        {**COMMON, **extra, "rope_parameters": yarn})
    token_ids = random.Random(1).choices(range(VOCAB), k=60)
    with torch.no_grad():
        expected = hf_model(torch.tensor([token_ids])).logits[0].float()
    ours = _our_logits(path, token_ids, [(0, 17), (17, 40), (40, 41), (41, 60)])
    assert torch.allclose(ours, expected, atol=1e-4, rtol=1e-4), (ours - expected).abs().max()
