"""gpt-oss against transformers: attention sinks, sliding and full layers, YaRN, the biased router
and the clamped SwiGLU experts with biases, eager and compiled, chunked, prefix-cached, under tensor
parallelism, and in bfloat16."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM

from engine import EngineConfig, open_engine
from engine.config import EplbConfig
from engine.eplb.maps import initial_phy2log
from engine.errors import ModelLoadError
from engine.models.hf_config import parse_decoder_config, read_config_json
from engine.models.loader import load_decoder
from engine.models.moe import ExpertLayout, swiglu_oai
from engine.models.mxfp4 import dequantize_mxfp4
from tests.helpers import final_output, greedy, greedy_together
from tests.model_helpers import decided_prefix, decoder_logits, save_hf_checkpoint, transformers_greedy
from tests.test_compiled_decode import BF16_TIE, compiled_config
from tests.test_compiled_decode import engine_greedy as compiled_greedy
from tests.test_moe_eplb import moe_logits
from tests.test_quantization import INT8_TOLERANCE

VOCAB = 512
WINDOW = 12
OPTIONS = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
    sliding_window=WINDOW, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    # wide weights and a low clamp, so that the clamp bites; YaRN past a short original window
    initializer_range=0.1, swiglu_limit=1.0,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 64, "rope_theta": 10000.0})
# transformers starts every bias at zero and the sinks near it: drawn again so each one counts
REDRAW = ("bias", "sinks")
PROMPTS = [random.Random(7).choices(range(3, VOCAB), k=n) for n in (5, 19, 40)]  # two past the window


def save_gpt_oss(tmp_path_factory, name: str = "gpt-oss", dtype: torch.dtype = torch.float32,
                 redraw: tuple[str, ...] = REDRAW, **overrides):
    path, model = save_hf_checkpoint(tmp_path_factory, name, GptOssConfig, GptOssForCausalLM,
                                     {**OPTIONS, "dtype": dtype, **overrides}, redraw=redraw)
    return path, model.to(dtype)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return save_gpt_oss(tmp_path_factory)


def test_the_config_reads_every_feature_and_refuses_what_it_does_not_implement(gpt_oss):
    path, _ = gpt_oss
    raw = read_config_json(path)
    cfg = parse_decoder_config(raw)
    assert cfg.attention_sinks and cfg.qkv_bias and cfg.o_bias
    assert [cfg.window_of(i) for i in range(2)] == [WINDOW, None]
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "yarn"
    assert cfg.moe is not None and (cfg.moe.router_bias, cfg.moe.expert_bias, cfg.moe.activation) == \
        (True, True, "swigluoai")
    unnamed = parse_decoder_config({k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling")})
    default = GptOssConfig().rope_parameters  # what transformers gives a config that names no scaling
    assert unnamed.rope_scaling is not None and all(unnamed.rope_scaling[key] == default[key] for key in
                                                    ("rope_type", "factor", "beta_fast", "beta_slow", "truncate",
                                                     "original_max_position_embeddings"))
    with pytest.raises(ModelLoadError, match="quantization_config 'bitsandbytes': not implemented for GptOss"):
        parse_decoder_config({**raw, "quantization_config": {"quant_method": "bitsandbytes"}})


def test_the_clamped_swiglu_is_transformers_own():
    gate_up = torch.randn(6, 2 * 8) * 4  # beyond the limit both ways
    experts = GptOssForCausalLM(GptOssConfig(**OPTIONS)).model.layers[0].mlp.experts
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    assert torch.equal(swiglu_oai(gate, up, experts.alpha, experts.limit), experts._apply_gate(gate_up))


@pytest.mark.parametrize("slots", [4, 6])
def test_logits_match_transformers_over_chunks_past_the_window(gpt_oss, slots):
    """Chunked prefill, a decode and the rest, 30 tokens against a window of 12; with 6 slots two
    experts have a replica, biases and all."""
    path, hf_model = gpt_oss
    token_ids = random.Random(1).choices(range(VOCAB), k=30)
    with torch.no_grad():
        expected = hf_model(torch.tensor([token_ids])).logits[0].float()
    logits, _ = moe_logits(path, token_ids, ExpertLayout(4, slots))
    assert torch.allclose(logits, expected, atol=1e-4, rtol=1e-4), (logits - expected).abs().max()


async def test_greedy_tokens_eager_and_compiled_chunked_and_prefix_cached_equal_transformers(gpt_oss):
    path, hf_model = gpt_oss
    expected = transformers_greedy(hf_model, PROMPTS, 24)
    # chunks of 16 tokens cut the 40-token prompt; the prompts run twice, the second time from the prefix cache
    base = dict(model=str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16,
                enable_prefix_caching=True)
    assert await greedy_together(EngineConfig(**base, enforce_eager=True), PROMPTS + PROMPTS, 24) == expected + expected
    compiled, steps = await compiled_greedy(compiled_config(path, max_num_batched_tokens=16), PROMPTS, 24)
    assert compiled == expected and steps >= 20  # the decodes ran on the compiled graph


async def test_tensor_parallel_2_gives_transformers_greedy_tokens(gpt_oss):
    """Heads, sinks and each expert's intermediate split over two ranks; the down projection's bias
    added once."""
    path, hf_model = gpt_oss
    config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
                          enforce_eager=True)
    assert await greedy_together(config, PROMPTS[1:], 12) == transformers_greedy(hf_model, PROMPTS[1:], 12)


async def test_bfloat16_tokens_agree_with_transformers_bfloat16_up_to_its_first_near_tie(tmp_path_factory):
    """Tokens compared up to transformers' first near tie (top two logits within BF16_TIE of the
    largest): past one, bfloat16 rounding decides, in transformers as in us. At least a third of
    the tokens must be decided, so the test cannot pass by deciding nothing."""
    path, hf_model = save_gpt_oss(tmp_path_factory, "gpt-oss-bf16", torch.bfloat16)
    expected = transformers_greedy(hf_model, PROMPTS, 16)
    decided = [decided_prefix(hf_model, p, e, BF16_TIE) for p, e in zip(PROMPTS, expected, strict=True)]
    assert sum(decided) >= 16 * len(PROMPTS) // 3
    got = await greedy_together(EngineConfig(model=str(path), dtype="bfloat16", num_kv_blocks=64, enforce_eager=True),
                                PROMPTS, 16)
    assert [g[:n] for g, n in zip(got, decided, strict=True)] == [e[:n] for e, n in zip(expected, decided, strict=True)]


async def test_rebalancing_moves_the_experts_biases_with_their_weights(gpt_oss):
    path, hf_model = gpt_oss
    config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, enforce_eager=True, enable_eplb=True,
                          eplb_config=EplbConfig(window_size=4, step_interval=4, num_redundant_experts=2,
                                                 use_async=False))
    async with open_engine(config) as engine:
        tokens = [list((await final_output(engine, prompt, greedy(24, ignore_eos=True))).outputs[0].token_ids)
                  for prompt in PROMPTS]
        placement = engine.core.eplb.placement() if engine.core.eplb else None
        rebalances = engine.stats().eplb.rebalances
    assert rebalances >= 3 and placement != initial_phy2log(2, 4, 6).tolist()
    assert tokens == transformers_greedy(hf_model, PROMPTS, 24)


def test_int8_quantizes_the_experts_and_keeps_their_biases(tmp_path_factory):
    """The router stays in float, and its weights are drawn wide here: with transformers' narrow ones
    two experts' logits come within int8's error of each other, and a token that changes experts
    moves its logits by far more than the kernel's error."""
    path, _ = save_gpt_oss(tmp_path_factory, "gpt-oss-int8", redraw=(*REDRAW, "router.weight"))
    exact, quantized = load_decoder(path, "float32"), load_decoder(path, "float32", quantization="int8")
    assert quantized.moe_layers and all(e.qmethod == "int8" and e.w13_bias is not None for e in quantized.moe_layers)
    assert all(layer.mlp.gate.qmethod is None and layer.qkv_proj.qmethod == "int8" for layer in quantized.layers)
    for prompt in PROMPTS:
        ours, float_logits = (decoder_logits(m, m.embed(torch.tensor(prompt))) for m in (quantized, exact))
        assert (ours - float_logits).abs().max() <= INT8_TOLERANCE * float_logits.abs().max()


