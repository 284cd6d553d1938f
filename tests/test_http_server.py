"""The HTTP server end to end: a real hypercorn on 127.0.0.1, driven by the real openai client and raw HTTP."""

from __future__ import annotations

import json
import logging

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.http import request
from tests.conftest import engine_config
from tests.helpers import sse_events
from tests.server_fixtures import running_server
from web.http.cors import CorsSettings
from web.http.settings import ServerSettings


@pytest.fixture
async def server(tiny_model_dir):
    async with running_server(engine_config(tiny_model_dir, num_kv_blocks=128)) as running:
        yield running


@pytest.fixture
async def client(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    yield client
    await client.close()


async def test_completions_with_the_openai_client(server, client):
    model = server.state.model_name
    result = await client.completions.create(model=model, prompt="The engine", max_tokens=7, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert result.object == "text_completion" and len(result.choices) == 1
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 7
    assert result.usage.prompt_tokens == len(server.engine.tokenizer.encode("The engine"))
    streamed = await client.completions.create(model=model, prompt="The engine", max_tokens=7, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
    chunks = [c async for c in streamed]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == result.choices[0].text
    assert chunks[-1].usage.completion_tokens == 7 and chunks[-1].choices == []


async def test_several_prompts_and_n_get_ordered_choices(server, client):
    result = await client.completions.create(model=server.state.model_name, prompt=["one", "two"],
                                             n=2, max_tokens=3, temperature=1.0, seed=3,
                                             extra_body={"ignore_eos": True})
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert result.usage.completion_tokens == 12
    streamed = await client.completions.create(model=server.state.model_name, prompt=["one", "two"], n=2,
                                               max_tokens=3, temperature=1.0, seed=3, stream=True,
                                               extra_body={"ignore_eos": True})
    chunks = [c async for c in streamed]
    assert all(len(c.choices) == 1 for c in chunks)  # one choice per chunk, as vLLM streams n > 1
    assert sorted({c.choices[0].index for c in chunks}) == [0, 1, 2, 3]
    texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(4)]
    assert texts == [c.text for c in result.choices]  # the same seed: the same samples


async def test_chat_with_the_openai_client(server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    result = await client.chat.completions.create(model=server.state.model_name, messages=messages,
                                                  max_completion_tokens=6, temperature=0, logprobs=True,
                                                  top_logprobs=2, extra_body={"ignore_eos": True})
    choice = result.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 6 and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    prompt = server.engine.tokenizer.encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                                            "Hello there<|im_end|>\n<|im_start|>assistant\n", False)
    assert result.usage.prompt_tokens == len(prompt)
    stream = await client.chat.completions.create(model=server.state.model_name, messages=messages,
                                                  max_tokens=6, temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_models_health_version(server, client):
    models = await client.models.list()
    assert [m.id for m in models.data] == [server.state.model_name]
    assert (await request(server.url, "GET", "/health")).status == 200
    version = await request(server.url, "GET", "/version")
    assert version.status == 200 and version.json()["version"]


async def test_tokenize_and_detokenize_round_trip(server):
    tokens = (await request(server.url, "POST", "/tokenize", {"prompt": "round trip text"})).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    text = (await request(server.url, "POST", "/detokenize", {"tokens": tokens["tokens"]})).json()
    assert text == {"prompt": "round trip text"}
    chat = (await request(server.url, "POST", "/tokenize", {"messages": [{"role": "user", "content": "x"}]})).json()
    assert chat["count"] > tokens["count"] - 3
    bad = await request(server.url, "POST", "/detokenize", {"tokens": [10**7]})
    assert bad.status == 400 and "out of vocabulary" in bad.json()["error"]["message"]


async def test_sse_framing_on_the_wire(server):
    body = {"prompt": "frames", "max_tokens": 5, "stream": True, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    response = await request(server.url, "POST", "/v1/completions", body)
    assert response.status == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    texts = [c["choices"][0]["text"] for c in chunks[:-1]]
    assert len(texts) <= 5  # at most one event per engine step
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("payload, status, message, param", [
    ({"prompt": "x", "temperature": -1}, 400, "temperature must be non-negative", "temperature"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be at least 1", "max_tokens"),
    ({"prompt": "x", "n": 0}, 400, "n must be at least 1", "n"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs=50 is more than the limit of 20", "logprobs"),
    ({"prompt": ""}, 400, "the prompt is empty", "prompt"),
    ({"prompt": [1, 2, 10**9]}, 400, "out of vocabulary", "prompt"),
    ({"prompt": "word " * 600}, 400, "maximum context length is 512 tokens. However, your request has", "prompt"),
    ({"max_tokens": 3}, 400, "either prompt, prompt_token_ids or prompt_embeds is required", "prompt"),
    ({"prompt": ["one", [5, 6]]}, 400, "prompt must be a string, a list of strings, a list of token ids", "prompt"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "The model `gpt-4` does not exist.", "model"),
])
async def test_invalid_completions_get_openai_errors(server, payload, status, message, param):
    response = await request(server.url, "POST", "/v1/completions", payload)
    assert response.status == status
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param
    # vLLM's shape: the error class's name and the status (clients check type == "BadRequestError")
    assert error["code"] == status
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]


async def test_streaming_request_with_invalid_values_is_a_400_not_a_stream(server):
    response = await request(server.url, "POST", "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "x"}], "stream": True, "top_p": 5})
    assert response.status == 400 and "top_p" in response.json()["error"]["message"]


async def test_bad_json_unknown_route_and_wrong_method(server):
    bad = await request(server.url, "POST", "/v1/completions", body=b"{not json")
    assert bad.status == 400 and "not valid JSON" in bad.json()["error"]["message"]
    missing = await request(server.url, "GET", "/v1/nothing-here")
    assert missing.status == 404 and "no route for GET /v1/nothing-here" in missing.json()["error"]["message"]
    method = await request(server.url, "GET", "/v1/completions")
    assert method.status == 405


async def test_oversized_body_is_413(tiny_model_dir):
    settings = ServerSettings(max_body_bytes=1000)
    async with running_server(engine_config(tiny_model_dir), settings) as server:
        response = await request(server.url, "POST", "/v1/completions", {"prompt": "x" * 5000})
        assert response.status == 413
        assert "exceeds the limit of 1000 bytes" in response.json()["error"]["message"]
        assert (await request(server.url, "GET", "/health")).status == 200


@pytest.mark.parametrize("metrics_require_key", [False, True])
async def test_every_route_but_the_probes_needs_the_api_key(tiny_model_dir, metrics_require_key):
    """Walks every registered route, so a route added later cannot be forgotten."""
    settings = ServerSettings(api_key="s3cret", metrics_require_key=metrics_require_key)
    open_paths = {"/health", "/ping", "/version"} | (set() if metrics_require_key else {"/metrics"})
    async with running_server(engine_config(tiny_model_dir), settings) as server:
        routes = [(rule.rule, method) for rule in server.app.url_map.iter_rules() if "<" not in rule.rule
                  for method in sorted(rule.methods - {"HEAD", "OPTIONS"})]
        assert len(routes) >= 14 and ("/tokenize", "POST") in routes and ("/rerank", "POST") in routes
        for path, method in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"},
                            {"Authorization": "Bearer s3cret-and-more"}):
                response = await request(server.url, method, path, {} if method == "POST" else None, headers=headers)
                if path in open_paths:
                    assert response.status != 401, (path, method, headers)
                else:
                    assert response.status == 401, (path, method, headers)
                    assert response.json()["error"]["reason"] == "invalid_api_key"
            keyed = await request(server.url, method, path, {} if method == "POST" else None,
                                  headers={"Authorization": "Bearer s3cret"})
            assert keyed.status != 401, (path, method)
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
        await client.close()


async def test_full_queue_is_503_with_retry_after(tiny_model_dir):
    async with running_server(engine_config(tiny_model_dir), ServerSettings(max_queued_requests=0)) as server:
        response = await request(server.url, "POST", "/v1/completions", {"prompt": "x"})
        assert response.status == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["reason"] == "queue_full"


async def test_echo_logprobs_and_stop_strings(server):
    plain = (await request(server.url, "POST", "/v1/completions",
                           {"prompt": "Echo this", "max_tokens": 12, "temperature": 0, "ignore_eos": True})).json()
    text = plain["choices"][0]["text"]
    echoed = (await request(server.url, "POST", "/v1/completions",
                            {"prompt": "Echo this", "max_tokens": 4, "temperature": 0, "echo": True,
                             "logprobs": 2, "ignore_eos": True})).json()
    choice = echoed["choices"][0]
    assert choice["text"].startswith("Echo this")
    assert text.startswith(choice["text"][len("Echo this"):])  # greedy: 4 tokens are a prefix of 12
    logprobs = choice["logprobs"]
    num_prompt = echoed["usage"]["prompt_tokens"]
    assert len(logprobs["tokens"]) == num_prompt + 4
    assert logprobs["token_logprobs"][0] is None and all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    stop = text[4:7]
    stopped = (await request(server.url, "POST", "/v1/completions",
                             {"prompt": "Echo this", "max_tokens": 12, "temperature": 0, "stop": stop,
                              "ignore_eos": True})).json()["choices"][0]
    assert stopped["text"] == text[:text.index(stop)] and stopped["finish_reason"] == "stop"
    assert stopped["stop_reason"] == stop


async def test_echo_of_token_ids_is_their_text_with_special_tokens(server):
    """A token-id prompt echoes as its text, special tokens kept (as vLLM's), streamed or not."""
    tokenizer = server.engine.tokenizer
    ids = tokenizer.encode("<|im_start|>user\nEcho this", False)
    assert tokenizer.decode(ids) != tokenizer.decode(ids, skip_special_tokens=False)  # it has a special token
    body = {"prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True, "ignore_eos": True}
    whole = (await request(server.url, "POST", "/v1/completions", body)).json()["choices"][0]["text"]
    streamed = await request(server.url, "POST", "/v1/completions", {**body, "stream": True})
    chunks = [json.loads(e) for e in sse_events(streamed.body) if e != "[DONE]"]
    assert whole.startswith("<|im_start|>user\nEcho this") and len(whole) > len("<|im_start|>user\nEcho this")
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole


async def test_large_bodies_and_responses_take_the_offloaded_paths(server):
    from web.http.requests import OFFLOAD_BODY_BYTES, OFFLOAD_RESPONSE_TOKENS
    prompts = [f"prompt number {i}: " + "lorem ipsum dolor " * 20 for i in range(200)]
    payload = {"prompt": prompts, "max_tokens": 25, "temperature": 0, "ignore_eos": True}
    assert len(json.dumps(payload)) > OFFLOAD_BODY_BYTES and OFFLOAD_RESPONSE_TOKENS < 200 * 25
    response = await request(server.url, "POST", "/v1/completions", payload)
    assert response.status == 200
    body = response.json()
    assert [c["index"] for c in body["choices"]] == list(range(200))
    assert body["usage"]["completion_tokens"] == 200 * 25
    single = (await request(server.url, "POST", "/v1/completions",
                            {"prompt": prompts[137], "max_tokens": 25, "temperature": 0,
                             "ignore_eos": True})).json()
    assert body["choices"][137]["text"] == single["choices"][0]["text"]


VLLM_METRICS = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:time_to_first_token_seconds",
                "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
                "vllm:request_queue_time_seconds", "vllm:num_preemptions", "vllm:prefix_cache_queries",
                "vllm:prefix_cache_hits", "vllm:request_success", "vllm:request_prompt_tokens",
                "vllm:request_generation_tokens", "vllm:request_prefill_time_seconds",
                "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                "vllm:iteration_tokens_total", "vllm:request_params_n", "vllm:request_params_max_tokens",
                "vllm:num_requests_waiting_by_reason"]


def test_waiting_requests_are_split_by_reason_as_vllm_does():
    """Held back by a gate (an encoder output on its way, the adapter limit): "deferred"; the rest
    wait for room: "capacity"."""
    from engine.core.stats import EngineStats
    from web.http.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.bind(lambda: EngineStats(1, 5, 0.0, 0, 0, 0, None, None, (True,), num_waiting_deferred=2))
    text = metrics.render().decode()
    for line in ('vllm:num_requests_waiting{model_name="m"} 5.0',
                 'vllm:num_requests_waiting_by_reason{model_name="m",reason="capacity"} 3.0',
                 'vllm:num_requests_waiting_by_reason{model_name="m",reason="deferred"} 2.0'):
        assert line in text, line


async def test_metrics_carry_vllms_names_with_a_model_name_label(server):

    for _ in range(2):  # the second shares the first's prompt prefix
        done = await request(server.url, "POST", "/v1/completions",
                             {"prompt": "word " * 40, "max_tokens": 3, "ignore_eos": True})
        assert done.status == 200
    scraped = await request(server.url, "GET", "/metrics")
    families = {f.name: f for f in text_string_to_metric_families(scraped.body.decode())}
    assert [name for name in VLLM_METRICS if name not in families] == []
    model = server.state.model_name

    def value(name, suffix="", **labels):
        return next(s.value for s in families[name].samples
                    if s.name == name + suffix and s.labels == {"model_name": model, **labels})

    assert value("vllm:generation_tokens", "_total") == 6
    assert value("vllm:request_success", "_total", finished_reason="length") == 2
    assert value("vllm:time_to_first_token_seconds", "_count") == 2
    assert value("vllm:request_queue_time_seconds", "_count") == 2
    assert value("vllm:request_generation_tokens", "_sum") == 6
    assert value("vllm:request_prompt_tokens", "_count") == 2
    for phase in ("prefill", "decode", "inference"):
        assert value(f"vllm:request_{phase}_time_seconds", "_count") == 2
    assert value("vllm:prefix_cache_hits", "_total") > 0
    assert value("vllm:request_params_n", "_sum") == 2 and value("vllm:request_params_max_tokens", "_sum") == 6
    # vLLM's count adds up to the tokens served: every prompt (cached blocks or not) and every token
    served = value("vllm:request_prompt_tokens", "_sum") + value("vllm:generation_tokens", "_total")
    assert value("vllm:iteration_tokens_total", "_sum") == served
    assert value("vllm:num_requests_running") == 0 and value("vllm:kv_cache_usage_perc") == 0
    assert value("vllm:num_requests_waiting_by_reason", reason="capacity") == 0
    assert value("vllm:num_requests_waiting_by_reason", reason="deferred") == 0
    assert "trio_llm_requests_running" in families  # the old names stay beside them


async def test_a_browser_preflight_gets_cors_headers_even_with_an_api_key(tiny_model_dir):
    settings = ServerSettings(api_key="k", cors=CorsSettings(allowed_origins=("https://app.example",)))
    async with running_server(engine_config(tiny_model_dir), settings) as server:
        preflight = await request(server.url, "OPTIONS", "/v1/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status == 200
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
        answer = await request(server.url, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                               headers={"Origin": "https://app.example", "Authorization": "Bearer k"})
        assert answer.status == 200 and answer.headers["access-control-allow-origin"] == "https://app.example"
        stranger = await request(server.url, "OPTIONS", "/v1/completions", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in stranger.headers


async def test_cors_defaults_allow_every_origin_as_vllms_do(server):
    answer = await request(server.url, "GET", "/v1/models", headers={"Origin": "https://any.example"})
    assert answer.status == 200 and answer.headers["access-control-allow-origin"] == "*"


async def test_the_request_log_is_one_json_line_per_request_without_the_prompt(tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="trio_llm.requests")
    async with running_server(engine_config(tiny_model_dir), ServerSettings(log_requests=True)) as server:
        done = await request(server.url, "POST", "/v1/completions",
                             {"prompt": "a secret prompt", "max_tokens": 3, "ignore_eos": True})
        assert done.status == 200
    (line,) = [r.getMessage() for r in caplog.records if r.name == "trio_llm.requests"]
    record = json.loads(line)
    assert record["request_id"].startswith(done.json()["id"]) and record["finish_reason"] == "length"
    assert record["generation_tokens"] == 3 and record["prompt_tokens"] > 0
    assert record["ttft"] >= 0 and record["e2e"] >= record["ttft"] and "secret" not in line
