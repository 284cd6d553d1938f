"""Reasoning parsers split <think>...</think> into reasoning_content, streamed or not, and
chat_template_kwargs reach the template."""

from __future__ import annotations

import json
import re

import openai
import pytest

from bench.http import request
from tests.conftest import engine_config
from tests.server_fixtures import running_server
from web.chat.reasoning import reasoning_stream, split_reasoning
from web.http.settings import ServerSettings

TEMPLATE = ("{% if enable_thinking %}THINK THINK THINK\n{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
FORCED = {"structured_outputs": {"regex": "<think>\nab cd</think>\n\nxy z"}}


@pytest.fixture
async def client(tiny_model_dir):
    settings = ServerSettings(reasoning_parser="qwen3")
    async with running_server(engine_config(tiny_model_dir, chat_template=TEMPLATE), settings) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        async with client:
            client.served = server.state.model_name
            yield client


MESSAGES = [{"role": "user", "content": "think first"}]
# A closed </think> in the prompt makes a grammar apply from the first token: the regex then writes
# the reasoning and the answer these tests parse.
FORCED_MESSAGES = [{"role": "user", "content": "go x</think>"}]


async def test_reasoning_content_split_whole_and_streamed(client):
    out = await client.chat.completions.create(model=client.served, messages=FORCED_MESSAGES, max_tokens=60,
                                               extra_body=FORCED)
    message = out.choices[0].message
    assert message.reasoning_content == message.reasoning == "ab cd" and message.content == "xy z"
    stream = await client.chat.completions.create(model=client.served, messages=FORCED_MESSAGES, max_tokens=60,
                                                  stream=True, extra_body=FORCED)
    reasoning = reasoning_032 = content = ""  # vLLM 0.32's `reasoning`, and `reasoning_content`
    async for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            reasoning_032 += getattr(choice.delta, "reasoning", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, reasoning_032, content) == ("ab cd", "ab cd", "xy z")


async def test_chat_template_kwargs_reach_the_template(client):
    plain = await client.chat.completions.create(model=client.served, messages=MESSAGES, max_tokens=1)
    thinking = await client.chat.completions.create(model=client.served, messages=MESSAGES, max_tokens=1,
                                                    extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert thinking.usage.prompt_tokens > plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="may not set 'messages'"):
        await client.chat.completions.create(model=client.served, messages=MESSAGES, max_tokens=1,
                                             extra_body={"chat_template_kwargs": {"messages": []}})


@pytest.mark.parametrize("parser, text, expected", [
    ("qwen3", "<think>\nplan</think>\n\nanswer", ("plan", "answer")),
    ("qwen3", "no thinking at all", (None, "no thinking at all")),
    ("deepseek_r1", "still thinking when cut off", ("still thinking when cut off", "")),
    ("deepseek_r1", "why</think>because", ("why", "because")),
    ("openai_gptoss", "<|channel|>analysis<|message|>plan it<|end|><|start|>assistant<|channel|>final<|message|>answer",
     ("plan it", "answer")),
    ("openai_gptoss", "<|channel|>analysis<|message|>cut off while thinking", ("cut off while thinking", "")),
    ("openai_gptoss", "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
     "<|start|>assistant<|channel|>final<|message|>x < y<|return|>", ("ab", "x < y")),
    ("openai_gptoss", "plain text, no channel", (None, "plain text, no channel")),
])
def test_split_whole_and_in_any_chunking(parser, text, expected):
    assert split_reasoning(parser, text) == expected
    for size in (1, 2, 3, 7):
        splitter, reasoning, content = reasoning_stream(parser), "", ""
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            r, c = splitter.feed(piece, final=i == len(pieces) - 1)
            reasoning, content = reasoning + r, content + c
        assert (reasoning or None, content) == expected, size


async def test_structured_outputs_apply_after_the_reasoning(client):
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    closed = [{"role": "user", "content": "x</think>"}]  # thinking already over (as with enable_thinking off)
    out = await client.chat.completions.create(model=client.served, messages=closed, max_tokens=30, seed=1,
                                               response_format=response_format)
    assert json.loads(out.choices[0].message.content) in ({"a": True}, {"a": False})
    still_thinking = await client.chat.completions.create(model=client.served, messages=MESSAGES, max_tokens=12,
                                                          seed=1, temperature=1.0, response_format=response_format)
    text = still_thinking.choices[0].message.content
    assert not text.startswith('{"a"')  # no </think> yet: the model reasons freely, unconstrained


# gpt-oss's harmony format, as its chat template lays it out (a short template of our own: the
# system message names the reasoning effort, each message is <|start|>role<|message|>...<|end|>)
HARMONY_TEMPLATE = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
                    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
                    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
HARMONY_OUTPUT = "<|channel|>analysis<|message|>ab cd<|end|><|start|>assistant<|channel|>final<|message|>xy z"


@pytest.fixture
async def gptoss_server(tiny_model_dir):
    settings = ServerSettings(reasoning_parser="openai_gptoss", tool_call_parser="openai", enable_auto_tool_choice=True)
    async with running_server(engine_config(tiny_model_dir, chat_template=HARMONY_TEMPLATE), settings) as server:
        yield server


async def test_harmony_analysis_is_the_reasoning_and_the_final_channel_the_content(gptoss_server):
    client = openai.AsyncOpenAI(base_url=gptoss_server.url + "/v1", api_key="unused", max_retries=0)
    model = gptoss_server.state.model_name
    forced = {"structured_outputs": {"regex": re.escape(HARMONY_OUTPUT)}}
    # the answer's grammar applies after the reasoning's end, found in this prompt already (as in FORCED_MESSAGES)
    messages = [{"role": "user", "content": "go <|channel|>final<|message|>"}]
    async with client:
        out = await client.chat.completions.create(model=model, messages=messages, max_tokens=80, extra_body=forced)
        assert (out.choices[0].message.reasoning, out.choices[0].message.content) == ("ab cd", "xy z")
        stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=80, stream=True,
                                                      extra_body=forced)
        reasoning = content = ""
        async for chunk in stream:
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning", None) or ""
                content += choice.delta.content or ""
        assert (reasoning, content) == ("ab cd", "xy z")


