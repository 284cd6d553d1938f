"""MoE models against transformers, and expert load balancing changing placement but no output:
in one process, and with expert parallelism over two worker processes."""

from __future__ import annotations

import random

import pytest
import torch
import trio
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from engine import EngineConfig, open_engine
from engine import testing as probes
from engine.config import EplbConfig
from engine.eplb.maps import initial_phy2log
from engine.models.loader import load_decoder
from engine.models.moe import ExpertLayout
from engine.models.tiny import TinyModelSpec, make_model
from tests.helpers import final_output, greedy
from tests.model_helpers import decoder_logits, paged_logits, save_hf_checkpoint, transformers_greedy

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
              num_experts_per_tok=2)
FAMILIES = {
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=4)),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(num_experts=4, moe_intermediate_size=48,
                                                             norm_topk_prob=True, head_dim=32)),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(num_experts=4, moe_intermediate_size=48,
                                                             shared_expert_intermediate_size=64)),
}


def hf_moe(tmp_path_factory, family: str):
    config_cls, model_cls, extra = FAMILIES[family]
    return save_hf_checkpoint(tmp_path_factory, family, config_cls, model_cls, {**COMMON, **extra})


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def any_moe(request, tmp_path_factory):
    return hf_moe(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return hf_moe(tmp_path_factory, "mixtral")


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return hf_moe(tmp_path_factory, "qwen3_moe")


PROMPTS = [random.Random(i).choices(range(3, VOCAB), k=9 + 7 * i) for i in range(4)]


def hf_greedy(model, max_tokens: int = 24) -> list[list[int]]:
    return transformers_greedy(model, PROMPTS, max_tokens)


async def our_greedy(config: EngineConfig, max_tokens: int = 24):
    """Greedy tokens for PROMPTS run together, the engine's EPLB stats, and each rank's placement."""
    got: dict[int, list[int]] = {}
    async with open_engine(config) as engine:
        async def run(i):
            output = await final_output(engine, PROMPTS[i], greedy(max_tokens, ignore_eos=True))
            got[i] = output.outputs[0].token_ids

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(run, i)
        placements = await engine.core.executor.collective_rpc(probes.expert_placement)
        stats = engine.stats().eplb
        engine_view = engine.core.eplb.placement() if engine.core.eplb else None
    return [got[i] for i in range(len(PROMPTS))], stats, placements, engine_view


def moe_logits(path, token_ids: list[int], layout: ExpertLayout):
    """Our logits [T, V] over `token_ids` in chunks (a chunked prefill, a decode, the rest) with
    the experts held as `layout` says, and the model (its expert load counted)."""
    model = load_decoder(path, "float32", experts=layout)
    return paged_logits(model, token_ids, [(0, 13), (13, 14), (14, len(token_ids))], list(range(64))), model


@pytest.mark.parametrize("slots", [4, 6])
def test_logits_match_transformers_with_and_without_redundant_experts(any_moe, slots):
    path, hf_model = any_moe
    token_ids = random.Random(1).choices(range(VOCAB), k=30)
    with torch.no_grad():
        expected = hf_model(torch.tensor([token_ids])).logits[0].float()
    logits, model = moe_logits(path, token_ids, ExpertLayout(4, slots))
    assert torch.allclose(logits, expected, atol=1e-4, rtol=1e-4)
    load = model.take_expert_load()
    assert load.shape == (2, slots) and int(load.sum()) == 2 * 30 * 2  # layers x tokens x top-k
    if slots == 6:
        assert int(load[:, 4:].sum()) > 0  # the replicas in the spare slots carry tokens too


async def test_async_rebalancing_in_one_process_changes_no_token(mixtral):
    path, hf_model = mixtral
    config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, enable_eplb=True,
                          eplb_config=EplbConfig(window_size=4, step_interval=5, num_redundant_experts=2))
    tokens, stats, placements, engine_view = await our_greedy(config)
    assert tokens == hf_greedy(hf_model)
    assert stats.rebalances >= 1 and stats.experts_moved > 0
    assert placements[0] != initial_phy2log(2, 4, 6).tolist()  # the experts did move...
    assert placements[0] == engine_view  # ...and the worker routes with what the engine committed


async def test_synchronous_rebalancing_changes_no_token(mixtral):
    path, hf_model = mixtral
    config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, enable_eplb=True,
                          eplb_config=EplbConfig(window_size=4, step_interval=5, num_redundant_experts=2,
                                                 use_async=False))
    tokens, stats, placements, engine_view = await our_greedy(config)
    assert tokens == hf_greedy(hf_model)
    assert stats.rebalances >= 3 and not stats.rebalancing
    assert placements[0] == engine_view


async def test_expert_parallel_over_two_workers_with_redundant_experts(qwen3_moe):
    path, hf_model = qwen3_moe
    config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
                          enable_expert_parallel=True, enable_eplb=True,
                          eplb_config=EplbConfig(window_size=4, step_interval=4, num_redundant_experts=2))
    tokens, stats, placements, engine_view = await our_greedy(config)
    assert tokens == hf_greedy(hf_model)
    assert stats.rebalances >= 1
    assert placements[0] == placements[1] == engine_view  # every rank routes the same way
    assert engine_view != initial_phy2log(2, 4, 6).tolist()


@pytest.fixture(scope="module")
def skewed_mixtral(tmp_path_factory):
    spec = TinyModelSpec(arch="mixtral", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=64, vocab=512,
                         max_positions=512, experts=8, top_k=2)
    return make_model(tmp_path_factory.mktemp("models") / "skewed-mixtral", spec)


async def test_rebalancing_a_skewed_load_evens_the_ranks(skewed_mixtral):
    """One prompt over and over favours a few experts; after a rebalance the two ranks' loads are
    more even than before it."""
    config = EngineConfig(model=str(skewed_mixtral), num_kv_blocks=64, tensor_parallel_size=2,
                          enable_expert_parallel=True, enable_eplb=True,
                          eplb_config=EplbConfig(window_size=20, step_interval=20, use_async=False))
    prompt = list(range(40, 56))
    async with open_engine(config) as engine:
        await final_output(engine, prompt, greedy(12, ignore_eos=True))
        before = engine.stats().eplb
        await final_output(engine, prompt, greedy(40, ignore_eos=True))
        after = engine.stats().eplb
    assert before.rebalances == 0 and after.rebalances >= 1
    assert min(before.balancedness) < 0.9, before  # the workload is skewed to begin with
    assert sum(after.balancedness) > sum(before.balancedness), (before, after)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_make_model_writes_moe_checkpoints_transformers_reads_the_same(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    spec = TinyModelSpec(arch=arch, layers=2, hidden=64, heads=4, kv_heads=2, intermediate=32, vocab=300,
                         experts=4, top_k=2)
    path = make_model(tmp_path / arch, spec)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_decoder(path, "float32")
    assert ours.config.moe is not None and ours.config.moe.num_experts == 4
    token_ids = list(range(5, 25))
    with torch.no_grad():
        expected = hf_model(torch.tensor([token_ids])).logits[0]
        got = decoder_logits(ours, ours.embed(torch.tensor(token_ids)))
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