def random_mxfp4(rows_shape: tuple[int, ...], columns: int, generator: torch.Generator):
    """MXFP4 blocks and scales for a [*rows_shape, columns] weight: random codes, exponents near 2**-4."""
    blocks = torch.randint(0, 256, (*rows_shape, columns // 32, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(121, 126, (*rows_shape, columns // 32), dtype=torch.uint8, generator=generator)
    return blocks, scales


def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4((3, 40), 64, torch.Generator().manual_seed(0))
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), convert_moe_packed_tensors(blocks, scales))


@pytest.fixture(scope="module")
def mxfp4_pair(tmp_path_factory):
    """The same gpt-oss as an MXFP4 checkpoint (experts as blocks and scales, as OpenAI publishes it)
    and as a float one (those experts dequantized by transformers), and transformers' model of it."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    intermediate = 64  # MXFP4 groups 32 inputs: each projection's inputs a multiple of 32
    float_dir, hf_model = save_gpt_oss(tmp_path_factory, "gpt-oss-mxfp4-float", intermediate_size=intermediate)
    generator, packed = torch.Generator().manual_seed(3), {}
    with torch.no_grad():
        for index, layer in enumerate(hf_model.model.layers):
            experts, prefix = layer.mlp.experts, f"model.layers.{index}.mlp.experts"
            for name, (rows, columns) in {"gate_up_proj": (2 * intermediate, OPTIONS["hidden_size"]),
                                          "down_proj": (OPTIONS["hidden_size"], intermediate)}.items():
                blocks, scales = random_mxfp4((OPTIONS["num_local_experts"], rows), columns, generator)
                getattr(experts, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed[f"{prefix}.{name}_blocks"], packed[f"{prefix}.{name}_scales"] = blocks, scales
    hf_model.save_pretrained(float_dir)
    mxfp4_dir = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    tensors = {name: tensor for name, tensor in load_file(float_dir / "model.safetensors").items()
               if not name.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**tensors, **packed}, mxfp4_dir / "model.safetensors")
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (mxfp4_dir / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(float_dir / name, mxfp4_dir / name)
    return mxfp4_dir, float_dir, hf_model


async def test_an_mxfp4_checkpoint_loads_the_experts_transformers_dequantizes(mxfp4_pair, tmp_path):
    mxfp4_dir, float_dir, hf_model = mxfp4_pair
    ours, reference = load_decoder(mxfp4_dir, "float32"), load_decoder(float_dir, "float32")
    for mine, theirs in zip(ours.moe_layers, reference.moe_layers, strict=True):
        assert torch.equal(mine.w13, theirs.w13) and torch.equal(mine.w2, theirs.w2)
    config = EngineConfig(model=str(mxfp4_dir), dtype="float32", num_kv_blocks=64, enforce_eager=True)
    assert await greedy_together(config, PROMPTS[1:], 12) == transformers_greedy(hf_model, PROMPTS[1:], 12)
    stored = json.loads((mxfp4_dir / "config.json").read_text())
    llama = {**{key: value for key, value in stored.items() if key != "sliding_window"},
             "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    with pytest.raises(ModelLoadError, match="'mxfp4': not implemented for LlamaForCausalLM"):
        load_decoder(tmp_path, "float32")


@pytest.mark.parametrize("fast", [True, False])
def test_sink_attention_equals_the_written_out_softmax_fast_or_in_query_blocks(monkeypatch, fast):
    """On CPU the flash kernel's log-sum-exp scales its output by the keys' share; elsewhere the
    softmax is written out a block of queries at a time (3 here): both equal the whole softmax with
    the sink written out at once."""
    import engine.models.attention as attention

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=generator) for shape in ((2, 4, 10, 8), (2, 2, 12, 8), (2, 2, 12, 8)))
    allowed = torch.rand(2, 1, 10, 12, generator=generator) > 0.3
    allowed[..., 0] = True
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    sinks = torch.randn(4, generator=generator)
    whole = attention._written_out_sink_attention(q, k, v, mask, 0.3, sinks)
    if not fast:
        monkeypatch.setattr(attention, "_FLASH_WITH_LSE", None)
        monkeypatch.setattr(attention, "SINK_QUERY_BLOCK", 3)
    assert torch.allclose(attention.sink_attention(q, k, v, mask, 0.3, sinks), whole, atol=1e-5)
