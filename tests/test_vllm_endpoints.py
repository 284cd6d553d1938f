"""vLLM's own endpoints, checked as its clients read them: /v1/chat/completions/batch, the render
endpoints, /tokenize with tools, ORCA load reports and the iteration metrics."""

from __future__ import annotations

import json

import pytest

from bench.http import request
from tests.conftest import engine_config
from tests.server_fixtures import running_server
from tests.test_tools import TEMPLATE, TOOLS
from web.http.settings import ServerSettings

CONVERSATIONS = [[{"role": "user", "content": "hello there"}],
                 [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count to three"}],
                 [{"role": "user", "content": "x"}]]


@pytest.fixture
async def server(tiny_model_dir):
    settings = ServerSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")
    async with running_server(engine_config(tiny_model_dir, chat_template=TEMPLATE), settings) as running:
        yield running


async def post(server, path: str, body: dict) -> dict:
    response = await request(server.url, "POST", path, body)
    assert response.status == 200, response.body[:300]
    return response.json()


async def test_batch_chat_gives_choice_i_for_conversation_i(server):
    batch = await post(server, "/v1/chat/completions/batch",
                       {"messages": CONVERSATIONS, "max_tokens": 5, "temperature": 0, "return_token_ids": True})
    assert batch["object"] == "chat.completion" and batch["id"].startswith("chatcmpl-")
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    prompt_tokens = 0
    for conversation, choice in zip(CONVERSATIONS, batch["choices"], strict=True):
        single = await post(server, "/v1/chat/completions",
                            {"messages": conversation, "max_tokens": 5, "temperature": 0, "return_token_ids": True})
        assert choice["message"] == single["choices"][0]["message"]
        assert choice["token_ids"] == single["choices"][0]["token_ids"]
        prompt_tokens += single["usage"]["prompt_tokens"]
    assert batch["usage"]["prompt_tokens"] == prompt_tokens
    assert batch["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in batch["choices"])


@pytest.mark.parametrize("extra, param", [({"stream": True}, "stream"), ({"tools": TOOLS}, "tools"),
                                          ({"n": 2}, "n"), ({"messages": []}, "messages"),
                                          ({"messages": [[{"role": "user", "content": 5}]]}, "messages"),
                                          ({"max_tokens": 10 ** 6}, "max_tokens")])
async def test_batch_chat_refuses_what_vllm_refuses(server, extra, param):
    body = {"messages": CONVERSATIONS, "max_tokens": 2, **extra}
    response = await request(server.url, "POST", "/v1/chat/completions/batch", body)
    assert response.status == 400 and response.json()["error"]["param"] == param, response.body[:300]
    assert response.json()["error"]["type"] == "BadRequestError"


async def test_completions_render_is_what_completions_would_run(server):
    rendered = await post(server, "/v1/completions/render",
                          {"prompt": ["hello world", "a b c"], "max_tokens": 7, "temperature": 0.5, "seed": 3,
                           "stop": ["x"], "cache_salt": "salt", "priority": 0})
    assert isinstance(rendered, list) and len(rendered) == 2
    tokenized = await post(server, "/tokenize", {"prompt": "hello world"})
    first = rendered[0]
    assert first["token_ids"] == tokenized["tokens"] and first["request_id"].startswith("cmpl-")
    assert first["features"] is None and first["cache_salt"] == "salt" and first["stream"] is False
    params = first["sampling_params"]
    assert (params["max_tokens"], params["temperature"], params["seed"], params["stop"]) == (7, 0.5, 3, ["x"])
    ran = await post(server, "/v1/completions", {"prompt": "hello world", "max_tokens": 1, "return_token_ids": True})
    assert ran["choices"][0]["prompt_token_ids"] == first["token_ids"]
    # Without max_tokens, vLLM's render fills in what fits the context.
    (whole,) = await post(server, "/v1/completions/render", {"prompt": "hello world", "max_tokens": None})
    assert whole["sampling_params"]["max_tokens"] == server.state.engine.info.max_model_len - len(first["token_ids"])


async def test_chat_render_carries_tools_and_template_into_the_tokens(server):
    body = {"messages": CONVERSATIONS[1], "tools": TOOLS, "tool_choice": "required", "max_tokens": 4}
    rendered = await post(server, "/v1/chat/completions/render", body)
    tokenized = await post(server, "/tokenize", {"messages": CONVERSATIONS[1], "tools": TOOLS})
    assert rendered["token_ids"] == tokenized["tokens"] and rendered["request_id"].startswith("chatcmpl-")
    detok = await post(server, "/detokenize", {"tokens": rendered["token_ids"]})
    assert detok["prompt"].startswith("TOOLS weather clock")
    # tool_choice required is a JSON constraint, visible in the rendered parameters.
    assert rendered["sampling_params"]["structured_outputs"]["json"]["type"] == "array"
    plain = await post(server, "/tokenize", {"messages": CONVERSATIONS[1]})
    assert len(plain["tokens"]) < len(tokenized["tokens"])


async def test_render_refuses_what_generation_refuses(server):
    too_long = await request(server.url, "POST", "/v1/completions/render", {"prompt": "word " * 5000})
    assert too_long.status == 400 and "maximum context length" in too_long.json()["error"]["message"]
    bad_tools = await request(server.url, "POST", "/tokenize",
                              {"messages": CONVERSATIONS[0], "tools": [{"type": "nope"}]})
    assert bad_tools.status == 400 and bad_tools.json()["error"]["param"] == "tools"
    assert server.state.engine.stats().prefix_cache_queries == 0  # nothing was scheduled
    await post(server, "/v1/completions", {"prompt": "now run one", "max_tokens": 1})
    assert server.state.engine.stats().prefix_cache_queries > 0


async def test_orca_load_reports_in_text_and_json_when_asked(server):
    body = {"prompt": "hi", "max_tokens": 1}
    text = await request(server.url, "POST", "/v1/completions", body,
                         headers={"endpoint-load-metrics-format": "TEXT"})
    assert text.status == 200
    assert text.headers["endpoint-load-metrics"] == ("TEXT named_metrics.kv_cache_usage_perc=0.0, "
                                                     "named_metrics.num_requests_waiting=0.0")
    as_json = await request(server.url, "POST", "/v1/chat/completions",
                            {"messages": CONVERSATIONS[0], "max_tokens": 1},
                            headers={"endpoint-load-metrics-format": "json"})
    kind, _, report = as_json.headers["endpoint-load-metrics"].partition(" ")
    assert kind == "JSON" and json.loads(report) == {"named_metrics": {"kv_cache_usage_perc": 0.0,
                                                                        "num_requests_waiting": 0.0}}
    for headers in ({}, {"endpoint-load-metrics-format": "XML"}):
        plain = await request(server.url, "POST", "/v1/completions", body, headers=headers)
        assert plain.status == 200 and "endpoint-load-metrics" not in plain.headers


def test_the_load_report_reads_the_engines_state():
    from engine.api import EngineStats
    from web.http.orca import load_report
    stats = EngineStats(num_running=3, num_waiting=7, kv_cache_usage=0.25, prefix_cache_queries=0,
                        prefix_cache_hits=0, num_preemptions=0, loop_lag=None, loop_lag_max=None,
                        workers_alive=(True,))
    assert load_report("TEXT", stats) == ("TEXT named_metrics.kv_cache_usage_perc=0.25, "
                                          "named_metrics.num_requests_waiting=7.0")
    assert json.loads(load_report("JSON", stats).removeprefix("JSON ")) == {
        "named_metrics": {"kv_cache_usage_perc": 0.25, "num_requests_waiting": 7.0}}


async def test_a_root_path_is_served_with_and_without_the_prefix(tiny_model_dir):
    """vLLM's --root-path: a proxy may strip the prefix or not; probes hit /health at the root."""
    async with running_server(engine_config(tiny_model_dir), ServerSettings(root_path="/llm")) as server:
        for path in ("/llm/v1/models", "/v1/models", "/health", "/llm/health"):
            assert (await request(server.url, "GET", path)).status == 200, path
        completion = await request(server.url, "POST", "/llm/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert completion.status == 200 and completion.json()["usage"]["completion_tokens"] == 2
        assert (await request(server.url, "GET", "/llmx/v1/models")).status == 404  # not the prefix: a path of its own
