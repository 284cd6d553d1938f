"""Sliding-window attention (Mistral): every attention form the engine runs takes the window, each
checked against attention written out one query at a time; configs that ask for a window trio-llm
does not implement are refused by name. Greedy tokens against transformers' are checked with the
other architectures (test_reference_transformers, test_compiled_decode)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
import trio

from engine import EngineConfig, open_engine
from engine.errors import ModelLoadError
from engine.models.attention import (
    DecodeMetadata,
    SequenceChunk,
    build_metadata,
    gathered_decode_attention,
    paged_attention,
    paged_decode_attention,
    write_kv,
)
from engine.models.hf_config import parse_decoder_config
from tests.helpers import final_output, greedy
from tests.model_helpers import save_hf_checkpoint, transformers_greedy
from tests.test_reference_transformers import COMMON, FAMILIES, VOCAB

WINDOW, BLOCK, HEADS, KV_HEADS, DIM = 5, 4, 4, 2, 16  # a head size our kernels take


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: int) -> torch.Tensor:
    """One query at `position` over the keys of positions (position - WINDOW, position]."""
    lo = max(0, position - WINDOW + 1)
    k = keys[lo:position + 1].repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
    v = values[lo:position + 1].repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
    return F.scaled_dot_product_attention(q[:, None], k, v, scale=DIM ** -0.5)[:, 0]


@pytest.mark.parametrize("threads", [1, 2])  # one thread: where our kernels would run, and must not
def test_every_attention_form_attends_within_the_window(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        attention_forms_within_the_window()
    finally:
        torch.set_num_threads(before)


def attention_forms_within_the_window() -> None:
    rng = random.Random(0)
    lengths = [3, 5, 9, 14]  # shorter than, equal to and longer than the window
    scattered = rng.sample(range(40), 4 * len(lengths))  # no block shared
    tables = [scattered[4 * i:4 * i + 4] for i in range(len(lengths))]
    generator = torch.Generator().manual_seed(0)  # not the global one: other tests move it
    keys = [torch.randn(n, KV_HEADS, DIM, generator=generator) for n in lengths]
    values = [torch.randn(n, KV_HEADS, DIM, generator=generator) for n in lengths]
    queries = [torch.randn(n, HEADS, DIM, generator=generator) for n in lengths]
    cache = (torch.zeros(40 * BLOCK, KV_HEADS, DIM), torch.zeros(40 * BLOCK, KV_HEADS, DIM))

    # Prompts: each sequence's first length - 1 tokens in one step (fresh), chunked as a batch.
    chunks = [SequenceChunk(0, n - 1, t) for n, t in zip(lengths, tables, strict=True)]
    meta = build_metadata(chunks, BLOCK, torch.device("cpu"))
    q, k, v = (torch.cat([x[:n - 1] for x, n in zip(xs, lengths, strict=True)]) for xs in (queries, keys, values))
    write_kv(*cache, meta.slot_mapping, k, v)
    prompts = paged_attention(q, k, v, *cache, meta, DIM ** -0.5, WINDOW)
    want = torch.cat([torch.stack([reference(x[p], ks, vs, p) for p in range(n - 1)])
                      for x, ks, vs, n in zip(queries, keys, values, lengths, strict=True)])
    torch.testing.assert_close(prompts, want)
    alone = build_metadata([chunks[-1]], BLOCK, torch.device("cpu"))  # one fresh prompt
    last = slice(sum(lengths[:-1]) - 3, None)
    torch.testing.assert_close(paged_attention(q[last], k[last], v[last], *cache, alone, DIM ** -0.5, WINDOW),
                               want[last])

    # Then each one's last token as a decode: the eager group, the compiled graph's and the CUDA graph's forms.
    decodes = [SequenceChunk(n - 1, 1, t) for n, t in zip(lengths, tables, strict=True)]
    meta = build_metadata(decodes, BLOCK, torch.device("cpu"))
    q, k, v = (torch.stack([x[n - 1] for x, n in zip(xs, lengths, strict=True)]) for xs in (queries, keys, values))
    write_kv(*cache, meta.slot_mapping, k, v)
    want = torch.stack([reference(x[n - 1], ks, vs, n - 1)
                        for x, ks, vs, n in zip(queries, keys, values, lengths, strict=True)])
    torch.testing.assert_close(paged_attention(q, k, v, *cache, meta, DIM ** -0.5, WINDOW), want)
    full = paged_attention(q, k, v, *cache, meta, DIM ** -0.5)  # the same step's full attention, for a global layer
    # Differs where the window cuts, only there: the same sums in another order (float32 rounding).
    assert not torch.allclose(full, want) and torch.allclose(full[:2], want[:2], rtol=1e-5, atol=1e-6)
    graph_meta = DecodeMetadata(meta.slot_mapping, torch.tensor(tables), torch.tensor(lengths), BLOCK)
    for form in (paged_decode_attention, gathered_decode_attention):
        torch.testing.assert_close(form(q, *cache, graph_meta, DIM ** -0.5, WINDOW), want)


def test_windows_trio_llm_does_not_implement_are_refused_by_name():
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    mistral = parse_decoder_config({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 7})
    assert mistral.sliding_window == 7
    assert parse_decoder_config({**base, "architectures": ["MistralForCausalLM"], "sliding_window": None}) \
        .sliding_window is None  # Mistral 7B v0.2 and later: full attention
    qwen2 = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}
    assert parse_decoder_config(qwen2).sliding_window is None  # transformers ignores it too
    for raw, said in ((dict(qwen2, use_sliding_window=True), "use_sliding_window"),
                      ({**base, "architectures": ["LlamaForCausalLM"], "sliding_window": 8}, "sliding_window"),
                      ({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 0}, "positive integer")):
        with pytest.raises(ModelLoadError, match=said):
            parse_decoder_config(raw)


async def test_an_engine_releases_the_blocks_behind_the_window_and_still_gives_transformers_tokens(
        tmp_path_factory):
    """A Mistral whose window is 12, blocks of 4: four sequences decoding to 72 tokens each need 72
    blocks with full attention; a cache of 24 serves them at once, reusing released blocks (whose
    stale contents attention masks out), token for token with transformers."""
    config_cls, model_cls, extra = FAMILIES["mistral"]
    path, hf_model = save_hf_checkpoint(tmp_path_factory, "mistral-release", config_cls, model_cls,
                                        {**COMMON, **extra})
    rng = random.Random(7)
    prompts = [rng.choices(range(3, VOCAB), k=n) for n in (8, 14, 20, 30)]
    expected = transformers_greedy(hf_model, prompts, 72 - 30)
    config = EngineConfig(model=str(path), dtype="float32", block_size=4, num_kv_blocks=24, enforce_eager=True,
                          max_num_seqs=4)
    got = {}
    async with open_engine(config) as engine:
        async def run(i: int) -> None:
            out = await final_output(engine, prompts[i], greedy(72 - 30, ignore_eos=True))
            got[i] = list(out.outputs[0].token_ids)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(run, i)
        assert engine.stats().num_preemptions == 0  # all four held at once: released blocks made the room
    assert [got[i] for i in range(len(prompts))] == expected
