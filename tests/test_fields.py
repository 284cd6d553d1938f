"""No silent ignoring: every field is implemented, or refused with 400 naming it; unknown fields are
refused unless the server allows them (then logged); docs/api.md matches the table."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from bench.http import request
from tests.conftest import engine_config
from tests.helpers import sse_events
from tests.server_fixtures import running_server
from web.fields import REFUSED, api_reference
from web.http.settings import ServerSettings

DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def test_docs_api_md_is_generated_from_the_table():
    assert DOC.read_text() == api_reference() + "\n", "run: python -m web.fields > docs/api.md"


@pytest.fixture
async def server(tiny_model_dir):
    async with running_server(engine_config(tiny_model_dir)) as running:
        yield running


BASE = {"completions": {"prompt": "hello", "max_tokens": 2},
        "chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
SAMPLE_VALUES = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                 "response_format": {"type": "json_object"}, "logit_bias": {"5": 10}, "best_of": 2,
                 "structured_outputs": {"regex": "a+"}, "guided_json": {"type": "object"}, "suffix": "end"}


async def test_every_refused_field_is_a_400_naming_it(server):
    for endpoint in BASE:
        for field in sorted(REFUSED[endpoint]):
            body = {**BASE[endpoint], field: SAMPLE_VALUES.get(field, "x")}
            response = await request(server.url, "POST", f"/v1/{endpoint}", body)
            assert response.status == 400, (field, response.body)
            error = json.loads(response.body)["error"]
            assert error["param"] == field and "not supported" in error["message"], (field, error)


async def test_empty_values_of_refused_fields_ask_for_nothing(server):
    body = {**BASE["chat/completions"], "tools": [], "best_of": None, "parallel_tool_calls": False}
    response = await request(server.url, "POST", "/v1/chat/completions", body)
    assert response.status == 200, response.body


async def test_unknown_fields_and_nested_ones_are_refused(server):
    nested = {**BASE["completions"], "stream": True, "stream_options": {"frobnicate": True}}
    for body, param in (({**BASE["completions"], "frobnicate": 1}, "frobnicate"),
                        (nested, "stream_options.frobnicate")):
        response = await request(server.url, "POST", "/v1/completions", body)
        assert response.status == 400
        assert json.loads(response.body)["error"]["param"] == param


async def test_allow_unknown_fields_logs_them_instead(tiny_model_dir, caplog):
    settings = ServerSettings(allow_unknown_fields=True)
    async with running_server(engine_config(tiny_model_dir), settings) as server:
        body = {**BASE["completions"], "frobnicate": 1, "vendor_x": "y"}
        with caplog.at_level(logging.WARNING, logger="trio_llm.requests"):
            response = await request(server.url, "POST", "/v1/completions", body)
        assert response.status == 200
        assert "frobnicate" in caplog.text and "vendor_x" in caplog.text
        refused = {**BASE["completions"], "best_of": 3}  # known and unimplemented: still a 400
        response = await request(server.url, "POST", "/v1/completions", refused)
        assert response.status == 400


# ---- implemented fields: each has an observable effect, checked here or in the named test ---------
CHECKED_ELSEWHERE = {
    "model": "test_http_server (unknown models are 404s)",
    "prompt": "every completions test", "prompt_embeds": "test_http_prompt_embeds",
    "stream": "test_http_server", "stream_options": "test_structured_outputs::test_continuous_usage_stats_and_priority",
    "cache_salt": "test_prefix_hash", "user": "OpenAI's end-user id: recorded by no one, changes no output",
    "priority": "test_scheduler (priority policy)", "stop_token_ids": "test_engine",
    "ignore_eos": "test_engine", "min_tokens": "test_detokenizer::test_stop_strings_wait_for_min_tokens",
    "skip_special_tokens": "test_detokenizer", "prompt_logprobs": "test_structured_outputs",
    "response_format": "test_structured_outputs", "structured_outputs": "test_structured_outputs",
    "guided_json": "test_structured_outputs", "guided_regex": "test_structured_outputs",
    "guided_choice": "test_structured_outputs", "guided_grammar": "test_structured_outputs",
    "logit_bias": "test_structured_outputs", "allowed_token_ids": "test_structured_outputs",
    "logprob_token_ids": "test_structured_outputs",
    "use_beam_search": "test_beam_search", "length_penalty": "test_beam_search", "early_stopping": "test_beam_search",
    "bad_words": "test_structured_outputs", "truncate_prompt_tokens": "test_structured_outputs",
    "return_token_ids": "test_fields::test_token_ids_in_answers",
    "prompt_token_ids": "test_fields::test_token_ids_in_answers",
    "return_tokens_as_token_ids": "test_fields::test_token_ids_in_answers",
    "truncation_side": "test_fields::test_vllm_request_fields_carry_over",
    "metadata": "test_fields::test_vllm_request_fields_carry_over (accepted; changes no output, as in vLLM)",
}
GREEDY = {"prompt": "hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _text(response) -> str:
    return response.json()["choices"][0]["text"]


async def _post(server, **fields):
    response = await request(server.url, "POST", "/v1/completions", {**GREEDY, **fields})
    assert response.status == 200, (fields, response.body)
    return response


EFFECTS = {
    "n": ({"n": 2}, lambda r, base: len(r.json()["choices"]) == 2),
    "max_tokens": ({"max_tokens": 3}, lambda r, base: r.json()["usage"]["completion_tokens"] == 3),
    "logprobs": ({"logprobs": 2}, lambda r, base: len(r.json()["choices"][0]["logprobs"]["top_logprobs"]) == 8),
    "echo": ({"echo": True}, lambda r, base: _text(r) == "hello there" + _text(base)),
    "temperature": ({"temperature": 1.5, "seed": 1}, lambda r, base: _text(r) != _text(base)),
    "seed": ({"temperature": 1.5, "seed": 1}, lambda r, base: True),  # checked against a second draw below
    "top_k": ({"temperature": 1.5, "seed": 1, "top_k": 1}, lambda r, base: _text(r) == _text(base)),
    "top_p": ({"temperature": 1.5, "seed": 1, "top_p": 1e-6}, lambda r, base: _text(r) == _text(base)),
    "min_p": ({"temperature": 1.5, "seed": 1, "min_p": 1.0}, lambda r, base: _text(r) == _text(base)),
    "presence_penalty": ({"presence_penalty": 2.0}, lambda r, base: _text(r) != _text(base)),
    "frequency_penalty": ({"frequency_penalty": 2.0}, lambda r, base: _text(r) != _text(base)),
    "repetition_penalty": ({"repetition_penalty": 2.0}, lambda r, base: _text(r) != _text(base)),
}


async def test_every_implemented_completions_field_has_an_observable_effect(server):
    from web.openai.protocol import CompletionRequest

    fields = set(CompletionRequest.model_fields)
    covered = set(EFFECTS) | set(CHECKED_ELSEWHERE) | {"stop", "include_stop_str_in_output"}
    assert fields <= covered, f"fields without a check: {sorted(fields - covered)}"
    base = await _post(server)
    for name, (extra, effect) in EFFECTS.items():
        response = await _post(server, **extra)
        assert effect(response, base), (name, _text(response), _text(base))
    again = await _post(server, temperature=1.5, seed=1)
    assert _text(again) == _text(await _post(server, temperature=1.5, seed=1))  # seed: the same draw
    word = _text(base)[2:5]
    stopped = await _post(server, stop=[word])
    assert stopped.json()["choices"][0]["finish_reason"] == "stop" and word not in _text(stopped)
    kept = await _post(server, stop=[word], include_stop_str_in_output=True)
    assert _text(kept).endswith(word)


CHAT_CHECKED_ELSEWHERE = {
    "messages": "every chat test", "max_completion_tokens": "test_http_server",
    "top_logprobs": "test_http_server", "add_generation_prompt": "test_tools (continue_final_message)",
    "tools": "test_tools", "tool_choice": "test_tools", "parallel_tool_calls": "test_tools",
    "chat_template_kwargs": "test_reasoning", "continue_final_message": "test_tools",
    "chat_template": "test_structured_outputs::test_bad_words_truncation_echo_and_request_templates",
    "reasoning_effort": "test_fields::test_vllm_request_fields_carry_over",
}


def test_every_implemented_chat_field_is_checked_somewhere():
    from web.chat.protocol import ChatCompletionRequest

    covered = set(EFFECTS) | set(CHECKED_ELSEWHERE) | set(CHAT_CHECKED_ELSEWHERE) | {"stop",
                                                                                     "include_stop_str_in_output"}
    missing = set(ChatCompletionRequest.model_fields) - covered
    assert not missing, f"chat fields without a check: {sorted(missing)}"


async def test_request_id_headers_forced_usage_token_strs_stream_options_and_context_wording(
        tiny_model_dir, minilm_dir):
    settings = ServerSettings(enable_request_id_headers=True, enable_force_include_usage=True)
    async with running_server(engine_config(tiny_model_dir, max_model_len=64), settings) as server:
        mine = await request(server.url, "POST", "/v1/completions", BASE["completions"],
                             headers={"X-Request-Id": "abc-123"})
        assert mine.headers.get("x-request-id") == "abc-123"
        theirs = await request(server.url, "GET", "/health")
        assert theirs.headers.get("x-request-id")
        streamed = await request(server.url, "POST", "/v1/completions", {**BASE["completions"], "stream": True})
        events = [json.loads(e) for e in sse_events(streamed.body) if e != "[DONE]"]
        assert all("usage" in e for e in events)  # no stream_options asked: the server forces it, every chunk
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 2
        chat = await request(server.url, "POST", "/v1/chat/completions", {**BASE["chat/completions"], "stream": True})
        chunks = [json.loads(e) for e in sse_events(chat.body) if e != "[DONE]"]
        assert all(c.get("usage") for c in chunks), chunks  # the role chunk too (vLLM's test asks every chunk)
        assert chunks[0]["usage"]["completion_tokens"] == 0 and chunks[-1]["usage"]["completion_tokens"] == 2
        tokens = await request(server.url, "POST", "/tokenize", {"prompt": "hello there", "return_token_strs": True})
        body = tokens.json()
        assert len(body["token_strs"]) == body["count"] and body["max_model_len"] == 64
        plain = await request(server.url, "POST", "/tokenize", {"prompt": "hello there"})
        assert "token_strs" in plain.json() and plain.json()["token_strs"] is None  # vLLM's null, not absent
        options = await request(server.url, "POST", "/v1/completions",
                                {**BASE["completions"], "stream_options": {"include_usage": True}})
        assert (options.status, options.json()["error"]["message"]) == \
            (400, "Stream options can only be defined when `stream=True`.")
        too_long = await request(server.url, "POST", "/v1/completions", {"prompt": "word " * 100, "max_tokens": 1})
        assert too_long.status == 400
        assert "This model's maximum context length is 64 tokens. However, your request has" in \
            too_long.json()["error"]["message"]
    async with running_server(engine_config(minilm_dir, num_kv_blocks=None)) as embedder:
        too_long = await request(embedder.url, "POST", "/v1/embeddings", {"input": "word " * 600})
        assert too_long.status == 400 and "maximum context length is" in too_long.json()["error"]["message"]
        limit = embedder.engine.info.max_model_len
        cut = await request(embedder.url, "POST", "/v1/embeddings", {"input": "word", "truncate_prompt_tokens": 9999})
        assert (cut.status, cut.json()["error"]["message"]) == (400, (
            f"truncate_prompt_tokens=9999 cannot be greater than max_model_len - max_tokens = {limit}. "
            "Please request a smaller truncation size."))


async def test_token_ids_in_answers(server):
    ids_body = {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True, "logprobs": 1, "return_token_ids": True,
                "temperature": 0,
                "return_tokens_as_token_ids": True}
    choice = (await request(server.url, "POST", "/v1/completions", ids_body)).json()["choices"][0]
    assert choice["prompt_token_ids"] == [5, 6, 7] and len(choice["token_ids"]) == 3
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    streamed = await request(server.url, "POST", "/v1/completions", {**ids_body, "stream": True})
    chunks = [json.loads(e) for e in sse_events(streamed.body) if e != "[DONE]"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    assert sum((c["choices"][0]["token_ids"] for c in chunks if c["choices"]), []) == choice["token_ids"]
    token_in = {**ids_body, "prompt": "", "prompt_token_ids": [5, 6, 7]}
    del token_in["prompt"]
    for body in (token_in, {**token_in, "prompt": ""}):  # token in, token out: prompt absent or ""
        same = (await request(server.url, "POST", "/v1/completions", body)).json()["choices"][0]
        assert same["token_ids"] == choice["token_ids"]
    chat_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
                 "return_token_ids": True, "return_tokens_as_token_ids": True}
    answer = (await request(server.url, "POST", "/v1/chat/completions", chat_body)).json()
    assert answer["prompt_token_ids"] and len(answer["choices"][0]["token_ids"]) == 2
    tokens = [entry["token"] for entry in answer["choices"][0]["logprobs"]["content"]]
    assert tokens == [f"token_id:{t}" for t in answer["choices"][0]["token_ids"]]


async def test_unix_socket_tokenizer_info_and_truncation_to_the_limit(tiny_model_dir, minilm_dir, tmp_path):
    import httpx

    socket_path = str(tmp_path / "trio-llm.sock")
    settings = ServerSettings(uds=socket_path, enable_tokenizer_info_endpoint=True)
    async with running_server(engine_config(tiny_model_dir), settings):
        transport = httpx.AsyncHTTPTransport(uds=socket_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            completion = await client.post("/v1/completions", json=BASE["completions"])
            assert completion.status_code == 200 and completion.json()["choices"]
            info = (await client.get("/tokenizer_info")).json()
            assert info["eos_token"] == "<|im_end|>" and info["tokenizer_class"] and "chat_template" in info
    async with running_server(engine_config(tiny_model_dir)) as server:
        off = await request(server.url, "GET", "/tokenizer_info")
        assert off.status == 404 and "--enable-tokenizer-info-endpoint" in off.json()["error"]["message"]
    async with running_server(engine_config(minilm_dir, num_kv_blocks=None)) as embedder:
        long_input = "word " * 600
        cut = await request(embedder.url, "POST", "/v1/embeddings", {"input": long_input, "truncate_prompt_tokens": -1})
        assert cut.status == 200 and cut.json()["usage"]["prompt_tokens"] == 512
        zero = await request(embedder.url, "POST", "/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 0})
        assert zero.status == 400


async def test_server_load_counts_requests_while_they_are_served(tiny_model_dir):
    """--enable-server-load-tracking: GET /load counts a streamed completion until its last byte
    (one kept-alive connection: the next request is read after the stream's call has returned)."""
    import httpx

    settings = ServerSettings(enable_server_load_tracking=True)
    async with running_server(engine_config(tiny_model_dir), settings) as server, \
            httpx.AsyncClient(base_url=server.url, limits=httpx.Limits(max_connections=1)) as one, \
            httpx.AsyncClient(base_url=server.url) as other:
        assert (await one.get("/load")).json() == {"server_load": 0}
        body = {"prompt": "hello", "max_tokens": 8, "ignore_eos": True, "stream": True}
        async with one.stream("POST", "/v1/completions", json=body) as stream:
            chunks = stream.aiter_lines()
            await anext(chunks)
            assert (await other.get("/load")).json() == {"server_load": 1}
            async for _ in chunks:
                pass
        assert (await one.get("/load")).json() == {"server_load": 0}
    async with running_server(engine_config(tiny_model_dir)) as untracked, httpx.AsyncClient() as http:
        assert (await http.get(untracked.url + "/load")).json() == {"server_load": 0}  # vLLM's answer when off


async def test_vllm_request_fields_carry_over(tiny_model_dir):
    """Fields vLLM accepts: truncation_side picks the end truncate_prompt_tokens cuts, metadata is
    accepted and changes nothing, reasoning_effort reaches the chat template; an empty prompt is a
    400 (vLLM's), not a run."""
    async with running_server(engine_config(tiny_model_dir), ServerSettings(trust_request_chat_template=True)) \
            as server:
        ids = [5, 6, 7, 8, 9]
        kept = {}
        for side in ("left", "right"):
            body = {"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 2, "truncation_side": side,
                    "return_token_ids": True}
            kept[side] = (await request(server.url, "POST", "/v1/completions", body)).json()["choices"][0][
                "prompt_token_ids"]
        assert kept == {"left": [8, 9], "right": [5, 6]}
        wrong = await request(server.url, "POST", "/v1/completions", {**GREEDY, "truncation_side": "middle"})
        assert wrong.status == 400 and wrong.json()["error"]["param"] == "truncation_side"
        tagged = await _post(server, metadata={"team": "search"})
        assert _text(tagged) == _text(await _post(server))
        for empty in ("", ["hello", ""]):
            refused = await request(server.url, "POST", "/v1/completions", {**GREEDY, "prompt": empty})
            assert refused.status == 400 and "empty" in refused.json()["error"]["message"], refused.body
        template = "effort={{ reasoning_effort | default('unset') }}"
        for effort, shown in ((None, "unset"), ("low", "low")):
            body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": template,
                    **({"reasoning_effort": effort} if effort else {})}
            rendered = (await request(server.url, "POST", "/v1/chat/completions/render", body)).json()
            detok = await request(server.url, "POST", "/detokenize", {"tokens": rendered["token_ids"]})
            assert detok.json()["prompt"] == f"effort={shown}"
        assert (await _post(server)).status == 200  # and everyone else is served
