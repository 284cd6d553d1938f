"""DeepSeek-V3 against transformers: multi-head latent attention over a cache of latents, YaRN with
its softmax scale, dense first layers, shared experts and grouped top-k routing with the correction
bias; eager and compiled, chunked and prefix-cached, under tensor parallelism, with EPLB, and in
bfloat16."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from engine import EngineConfig, open_engine
from engine.config import EplbConfig
from engine.eplb.maps import initial_phy2log
from engine.errors import ModelLoadError
from engine.models.hf_config import parse_decoder_config, read_config_json
from engine.models.loader import load_decoder
from engine.models.mla import FloatProjection
from engine.models.moe import ExpertLayout
from tests.helpers import final_output, greedy, greedy_together
from tests.model_helpers import decided_prefix, decoder_logits, save_hf_checkpoint, transformers_greedy
from tests.test_compiled_decode import BF16_TIE, compiled_config
from tests.test_compiled_decode import engine_greedy as compiled_greedy
from tests.test_moe_eplb import moe_logits

VOCAB = 512
EXPERTS = 8
OPTIONS = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=EXPERTS, num_experts_per_tok=2, n_group=4,
    topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=None, initializer_range=0.1,
    # YaRN past a short original window, with DeepSeek's mscale in the softmax scale
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0})
# transformers zeroes the routing correction bias: drawn again so the grouped top-k depends on it
REDRAW = ("e_score_correction_bias",)
PROMPTS = [random.Random(5).choices(range(3, VOCAB), k=n) for n in (5, 19, 40)]


def save_deepseek(tmp_path_factory, name: str = "deepseek-v3", dtype: torch.dtype = torch.float32, **overrides):
    path, model = save_hf_checkpoint(tmp_path_factory, name, DeepseekV3Config, DeepseekV3ForCausalLM,
                                     {**OPTIONS, "dtype": dtype, **overrides}, redraw=REDRAW)
    return path, model.to(dtype)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return save_deepseek(tmp_path_factory)


def test_the_cache_holds_the_latent_not_per_head_keys_and_values(deepseek):
    path, _ = deepseek
    cfg = parse_decoder_config(read_config_json(path))
    assert cfg.mla is not None and cfg.moe is not None and cfg.moe.sparse_layers == (1, 2)
    keys, values = load_decoder(path, "float32").kv_cache_shapes(1)
    per_token = keys[1] * keys[2] + values[1] * values[2]
    assert per_token == OPTIONS["kv_lora_rank"] + OPTIONS["qk_rope_head_dim"] == 40  # DeepSeek's
    per_head_kv = 2 * OPTIONS["num_attention_heads"] * (OPTIONS["qk_nope_head_dim"] + OPTIONS["qk_rope_head_dim"])
    assert per_token * 4 < per_head_kv  # 40 against 192 values a token a layer


@pytest.mark.parametrize("slots", [EXPERTS, EXPERTS + 2])
def test_logits_match_transformers_over_chunks(deepseek, slots):
    """Chunked prefill, a decode and the rest, the latents read back from the cache; with spare
    slots two experts have a replica."""
    path, hf_model = deepseek
    token_ids = random.Random(1).choices(range(VOCAB), k=30)
    with torch.no_grad():
        expected = hf_model(torch.tensor([token_ids])).logits[0].float()
    logits, _ = moe_logits(path, token_ids, ExpertLayout(EXPERTS, slots))
    assert torch.allclose(logits, expected, atol=1e-4, rtol=1e-4), (logits - expected).abs().max()


def test_without_a_query_projection_rank_and_without_interleaved_rope(tmp_path_factory):
    path, hf_model = save_deepseek(tmp_path_factory, "deepseek-plain-q", q_lora_rank=None, rope_interleave=False)
    token_ids = random.Random(2).choices(range(VOCAB), k=20)
    with torch.no_grad():
        expected = hf_model(torch.tensor([token_ids])).logits[0].float()
    logits, _ = moe_logits(path, token_ids, ExpertLayout(EXPERTS, EXPERTS))
    assert torch.allclose(logits, expected, atol=1e-4, rtol=1e-4), (logits - expected).abs().max()


async def test_greedy_tokens_eager_and_compiled_chunked_and_prefix_cached_equal_transformers(deepseek):
    path, hf_model = deepseek
    expected = transformers_greedy(hf_model, PROMPTS, 24)
    base = dict(model=str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16,
                enable_prefix_caching=True)
    assert await greedy_together(EngineConfig(**base, enforce_eager=True), PROMPTS + PROMPTS, 24) == expected + expected
    compiled, steps = await compiled_greedy(compiled_config(path, max_num_batched_tokens=16), PROMPTS, 24)
    assert compiled == expected and steps >= 20  # the decodes ran on the compiled graph


async def test_tensor_parallel_2_gives_transformers_greedy_tokens(deepseek):
    """Heads split over two ranks (q_b_proj, kv_b_proj, o_proj), the latent whole on each."""
    path, hf_model = deepseek
    config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
                          enforce_eager=True)
    assert await greedy_together(config, PROMPTS[1:], 12) == transformers_greedy(hf_model, PROMPTS[1:], 12)


async def test_rebalancing_changes_no_token(deepseek):
    path, hf_model = deepseek
    config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, enforce_eager=True, enable_eplb=True,
                          eplb_config=EplbConfig(window_size=4, step_interval=4, num_redundant_experts=2,
                                                 use_async=False))
    async with open_engine(config) as engine:
        tokens = [list((await final_output(engine, prompt, greedy(24, ignore_eos=True))).outputs[0].token_ids)
                  for prompt in PROMPTS]
        placement = engine.core.eplb.placement() if engine.core.eplb else None
        rebalances = engine.stats().eplb.rebalances
    assert rebalances >= 3 and placement != initial_phy2log(2, EXPERTS, EXPERTS + 2).tolist()
    assert tokens == transformers_greedy(hf_model, PROMPTS, 24)


async def test_bfloat16_tokens_agree_with_transformers_bfloat16_up_to_its_first_near_tie(tmp_path_factory):
    """Tokens compared up to transformers' first near tie (top two logits within BF16_TIE of the
    largest): past one, bfloat16 rounding decides, in transformers as in us. This model's margins
    are narrow (11 of the 48 tokens decided): at least 8 must be, so the test cannot pass by
    deciding nothing."""
    path, hf_model = save_deepseek(tmp_path_factory, "deepseek-bf16", torch.bfloat16)
    expected = transformers_greedy(hf_model, PROMPTS, 16)
    decided = [decided_prefix(hf_model, p, e, BF16_TIE) for p, e in zip(PROMPTS, expected, strict=True)]
    assert sum(decided) >= 8
    got = await greedy_together(EngineConfig(model=str(path), dtype="bfloat16", num_kv_blocks=64, enforce_eager=True),
                                PROMPTS, 16)
    assert [g[:n] for g, n in zip(got, decided, strict=True)] == [e[:n] for e, n in zip(expected, decided, strict=True)]


# MLA chains two low-rank projections on each side of its norms (q_a, q_b; kv_a, kv_b): int8's
# rounding passes through more matmuls than a Llama layer's, and moves a logit by up to 4.4% of
# the largest here (measured), against 3% (INT8_TOLERANCE) there.
MLA_INT8_TOLERANCE = 0.05


def test_int8_quantizes_the_latent_projections_within_tolerance_and_the_experts(deepseek, tmp_path_factory):
    """The logits are compared on a model whose layers are all dense: with experts, a token whose
    routing int8 tips to other experts moves by far more than the kernel's error (the MoE families'
    experts are compared in tests/test_quantization.py and tests/test_gpt_oss.py)."""
    path, _ = save_deepseek(tmp_path_factory, "deepseek-int8", first_k_dense_replace=OPTIONS["num_hidden_layers"])
    exact, quantized = load_decoder(path, "float32"), load_decoder(path, "float32", quantization="int8")
    attention = quantized.layers[0].self_attn
    assert attention.q_b_proj.qmethod == attention.kv_a_proj_with_mqa.qmethod == attention.o_proj.qmethod == "int8"
    assert isinstance(attention.kv_b_proj, FloatProjection)  # read as matrices by the absorbed decode
    for prompt in PROMPTS:
        ours, float_logits = (decoder_logits(m, m.embed(torch.tensor(prompt))) for m in (quantized, exact))
        assert (ours - float_logits).abs().max() <= MLA_INT8_TOLERANCE * float_logits.abs().max()
    moe = load_decoder(deepseek[0], "float32", quantization="int8")
    assert moe.moe_layers and all(e.qmethod == "int8" for e in moe.moe_layers)
    assert all(layer.mlp.gate.qmethod is None for layer in moe.layers[1:])  # the routers stay float


def test_the_multi_token_prediction_layer_after_the_last_is_not_loaded(deepseek, tmp_path):
    """DeepSeek-V3's checkpoints carry their MTP module as one more layer (`model.layers.<num_hidden_layers>`);
    serving the model does not use it, as vLLM's main model does not."""
    from safetensors.torch import load_file, save_file

    path, _ = deepseek
    tensors = load_file(path / "model.safetensors")
    mtp = f"model.layers.{OPTIONS['num_hidden_layers']}"
    tensors.update({f"{mtp}.eh_proj.weight": torch.zeros(64, 128), f"{mtp}.enorm.weight": torch.ones(64)})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / name, tmp_path / name)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert len(load_decoder(tmp_path, "float32").layers) == OPTIONS["num_hidden_layers"]


async def test_lora_is_refused_by_name_not_failed_inside(deepseek):
    path, _ = deepseek
    with pytest.raises(ModelLoadError, match="--enable-lora: not implemented for DeepseekV3ForCausalLM"):
        async with open_engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, enforce_eager=True,
                                            enable_lora=True)):
            pass  # pragma: no cover - never reached


async def test_two_pipeline_stages_give_transformers_greedy_tokens(deepseek):
    """Each stage holds its own layers' latent caches (the dense first layer on one stage, the MoE
    layers split)."""
    path, hf_model = deepseek
    config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, pipeline_parallel_size=2,
                          enforce_eager=True)
    assert await greedy_together(config, PROMPTS[1:], 12) == transformers_greedy(hf_model, PROMPTS[1:], 12)
