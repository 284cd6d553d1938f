"""The engine end to end on a tiny random checkpoint: sampling, stops, logprobs, batching, bad input."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from engine import InvalidRequestError, RequestOutputKind, SamplingParams, open_engine
from tests.conftest import engine_config
from tests.helpers import final_output, greedy

PROMPT = "The scheduler admits waiting requests"


async def test_greedy_generation_finishes_by_length(engine):
    out = await final_output(engine, PROMPT, greedy(12))
    completion = out.outputs[0]
    assert len(completion.token_ids) == 12 and completion.finish_reason == "length"
    assert out.prompt == PROMPT and out.prompt_token_ids == engine.tokenizer.encode(PROMPT)
    assert completion.text == engine.tokenizer.decode(completion.token_ids)


async def test_batching_does_not_change_greedy_output(engine):
    alone = await final_output(engine, PROMPT, greedy(20))
    results = {}

    async def run(i, prompt):
        results[i] = await final_output(engine, prompt, greedy(20))

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(run, i, PROMPT if i == 3 else f"{i} other prompt of another length " * (i + 1))
    assert results[3].outputs[0].token_ids == alone.outputs[0].token_ids


async def test_same_seed_same_output_whatever_else_is_in_the_batch(engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24)
    alone = await final_output(engine, PROMPT, params)
    results = {}

    async def run(i, p):
        results[i] = await final_output(engine, PROMPT if i == 0 else f"noise {i}", p)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, 0, params)
        for i in range(1, 6):
            nursery.start_soon(run, i, SamplingParams(temperature=1.0, seed=i, max_tokens=30))
    assert results[0].outputs[0].token_ids == alone.outputs[0].token_ids
    other_seed = await final_output(engine, PROMPT, SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=24))
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


async def test_n_samples_come_back_together_and_differ(engine):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    out = await final_output(engine, PROMPT, params)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all(c.finish_reason == "length" for c in out.outputs)


async def test_stop_string_ends_generation_and_is_not_in_the_text(engine):
    full = (await final_output(engine, PROMPT, greedy(30))).outputs[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    out = (await final_output(engine, PROMPT, greedy(30, stop=[stop]))).outputs[0]
    assert out.text == full[:full.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = (await final_output(engine, PROMPT, greedy(30, stop=[stop], include_stop_str_in_output=True))).outputs[0]
    assert kept.text == full[:full.index(stop) + len(stop)]


async def test_streamed_deltas_never_show_part_of_a_stop_string(engine):
    full = (await final_output(engine, PROMPT, greedy(30))).outputs[0].text
    stop = full[20:26]
    params = greedy(30, stop=[stop], output_kind=RequestOutputKind.DELTA)
    pieces = [out.outputs[0].text async for out in engine.generate(PROMPT, params)]
    assert "".join(pieces) == full[:full.index(stop)]


async def test_stop_token_ids_and_min_tokens(engine):
    tokens = (await final_output(engine, PROMPT, greedy(20))).outputs[0].token_ids
    stop_id = tokens[4]
    out = (await final_output(engine, PROMPT, greedy(20, stop_token_ids=[stop_id]))).outputs[0]
    assert out.token_ids == tokens[:tokens.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    first_id = tokens[0]
    held = (await final_output(engine, PROMPT, greedy(20, stop_token_ids=[first_id], min_tokens=5))).outputs[0]
    assert first_id not in held.token_ids[:4] and len(held.token_ids) >= 5


async def test_delta_outputs_add_up_to_the_cumulative_result(engine):
    cumulative = await final_output(engine, PROMPT, greedy(25))
    deltas = [o async for o in engine.generate(PROMPT, greedy(25, output_kind=RequestOutputKind.DELTA))]
    assert "".join(o.outputs[0].text for o in deltas) == cumulative.outputs[0].text
    assert sum((o.outputs[0].token_ids for o in deltas), []) == cumulative.outputs[0].token_ids
    final_only = [o async for o in engine.generate(PROMPT, greedy(25, output_kind=RequestOutputKind.FINAL_ONLY))]
    assert len(final_only) == 1 and final_only[0].outputs[0].text == cumulative.outputs[0].text


async def test_logprobs_rank_the_chosen_token(engine):
    out = (await final_output(engine, PROMPT, greedy(8, logprobs=3))).outputs[0]
    assert len(out.logprobs) == 8
    for token, position in zip(out.token_ids, out.logprobs, strict=True):
        assert token in position and position[token].rank == 1  # greedy picks the top token
        assert len(position) == 3  # the chosen token is also the top one
        assert all(lp.logprob <= 0 for lp in position.values())
    chosen = zip(out.token_ids, out.logprobs, strict=True)
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in chosen))


async def test_prompt_logprobs_agree_with_generation_logprobs(engine):
    prompt_ids = engine.tokenizer.encode(PROMPT)
    first = (await final_output(engine, prompt_ids, greedy(1, logprobs=0))).outputs[0]
    token = first.token_ids[0]
    scored = await final_output(engine, prompt_ids + [token], greedy(1, prompt_logprobs=2))
    assert scored.prompt_logprobs[0] is None
    last = scored.prompt_logprobs[-1][token]
    assert last.logprob == pytest.approx(first.logprobs[0][token].logprob, abs=1e-4)
    assert all(prompt_ids[i] in scored.prompt_logprobs[i] for i in range(1, len(prompt_ids)))


async def test_chunked_prefill_gives_the_same_prompt_logprobs(tiny_model_dir):
    prompt = list(range(10, 90))
    async with open_engine(engine_config(tiny_model_dir)) as engine:
        whole = await final_output(engine, prompt, greedy(4, prompt_logprobs=1))
    async with open_engine(engine_config(tiny_model_dir, max_num_batched_tokens=16)) as engine:
        chunked = await final_output(engine, prompt, greedy(4, prompt_logprobs=1))
    assert chunked.outputs[0].token_ids == whole.outputs[0].token_ids
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:], strict=True):
        assert set(a) == set(b)
        assert all(math.isclose(a[t].logprob, b[t].logprob, abs_tol=1e-4) for t in a)


async def test_penalties_change_the_distribution(engine):
    plain = (await final_output(engine, PROMPT, greedy(30))).outputs[0].token_ids
    penalised = (await final_output(engine, PROMPT, greedy(30, repetition_penalty=2.0,
                                                          frequency_penalty=2.0))).outputs[0].token_ids
    assert penalised != plain
    assert len(set(penalised)) >= len(set(plain))  # repeats were discouraged


async def test_prefix_cache_reuses_a_shared_prompt(engine):
    system = "You are a careful assistant that answers in one short sentence. " * 4
    first = await final_output(engine, system + "First question?", greedy(5))
    second = await final_output(engine, system + "Second question!", greedy(5))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 16  # at least one full block of the shared system prompt
    again = await final_output(engine, system + "First question?", greedy(5))
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


async def test_preemption_recomputes_and_keeps_outputs_identical(tiny_model_dir):
    prompts = [f"request {i}: " + "many tokens here " * (2 + i) for i in range(8)]
    async with open_engine(engine_config(tiny_model_dir)) as roomy:
        expected = [(await final_output(roomy, p, greedy(40))).outputs[0].token_ids for p in prompts]
    got = {}
    async with open_engine(engine_config(tiny_model_dir, num_kv_blocks=14, enable_prefix_caching=False)) as tight:
        async def run(i):
            got[i] = (await final_output(tight, prompts[i], greedy(40))).outputs[0].token_ids

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(run, i)
        assert tight.core.scheduler.num_preemptions > 0  # the cache was too small for all eight at once
    assert [got[i] for i in range(len(prompts))] == expected


@pytest.mark.parametrize("prompt, params, message", [
    ("", greedy(), "empty"),
    ([], greedy(), "empty"),
    ([1, 2, 99999], greedy(), "out of vocabulary"),
    ("word " * 600, greedy(), "maximum context length is 512 tokens. However, your request has"),
    ("hi", greedy(logprobs=50), "logprobs=50 is more than the limit of 20"),
    ("hi", greedy(max_tokens=600), r"you requested 60\d tokens \(\d in the messages, 600 in the completion\)"),
    ("hi", greedy(top_k=10**6), "top_k=1000000 is more than the limit"),
    ("hi", SamplingParams(n=10**6), "n=1000000 is more than the limit"),
    ("hi", greedy(stop_token_ids=[10**6]), "out of vocabulary"),
])
async def test_bad_requests_raise_clear_errors_and_the_engine_keeps_serving(engine, prompt, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        await final_output(engine, prompt, params)
    assert (await final_output(engine, PROMPT, greedy(3))).outputs[0].finish_reason == "length"


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", 0, "max_tokens must be at least 1"),
    ("temperature", -1.0, "temperature"),
    ("top_p", 0.0, "top_p"),
    ("top_k", -5, "top_k"),
    ("min_p", 1.5, "min_p"),
    ("n", 0, "n must be"),
    ("presence_penalty", 3.0, "presence_penalty"),
    ("repetition_penalty", 0.0, "repetition_penalty"),
])
def test_bad_sampling_values_are_refused(field, value, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


async def test_duplicate_request_id_is_refused_while_the_first_runs(engine):
    async def first():
        await final_output(engine, PROMPT, greedy(50), request_id="same")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(InvalidRequestError, match="already in use"):
            await final_output(engine, PROMPT, greedy(2), request_id="same")


async def test_chat_renders_the_template(engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    outputs = [o async for o in engine.chat(messages, greedy(6))]
    final = outputs[-1]
    assert final.prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert final.prompt.endswith("<|im_start|>assistant\n")
    assert len(final.outputs[0].token_ids) == 6
    with pytest.raises(InvalidRequestError, match="messages"):
        async for _ in engine.chat([], greedy(2)):
            pass


async def test_leaving_the_engine_fails_open_requests_with_engine_dead(tiny_model_dir):
    from engine import EngineDeadError
    async with open_engine(engine_config(tiny_model_dir)) as engine:
        stream = engine.generate(PROMPT, greedy(400))
        await stream.__anext__()
    with pytest.raises(EngineDeadError):
        await stream.__anext__()
    await stream.aclose()


async def test_generate_batch_yields_every_prompt_and_matches_single_runs(engine):
    prompts = ["first of the batch", [7, 8, 9, 10], "a third, somewhat longer prompt of the batch"]
    singles = [(await final_output(engine, p, greedy(8))).outputs[0].token_ids for p in prompts]
    finals = {}
    async for index, output in engine.generate_batch(prompts, greedy(8, output_kind=RequestOutputKind.DELTA)):
        finals.setdefault(index, []).extend(output.outputs[0].token_ids)
    assert [finals[i] for i in range(3)] == singles


async def test_a_refused_batch_member_does_not_leak_its_siblings(engine):
    async def hold():
        await final_output(engine, PROMPT, greedy(60, ignore_eos=True), request_id="b-1")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(InvalidRequestError, match="already in use"):
            async for _ in engine.generate_batch(["x", "y", "z"], greedy(60, ignore_eos=True), request_id="b"):
                pass
        nursery.cancel_scope.cancel()
    await engine.core.wait_until_idle()
    assert engine.core.num_requests == 0 and engine.core.scheduler.kv.num_used_blocks == 0


async def test_a_priority_is_taken_under_the_priority_policy_and_refused_otherwise(tiny_model_dir):
    async with open_engine(engine_config(tiny_model_dir, scheduling_policy="priority")) as engine:
        done = await final_output(engine, [5, 6, 7], greedy(3), priority=3)
        assert len(done.outputs[0].token_ids) == 3
    async with open_engine(engine_config(tiny_model_dir)) as engine:
        with pytest.raises(InvalidRequestError, match="Priority scheduling is not enabled") as refused:
            await final_output(engine, [5, 6, 7], greedy(3), priority=-1)
        assert refused.value.param == "priority"
        assert len((await final_output(engine, [5, 6, 7], greedy(2))).outputs[0].token_ids) == 2