async def test_harmony_prompts_carry_the_effort_and_keep_special_tokens_for_the_parser(gptoss_server):
    body = {"messages": MESSAGES, "reasoning_effort": "high"}
    rendered = (await request(gptoss_server.url, "POST", "/v1/chat/completions/render", body)).json()
    detok = await request(gptoss_server.url, "POST", "/detokenize", {"tokens": rendered["token_ids"]})
    assert detok.json()["prompt"] == ("<|start|>system<|message|>Reasoning: high<|end|>"
                                      "<|start|>user<|message|>think first<|end|><|start|>assistant")
    # harmony's tags are special tokens in gpt-oss's tokenizer: skipping them would leave nothing to parse
    assert rendered["sampling_params"]["skip_special_tokens"] is False


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
HARMONY_CALL = ("<|channel|>analysis<|message|>need the weather<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>')


@pytest.mark.parametrize("stream", [False, True])
async def test_harmony_messages_to_functions_are_tool_calls(gptoss_server, stream):
    client = openai.AsyncOpenAI(base_url=gptoss_server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "go <|channel|>final<|message|>"}]  # the grammar applies at once
    request = dict(model=gptoss_server.state.model_name, messages=messages, max_tokens=200, tools=[WEATHER],
                   extra_body={"structured_outputs": {"regex": re.escape(HARMONY_CALL)}})
    async with client:
        if not stream:
            choice = (await client.chat.completions.create(**request)).choices[0]
            reasoning, content, calls = choice.message.reasoning, choice.message.content, choice.message.tool_calls
            finish = choice.finish_reason
        else:
            reasoning, content, calls, finish = "", None, [], None
            async for chunk in await client.chat.completions.create(**request, stream=True):
                for delta_choice in chunk.choices:
                    reasoning += getattr(delta_choice.delta, "reasoning", None) or ""
                    content = delta_choice.delta.content or content
                    calls += delta_choice.delta.tool_calls or []
                    finish = delta_choice.finish_reason or finish
    assert reasoning == "need the weather" and not content and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_a_harmony_call_named_in_the_role_header_and_the_parser_pairing():
    from web.chat.tools import parse_calls

    text = (' to=functions.lookup<|channel|>commentary json<|message|>{"q": 1}<|call|>'
            "<|start|>assistant<|channel|>final<|message|>done")
    content, calls = parse_calls("openai", text)
    assert content == "done" and [c["function"]["name"] for c in calls] == ["lookup"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"q": 1}
    with pytest.raises(ValueError, match="needs --reasoning-parser openai_gptoss"):
        ServerSettings(tool_call_parser="openai")
