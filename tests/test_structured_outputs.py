"""Structured outputs over HTTP with the openai client: every output valid against its schema,
regex, choice or grammar; invalid constraints are 400s with the compiler's message."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest
import trio

from engine.config import StructuredOutputsConfig
from engine.render.grammar import bounded_integers, grammar_text
from engine.structured_outputs import StructuredOutputs
from engine.worker.grammar_masks import GrammarMasks
from tests.conftest import TEST_SPEC, engine_config
from tests.server_fixtures import running_server

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3}}}


@pytest.fixture
async def client(tiny_model_dir):
    async with running_server(engine_config(tiny_model_dir)) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        async with client:
            client.served = server.state.model_name
            yield client


def chat(text: str = "give me a record") -> list[dict]:
    return [{"role": "user", "content": text}]


async def test_json_schema_answers_are_valid_and_close_well_within_200_tokens(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    for seed in range(4):
        out = await client.chat.completions.create(model=client.served, messages=chat(), max_tokens=200,
                                                   temperature=1.0, seed=seed, response_format=response_format)
        choice = out.choices[0]
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop" and out.usage.completion_tokens < 200
        assert "\n" not in choice.message.content  # compact: no whitespace runs


UNBOUNDED = {"type": "object", "required": ["id", "score", "name", "tags", "child"],
             "properties": {"id": {"type": "integer"}, "score": {"type": "number"}, "name": {"type": "string"},
                            "tags": {"type": "array", "items": {"type": "string"}},
                            "child": {"type": "object", "required": ["on"], "properties": {"on": {"type": "boolean"}}}}}


async def test_answers_under_a_small_budget_still_parse(client):
    """Unbounded numbers and strings, sampled at temperature 1 with 64 tokens: without the budget
    plan most answers are cut inside a number or a string; with it, all 200 close in time."""
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": UNBOUNDED}}
    answers, reasons, lengths = [], set(), []
    for seed in range(10):
        out = await client.chat.completions.create(model=client.served, messages=chat(), max_tokens=64, n=20,
                                                   temperature=1.0, seed=seed, response_format=response_format)
        answers += [c.message.content for c in out.choices]
        reasons |= {c.finish_reason for c in out.choices}
        lengths.append(out.usage.completion_tokens)
    assert len(answers) == 200
    for answer in answers:
        jsonschema.validate(json.loads(answer), UNBOUNDED)
    assert reasons == {"stop"}
    assert max(lengths) > 20 * 50  # most answers used most of their budget: the plan, not luck, closed them


async def test_a_budget_too_small_for_any_answer_ends_with_length(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": UNBOUNDED}}
    out = await client.chat.completions.create(model=client.served, messages=chat(), max_tokens=10,
                                               response_format=response_format)
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.content.startswith("{")


def test_integers_without_bounds_get_the_digit_limit_and_bounded_ones_keep_theirs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": ["integer", "null"]},
                                               "c": {"type": "integer", "maximum": 5},
                                               "d": {"type": "array", "items": {"type": "integer"}},
                                               "e": {"enum": [{"type": "integer"}]}}}
    bounded = bounded_integers(schema, 999)
    props = bounded["properties"]
    assert props["a"] == props["b"] | {"type": "integer"} == {"type": "integer", "minimum": -999, "maximum": 999}
    assert props["c"] == {"type": "integer", "maximum": 5} and props["e"] == schema["properties"]["e"]
    assert props["d"]["items"] == {"type": "integer", "minimum": -999, "maximum": 999}


def test_the_closing_plan_completes_the_grammar_from_where_the_answer_is(tiny_model_dir):
    masks = GrammarMasks(tiny_model_dir, TEST_SPEC.vocab)
    text = grammar_text(StructuredOutputs(json=UNBOUNDED))
    for prefix in ('', '{"id":12345', '{"id":1,"score":2.5,"name":"hello wor',
                   '{"id":1,"score":0,"name":"","tags":["x'):
        matcher = masks.matcher(text, 2)
        tokenizer = masks._tokenizers[2]
        assert matcher.consume_tokens(tokenizer.tokenize_str(prefix))
        plan = masks.closing_plan(matcher, 100)
        assert plan is not None and len(plan) < 60
        jsonschema.validate(json.loads(prefix + tokenizer.decode_str(plan)), UNBOUNDED)
        assert not matcher.is_accepting()  # planning moved a copy, not the request's matcher
        assert masks.closing_plan(matcher, len(plan)) is None  # no plan within a smaller limit


async def test_n_samples_streaming_and_a_mixed_batch(client):
    regex = r"[a-z]{2,5}-[0-9]{3}"

    async def constrained(results):
        out = await client.completions.create(model=client.served, prompt="code:", max_tokens=30, n=3, seed=7,
                                              temperature=1.0, extra_body={"structured_outputs": {"regex": regex}})
        results["regex"] = [c.text for c in out.choices]

    async def free(results):
        out = await client.completions.create(model=client.served, prompt="code:", max_tokens=12, temperature=1.0,
                                              seed=7, extra_body={"ignore_eos": True})
        results["free"] = out.choices[0].text

    async def streamed(results):
        stream = await client.chat.completions.create(
            model=client.served, messages=chat(), max_tokens=200, stream=True, seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}})
        results["stream"] = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    results: dict = {}
    async with trio.open_nursery() as nursery:
        for job in (constrained, free, streamed):
            nursery.start_soon(job, results)
    assert len(results["regex"]) == 3 and all(re.fullmatch(regex, t) for t in results["regex"])
    assert not re.fullmatch(regex, results["free"])  # the unconstrained neighbour was not masked
    jsonschema.validate(json.loads(results["stream"]), SCHEMA)


async def test_choice_grammar_json_object_and_the_guided_names(client):
    out = await client.chat.completions.create(model=client.served, messages=chat(), max_tokens=10,
                                               extra_body={"guided_choice": ["alpha", "beta"]})
    assert out.choices[0].message.content in ("alpha", "beta")
    grammar = 'root ::= "x" ("y" | "z")+ "!"'
    out = await client.completions.create(model=client.served, prompt="g:", max_tokens=40, temperature=1.0, seed=1,
                                          extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"x[yz]+!", out.choices[0].text), out.choices[0].text
    out = await client.chat.completions.create(model=client.served, messages=chat(), max_tokens=200, seed=2,
                                               response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:
        assert out.choices[0].message.content.startswith("{")


async def test_a_grammar_that_cannot_finish_ends_with_length(client):
    out = await client.completions.create(model=client.served, prompt="x", max_tokens=5,
                                          extra_body={"structured_outputs": {"regex": "a{50}"}})
    assert out.choices[0].finish_reason == "length" and out.choices[0].text == "a" * len(out.choices[0].text)


async def test_the_parse_helper_with_a_pydantic_model(client):
    class Pet(pydantic.BaseModel):
        kind: str = pydantic.Field(max_length=8)
        legs: bool

    out = await client.beta.chat.completions.parse(model=client.served, messages=chat(), max_tokens=200,
                                                   response_format=Pet, seed=4)
    assert isinstance(out.choices[0].message.parsed, Pet)


@pytest.mark.parametrize("extra, message", [
    ({"structured_outputs": {"regex": "(unclosed"}}, "unclosed group"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "invalid structured outputs"),
    ({"guided_grammar": "root ::= \"a\" ("}, "invalid structured outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs.pattern"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "give one way"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    # wrong types and shapes (issue 34: these answered 500 or were taken as something else)
    ({"structured_outputs": {"regex": {"1": "Python"}}}, "structured_outputs.regex: Input should be a valid string"),
    ({"response_format": {"type": "json_schema", "json_schema": 7}}, "response_format.json_schema: Input should be"),
    ({"structured_outputs": {"choice": "abc"}}, "structured_outputs.choice: Input should be a valid array"),
    ({"structured_outputs": {"choice": [1, 2]}}, "structured_outputs.choice.0: Input should be a valid string"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs.json: Input should be"),
    ({"structured_outputs": 7}, "structured_outputs: Input should be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 5, "schema": {}}}},
     "response_format.json_schema.name: Input should be a valid string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema must be"),
    ({"response_format": "json"}, "response_format: Input should be an object"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "Unknown field 'response_format.schema'"),
])
async def test_invalid_constraints_are_400s_with_the_reason(client, extra, message):
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model=client.served, prompt="x", max_tokens=5, extra_body=extra)
    assert message in str(caught.value)


async def test_logit_bias_and_allowed_token_ids(client, tiny_model_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{tiny_model_dir}/tokenizer.json")
    pushed = await client.completions.create(model=client.served, prompt="hello", max_tokens=6, temperature=0,
                                             logit_bias={"300": 100}, extra_body={"ignore_eos": True})
    assert pushed.choices[0].text == tokenizer.decode([300] * 6)
    only = await client.completions.create(model=client.served, prompt="hello", max_tokens=8, temperature=1.0, seed=3,
                                           extra_body={"allowed_token_ids": [40, 41], "ignore_eos": True})
    allowed_chars = set(tokenizer.decode([40]) + tokenizer.decode([41]))
    assert only.choices[0].text and set(only.choices[0].text) <= allowed_chars
    for extra, param in (({"logit_bias": {"999999": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
                         ({"logit_bias": {"x": 1}}, "logit_bias"), ({"allowed_token_ids": []}, "allowed_token_ids")):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=client.served, prompt="x", max_tokens=2, extra_body=extra)
        assert caught.value.body["param"] == param, caught.value.body


async def test_continuous_usage_stats_and_priority(client):
    stream = await client.completions.create(model=client.served, prompt="hello", max_tokens=5, stream=True,
                                             stream_options={"include_usage": True, "continuous_usage_stats": True},
                                             extra_body={"ignore_eos": True, "priority": 0})
    counts = [chunk.usage.completion_tokens async for chunk in stream if chunk.choices]
    assert counts == sorted(counts) and counts[-1] == 5 and len(counts) >= 2
    stream = await client.chat.completions.create(model=client.served, messages=chat(), max_tokens=4, stream=True,
                                                  stream_options={"include_usage": True,
                                                                  "continuous_usage_stats": True})
    usages = [chunk.usage for chunk in [c async for c in stream] if chunk.choices and chunk.usage]
    assert usages and usages[-1].completion_tokens >= 1
    # Under the default policy (fcfs) a priority would be ignored: vLLM refuses it, and so do we.
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model=client.served, prompt="x", max_tokens=1, extra_body={"priority": 3})
    assert refused.value.body["param"] == "priority" and "not enabled" in refused.value.body["message"]


async def test_bad_words_truncation_echo_and_request_templates(client, tiny_model_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{tiny_model_dir}/tokenizer.json")
    free = await client.completions.create(model=client.served, prompt="hello", max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    banned_word = free.choices[0].text.split()[0] if free.choices[0].text.split() else free.choices[0].text[:2]
    banned = await client.completions.create(model=client.served, prompt="hello", max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True, "bad_words": [banned_word]})
    assert banned_word not in banned.choices[0].text.split()
    long_prompt = "one two three four five six seven eight nine ten " * 3
    cut = await client.completions.create(model=client.served, prompt=long_prompt, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert cut.usage.prompt_tokens == 5 < len(tokenizer.encode(long_prompt).ids)
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "Once upon"}]
    echoed = await client.chat.completions.create(model=client.served, messages=messages, max_tokens=3,
                                                  extra_body={"echo": True, "continue_final_message": True,
                                                              "add_generation_prompt": False})
    assert echoed.choices[0].message.content.startswith("Once upon")
    with pytest.raises(openai.BadRequestError, match="--trust-request-chat-template"):
        await client.chat.completions.create(model=client.served, messages=chat(), max_tokens=2,
                                             extra_body={"chat_template": "{{ messages[0]['content'] }}"})


async def test_prompt_logprobs_in_completions_and_chat(client):
    from bench.http import request

    url = str(client.base_url).removesuffix("/v1/")
    response = await request(url, "POST", "/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 1,
                                                               "prompt_logprobs": 2})
    positions = response.json()["choices"][0]["prompt_logprobs"]
    assert len(positions) == 4 and positions[0] is None
    for token, position in zip([6, 7, 8], positions[1:], strict=True):
        assert str(token) in position and len(position) <= 3  # the prompt token and the top 2
        assert all(entry["logprob"] <= 0 and entry["rank"] >= 1 for entry in position.values())
    chat_response = await request(url, "POST", "/v1/chat/completions",
                                  {"messages": chat(), "max_tokens": 1, "prompt_logprobs": 0})
    body = chat_response.json()
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    too_many = await request(url, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1,
                                                               "prompt_logprobs": 1000})
    assert too_many.status == 400 and too_many.json()["error"]["param"] == "prompt_logprobs"


async def test_logprob_token_ids_on_completions_chat_and_chat_batch(client):
    from bench.http import request

    url = str(client.base_url).removesuffix("/v1/")
    top = await client.completions.create(model=client.served, prompt=[5, 6, 7], max_tokens=2, temperature=0,
                                          logprobs=4)
    ranked = [{int(t.removeprefix("token_id:")): lp for t, lp in position.items()}
              for position in (await request(url, "POST", "/v1/completions", {
                  "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "logprobs": 4,
                  "return_tokens_as_token_ids": True})).json()["choices"][0]["logprobs"]["top_logprobs"]]
    named = sorted(ranked[0], key=ranked[0].get)[:3]  # three of the top four, least likely first
    body = (await request(url, "POST", "/v1/completions", {
        "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "logprob_token_ids": named,
        "return_tokens_as_token_ids": True})).json()
    first = body["choices"][0]["logprobs"]["top_logprobs"][0]
    assert body["choices"][0]["text"] == top.choices[0].text  # asking for logprobs changes no token
    assert {int(t.removeprefix("token_id:")) for t in first} <= set(named) | set(ranked[0])
    for token in named:
        assert first[f"token_id:{token}"] == pytest.approx(ranked[0][token], abs=1e-5)
    chat_body = {"messages": chat(), "max_tokens": 3, "temperature": 0, "logprob_token_ids": named,
                 "return_tokens_as_token_ids": True}
    for path in ("/v1/chat/completions", "/v1/chat/completions/batch"):
        sent = {**chat_body, "messages": [chat()]} if path.endswith("batch") else chat_body
        content = (await request(url, "POST", path, sent)).json()["choices"][0]["logprobs"]["content"]
        assert len(content) == 3
        for position in content:  # the named tokens, in the order named, at every position
            assert [entry["token"] for entry in position["top_logprobs"]] == [f"token_id:{t}" for t in named]
    bad = await request(url, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1,
                                                          "logprob_token_ids": [10**7]})
    assert bad.status == 400 and bad.json()["error"]["param"] == "logprob_token_ids"


def test_the_structured_outputs_config_takes_its_one_key_and_refuses_others():
    assert StructuredOutputsConfig.from_json('{"max_integer_digits": null}').max_integer_digits is None
    assert StructuredOutputsConfig.from_json("{}").max_integer_digits == 18
    for text, words in (('{"backend": "xgrammar"}', "backend"), ('{"max_integer_digits": 0}', "1-300")):
        with pytest.raises(ValueError, match=words):
            StructuredOutputsConfig.from_json(text)
