"""POST /v1/messages with the official `anthropic` client: text, tool use (forced and named, streamed
and not), the chat path's tokens, Anthropic's stream events and error shape."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from engine.outputs import CompletionOutput, RequestOutput
from tests.conftest import engine_config
from tests.server_fixtures import CONVERSATION_TEMPLATE, WEATHER, record_chat_prompts, running_server
from web.anthropic.messages import MessagesRequest, MessagesStream
from web.chat.protocol import ChatCompletionRequest
from web.chat.run import ChatRun
from web.http.settings import ServerSettings

TEMPLATE = ("{% if tools %}TOOLS{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
            + CONVERSATION_TEMPLATE)
TOOLS = [{"name": "weather", "description": "forecast", "input_schema": WEATHER}]
GREEDY = {"temperature": 0}  # vLLM's Messages endpoint takes it; Anthropic's client sends it as an extra field


@pytest.fixture
async def server(tiny_model_dir):
    async with running_server(engine_config(tiny_model_dir, chat_template=TEMPLATE), ServerSettings()) as server:
        yield server


@pytest.fixture
async def clients(server):
    claude = anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0)
    gpt = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    async with claude, gpt:
        yield claude, gpt, server.state.model_name


async def test_a_message_is_the_chat_answer_to_the_same_conversation(clients):
    claude, gpt, served = clients
    out = await claude.messages.create(model=served, max_tokens=12, system="be brief", extra_body=GREEDY,
                                       messages=[{"role": "user", "content": "hello"}])
    chat = await gpt.chat.completions.create(model=served, max_tokens=12, temperature=0,
                                             messages=[{"role": "system", "content": "be brief"},
                                                       {"role": "user", "content": "hello"}])
    assert out.type == "message" and out.role == "assistant" and out.id.startswith("msg_")
    assert [block.type for block in out.content] == ["text"]
    assert out.content[0].text == chat.choices[0].message.content
    assert out.stop_reason == "max_tokens" and out.stop_sequence is None
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat.usage.prompt_tokens, 12)


async def test_streamed_events_add_up_to_the_whole_message(clients):
    claude, _, served = clients
    ask = {"model": served, "max_tokens": 10, "extra_body": GREEDY,
           "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "!"}]}]}
    whole = await claude.messages.create(**ask)
    kinds, text = [], ""
    async with claude.messages.stream(**ask) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta":
                text += event.delta.text
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10


async def test_a_stop_sequence_is_named_as_the_stop_reason(clients):
    claude, _, served = clients
    first = await claude.messages.create(model=served, max_tokens=8, extra_body=GREEDY,
                                         messages=[{"role": "user", "content": "go"}])
    stop = first.content[0].text[3:5]
    assert stop.strip(), "the tiny model's answer should have characters to stop at"
    out = await claude.messages.create(model=served, max_tokens=8, extra_body=GREEDY, stop_sequences=[stop],
                                       messages=[{"role": "user", "content": "go"}])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    whole = first.content[0].text
    assert "".join(block.text for block in out.content) == whole[:whole.index(stop)]


async def test_forced_tool_use_is_a_valid_tool_use_block_streamed_or_not(clients):
    claude, _, served = clients
    for choice in ({"type": "any"}, {"type": "tool", "name": "weather"}):
        ask = {"model": served, "max_tokens": 60, "tools": TOOLS, "tool_choice": choice,
               "messages": [{"role": "user", "content": "weather?"}]}
        out = await claude.messages.create(**ask)
        uses = [block for block in out.content if block.type == "tool_use"]
        assert len(uses) >= 1 and uses[0].name == "weather"
        jsonschema.validate(uses[0].input, WEATHER)
        assert out.stop_reason == ("tool_use" if choice["type"] == "any" else "end_turn")
        async with claude.messages.stream(**ask) as stream:
            final = await stream.get_final_message()
        streamed = [block for block in final.content if block.type == "tool_use"]
        assert streamed and streamed[0].name == "weather"
        jsonschema.validate(streamed[0].input, WEATHER)


async def test_output_config_format_constrains_the_text_to_the_schema(clients):
    claude, _, served = clients
    out = await claude.messages.create(model=served, max_tokens=80, messages=[{"role": "user", "content": "json"}],
                                       output_config={"format": {"type": "json_schema", "schema": WEATHER}})
    jsonschema.validate(json.loads(out.content[0].text), WEATHER)
    assert out.stop_reason == "end_turn"


async def test_a_tool_result_goes_back_to_the_model_as_a_tool_message(clients, server):
    claude, _, served = clients
    rendered = record_chat_prompts(server)
    await claude.messages.create(model=served, max_tokens=4, tools=TOOLS, tool_choice={"type": "none"}, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "checking"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "text", "text": "and tomorrow?"}]}])
    (messages,) = rendered
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "user"]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "weather", "arguments": {"city": "Oslo"}}
    assert messages[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}


async def test_bad_requests_get_anthropics_error_shape_and_the_server_serves_on(clients):
    claude, _, served = clients
    bad = [{"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
           {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
           {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "maybe"}},
           {"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
           {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "extra_body": {"temperature": -1}},
           {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "output_config": {"effort": "max"}},
           {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled",
                                                                                      "budget_tokens": 1024}}]
    for body in bad:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await claude.messages.create(model=served, **body)
        assert caught.value.body["type"] == "error"
        assert caught.value.body["error"]["type"] == "invalid_request_error"
        assert caught.value.body["error"]["message"]
    ok = await claude.messages.create(model=served, max_tokens=3, messages=[{"role": "user", "content": "x"}])
    assert ok.usage.output_tokens == 3


def test_the_chat_body_carries_system_tools_and_choice():
    body = MessagesRequest.model_validate({
        "max_tokens": 7, "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        "messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AAAA"}}, {"type": "text", "text": "see"}]}],
        "tools": TOOLS, "tool_choice": {"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"], "top_k": 3}).chat_body()
    assert body["messages"][0] == {"role": "system", "content": "ab"}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert body["messages"][1]["content"][0] == image
    assert body["tools"][0]["function"]["parameters"] == WEATHER
    assert body["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert body["parallel_tool_calls"] is False and body["stop"] == ["END"] and body["top_k"] == 3


def _output(text: str, finish: str | None, tokens: int) -> tuple[int, RequestOutput]:
    completion = CompletionOutput(index=0, text=text, token_ids=list(range(tokens)), finish_reason=finish)
    return 0, RequestOutput(request_id="r", prompt="p", prompt_token_ids=[1, 2], outputs=[completion],
                            finished=finish is not None)


def test_reasoning_streams_as_a_thinking_block_before_the_text_block():
    first = _output("<think>a", None, 1)
    run = ChatRun(first=first, outputs=None, response_id="msg_x", created=0, model_name="m", tool_plan=None,
                  reasoning_parser="qwen3", top_logprobs=None, request=ChatCompletionRequest(messages=[]))
    stream = MessagesStream(run)
    events = stream.events(first) + stream.events(_output("b</think>", None, 2)) + \
        stream.events(_output("answer", "stop", 1)) + stream.closing()
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    thinking = "".join(e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta")
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert starts == ["thinking", "text"] and thinking == "ab" and text.strip() == "answer"
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1]
    (delta,) = [e for e in events if e["type"] == "message_delta"]
    assert delta["delta"]["stop_reason"] == "end_turn" and delta["usage"]["output_tokens"] == 4
    assert events[-1] == {"type": "message_stop"}
    assert json.dumps(events)  # plain JSON all the way down


async def test_anthropics_client_authenticates_with_its_x_api_key_header(tiny_model_dir):
    async with running_server(engine_config(tiny_model_dir), ServerSettings(api_key="sesame")) as server:
        served = server.state.model_name
        ask = {"model": served, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
        async with anthropic.AsyncAnthropic(base_url=server.url, api_key="sesame", max_retries=0) as claude:
            assert (await claude.messages.create(**ask)).usage.output_tokens == 2
        async with anthropic.AsyncAnthropic(base_url=server.url, api_key="wrong", max_retries=0) as claude:
            with pytest.raises(anthropic.AuthenticationError):
                await claude.messages.create(**ask)
