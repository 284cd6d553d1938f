"""Beam search: the beams transformers' beam search finds, on a transformers-made checkpoint; the
prompt's KV blocks shared through the prefix cache; EOS, length penalty and early stopping on
hand-made logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine import BeamSearchParams, InvalidRequestError, open_engine
from engine.api.beam_search import run_beam_search
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from tests.conftest import engine_config
from tests.model_helpers import save_hf_checkpoint

VOCAB = 512
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_hf_checkpoint(tmp_path_factory, "beam-llama", LlamaConfig, LlamaForCausalLM, CONFIG, seed=3)


def transformers_beams(model, prompt: list[int], width: int, max_tokens: int) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             num_beams=width, num_return_sequences=width, max_new_tokens=max_tokens,
                             do_sample=False, length_penalty=1.0, early_stopping=False)
    return [row[len(prompt):].tolist() for row in out]


def sequence_logprob(model, prompt: list[int], generated: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(generated))


async def test_the_beams_are_transformers_beams_and_share_the_prompts_blocks(llama):
    path, model = llama
    prompts = [[(13 * i + 7) % VOCAB for i in range(40)], [5, 9, 200, 31, 77]]
    params = BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True)
    async with open_engine(engine_config(str(path), dtype="float32")) as engine:
        before = engine.stats()
        outputs = [await engine.beam_search(prompt, params) for prompt in prompts]
        after = engine.stats()
    for prompt, output in zip(prompts, outputs, strict=True):
        ours = [output.output_token_ids(s) for s in output.sequences]
        assert ours == transformers_beams(model, prompt, 4, 6)
        for sequence, generated in zip(output.sequences, ours, strict=True):
            assert sequence.cum_logprob == pytest.approx(sequence_logprob(model, prompt, generated), abs=1e-4)
            assert sequence.finish_reason == "length" and sequence.tokens[:len(prompt)] == prompt
    # Every step of the 40-token prompt's beams finds its first two full blocks cached.
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert hits >= 32 * 4 * 5


async def test_bounds_are_checked_before_any_step(tiny_model_dir):
    async with open_engine(engine_config(tiny_model_dir, max_model_len=64)) as engine:
        with pytest.raises(InvalidRequestError, match="max-logprobs is 20"):
            await engine.beam_search([1, 2, 3], BeamSearchParams(beam_width=11, max_tokens=2))
        with pytest.raises(InvalidRequestError, match="maximum context length is 64"):
            await engine.beam_search([1, 2, 3], BeamSearchParams(beam_width=2, max_tokens=62))
        assert engine.stats().num_running == 0
    with pytest.raises(InvalidRequestError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")


# ---- the search on hand-made logprobs ------------------------------------------------------------
EOS = 0


@dataclass
class ScriptedEngine:
    """Answers each beam step from `table`: the last token of a beam -> {next token: logprob}."""

    table: dict[int, dict[int, float]]
    steps: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.info = type("Info", (), {"eos_token_ids": (EOS,)})()
        self.tokenizer = type("Tok", (), {"decode": staticmethod(lambda ids: " ".join(map(str, ids)))})()

    async def generate_batch(self, prompts, params, request_id, **_):
        self.steps.append(len(prompts))
        for index, prompt in enumerate(prompts):
            options = self.table[prompt["prompt_token_ids"][-1]]
            logprobs = {t: Logprob(lp, rank) for rank, (t, lp) in enumerate(sorted(options.items(),
                                                                                 key=lambda kv: -kv[1]), 1)}
            yield index, RequestOutput(request_id, None, [], [CompletionOutput(0, "", [1], logprobs=[logprobs])],
                                       finished=True)


# From 1: EOS at once (-1.0), or on through 2 (-0.2) or 3 (-0.3); those end badly (EOS -3.0) or go
# on to 4 (-0.1), which ends well (EOS -0.1) or goes on at -2.0 a token.
TABLE = {1: {EOS: -1.0, 2: -0.2, 3: -0.3}, 2: {EOS: -3.0, 4: -0.1}, 3: {EOS: -3.0, 4: -0.1},
         4: {EOS: -0.1, 4: -2.0}}


async def test_eos_ends_beams_and_early_stopping_decides_when_to_stop():
    def params(**options):
        return BeamSearchParams(beam_width=2, max_tokens=8, length_penalty=0.0, **options)  # score: cum logprob

    patient = ScriptedEngine(TABLE)
    output = await run_beam_search(patient, [1], params(), "r")
    assert [s.tokens for s in output.sequences] == [[1, 2, 4], [1, 3, 4]]  # ended by EOS, which is not kept
    assert [s.cum_logprob for s in output.sequences] == pytest.approx([-0.4, -0.5])
    assert [s.finish_reason for s in output.sequences] == ["stop", "stop"] and output.sequences[0].stop_reason == EOS
    # False: after step 2 three beams have ended, but running ones can still beat them; after step 3 not.
    assert patient.steps == [1, 2, 2]
    eager = ScriptedEngine(TABLE)
    first_two = await run_beam_search(eager, [1], params(early_stopping=True), "r")
    assert eager.steps == [1, 2]  # True: as soon as two have ended
    assert [(s.tokens, s.finish_reason) for s in first_two.sequences] == [([1, 2, 4], "length"),
                                                                         ([1, 3, 4], "length")]
    never = ScriptedEngine(TABLE)
    kept = await run_beam_search(never, [1], params(early_stopping="never", include_stop_str_in_output=True), "r")
    assert len(never.steps) == 8 and [s.tokens for s in kept.sequences] == [[1, 2, 4, EOS], [1, 3, 4, EOS]]


async def test_the_length_penalty_favours_longer_beams():
    # Score: cum / len ** penalty; a large penalty divides the longer beam's cost the most.
    table = {1: {EOS: -1.0, 2: -0.5}, 2: {5: -0.6, EOS: -3.0}, 5: {EOS: -0.01, 5: -4.0}}
    short = await run_beam_search(ScriptedEngine(table), [1], BeamSearchParams(1, 4, length_penalty=0.0), "r")
    long = await run_beam_search(ScriptedEngine(table), [1], BeamSearchParams(1, 4, length_penalty=4.0), "r")
    assert short.sequences[0].tokens == [1] and long.sequences[0].tokens == [1, 2, 5]


async def test_completions_and_chat_answer_with_the_beams(tiny_model_dir):
    import openai

    from bench.http import request
    from tests.server_fixtures import running_server

    async with running_server(engine_config(tiny_model_dir)) as server:
        engine = server.state.engine
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        async with client:
            answer = await client.completions.create(
                model=server.state.model_name, prompt=["Once upon a time", "The sea"], n=3, max_tokens=5,
                extra_body={"use_beam_search": True, "length_penalty": 0.5, "ignore_eos": True})
            params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True, length_penalty=0.5)
            expected = [await engine.beam_search(p, params) for p in ("Once upon a time", "The sea")]
            assert [c.text for c in answer.choices] == [s.text for e in expected for s in e.sequences]
            assert [c.index for c in answer.choices] == list(range(6))
            assert answer.usage.completion_tokens == 30
            messages = [{"role": "user", "content": "tell me"}]
            chat = await client.chat.completions.create(model=server.state.model_name, messages=messages, n=2,
                                                        max_tokens=4, extra_body={"use_beam_search": True})
            prompt = await engine.chat_prompt(messages, add_generation_prompt=True)
            beams = await engine.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=4))
            assert [c.message.content for c in chat.choices] == [s.text for s in beams.sequences]
            assert chat.choices[0].message.tool_calls is None
        for path, body, field_name in (
                ("/v1/completions", {"prompt": "x", "stream": True}, "stream"),
                ("/v1/completions", {"prompt": "x", "stop": ["."]}, "stop"),
                ("/v1/completions", {"prompt": "x", "logprobs": 2}, "logprobs"),
                ("/v1/chat/completions/batch", {"messages": [messages]}, "use_beam_search"),
                ("/v1/completions", {"prompt": "x", "early_stopping": "sometimes"}, "early_stopping")):
            refused = await request(server.url, "POST", path, {**body, "use_beam_search": True, "max_tokens": 2})
            assert refused.status == 400 and refused.json()["error"]["param"] == field_name, refused.body
        assert engine.stats().num_running == 0


def test_the_blocking_facade_searches_every_prompt(tiny_model_dir):
    from engine import LLM
    from engine.api.beam_search import beam_score

    llm = LLM(tiny_model_dir, num_kv_blocks=64)
    outputs = llm.beam_search(["Once upon a time", [5, 6, 7]], BeamSearchParams(beam_width=3, max_tokens=4))
    assert [o.prompt_token_ids[:3] for o in outputs][1] == [5, 6, 7] and len(outputs) == 2
    eos = frozenset(llm._tokenizer.eos_token_ids)
    for output in outputs:
        scores = [beam_score(s.tokens, s.cum_logprob, eos, 1.0) for s in output.sequences]
        assert len(scores) == 3 and scores == sorted(scores, reverse=True)
        assert all(s.tokens[:len(output.prompt_token_ids)] == output.prompt_token_ids for s in output.sequences)
