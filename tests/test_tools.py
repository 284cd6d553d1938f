"""Tool calling with the openai client: required and named choices constrained to well-formed calls,
auto parsed by the hermes and llama3_json parsers, streaming, and tool messages in the history."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.conftest import engine_config
from tests.server_fixtures import running_server
from web.chat.outputs import chat_message
from web.chat.tools import ToolPlan, parse_calls, plan_tools
from web.http.settings import ServerSettings

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 10},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "parameters": TIME}}]
SCHEMAS = {"weather": WEATHER, "clock": TIME}
TEMPLATE = ("{% if tools %}TOOLS{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}\n{% endfor %}assistant:")


@pytest.fixture
async def client(tiny_model_dir):
    settings = ServerSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")
    async with running_server(engine_config(tiny_model_dir, chat_template=TEMPLATE), settings) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        async with client:
            client.served = server.state.model_name
            yield client


def ask(text="what is the weather?"):
    return [{"role": "user", "content": text}]


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def test_required_gives_well_formed_calls_from_a_random_model(client):
    for seed in range(3):
        out = await client.chat.completions.create(model=client.served, messages=ask(), tools=TOOLS, seed=seed,
                                                   tool_choice="required", max_tokens=200, temperature=1.0)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls)
    single = await client.chat.completions.create(model=client.served, messages=ask(), tools=TOOLS, seed=5,
                                                  tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    assert len(single.choices[0].message.tool_calls) == 1


class Closed(pydantic.BaseModel):  # additionalProperties: false, or a random model adds keys forever
    model_config = pydantic.ConfigDict(extra="forbid")


class Address(Closed):
    city: str = pydantic.Field(max_length=8)
    zone: Literal["UTC", "CET"]


class Visit(Closed):
    to: Address
    days: Literal[1, 2, 3]  # numbers kept short: a random model writes unbounded digits (issue 34)


class Ship(Closed):  # its own Address: the same $defs name as Visit's, another schema
    class Address(Closed):
        box: str = pydantic.Field(max_length=4)

    where: Address


async def test_required_calls_of_tools_whose_schemas_use_defs(client):
    """pydantic writes nested models as $defs and $ref (issue 34: "Pointer '/$defs/...' does not
    exist"); each tool's definitions stay its own in the array of calls."""
    schemas = {"visit": Visit.model_json_schema(), "ship": Ship.model_json_schema()}
    assert "$defs" in schemas["visit"] and "$defs" in schemas["ship"]
    tools = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in schemas.items()]
    for seed in range(3):
        # one call: a random model's array of calls can run past any max_tokens (issue 34 again)
        out = await client.chat.completions.create(model=client.served, messages=ask(), tools=tools, seed=seed,
                                                   tool_choice="required", parallel_tool_calls=False,
                                                   max_tokens=300, temperature=1.0)
        calls = out.choices[0].message.tool_calls
        assert calls and out.choices[0].finish_reason == "tool_calls", out.choices[0]
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_an_array_of_calls_cut_short_keeps_its_whole_calls_as_the_stream_sent_them():
    plan = plan_tools(TOOLS, "required", True, False, None)
    whole = '{"name": "clock", "parameters": {"zone": "UTC"}}'
    cut = f'[{whole}, {whole},  {{"name": "weather", "parameters": {{"city": "Oslo", "da'
    message, finish = chat_message(cut, "length", plan)
    assert finish == "length" and message["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"zone": "UTC"}] * 2
    early = '[{"name": "clock", "parameters": {"zo'
    message, _ = chat_message(early, "length", plan)
    assert message["content"] == early and message["tool_calls"] is None  # nothing whole: the text is all


def test_a_tools_reference_to_its_own_root_points_at_a_copy_of_it():
    tree = {"type": "object", "properties": {"child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}
    tools = [{"type": "function", "function": {"name": "tree", "parameters": tree}}]
    array = plan_tools(tools, "required", True, False, None).structured.json
    assert array["$defs"]["tool0_root"]["properties"]["child"]["anyOf"][0] == {"$ref": "#/$defs/tool0_root"}


async def test_a_named_function_is_called(client):
    out = await client.chat.completions.create(model=client.served, messages=ask(), tools=TOOLS, max_tokens=200,
                                               tool_choice={"type": "function", "function": {"name": "clock"}})
    calls = out.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["clock"] and out.choices[0].finish_reason == "stop"
    check_calls(calls)


async def test_streamed_calls_add_up_to_the_same_message(client):
    stream = await client.chat.completions.create(model=client.served, messages=ask(), tools=TOOLS, seed=2,
                                                  tool_choice="required", max_tokens=200, stream=True)
    calls, finish, pieces = {}, None, 0
    async for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
                pieces += bool(delta.function.arguments)
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls
    assert pieces > 2 * len(calls)  # the arguments arrived in pieces, not whole
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])


async def test_the_template_sees_the_tools_and_history_with_tool_messages_is_accepted(client):
    without = await client.chat.completions.create(model=client.served, messages=ask(), max_tokens=2)
    with_tools = await client.chat.completions.create(model=client.served, messages=ask(), tools=TOOLS,
                                                      tool_choice="none", max_tokens=2)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 2
    assert with_tools.choices[0].message.tool_calls is None  # vLLM's null (not []) when no call was made
    raw = await client.chat.completions.with_raw_response.create(model=client.served, messages=ask(), tools=TOOLS,
                                                                tool_choice="none", max_tokens=2)
    assert '"tool_calls":null' in raw.text, raw.text
    history = [*ask(), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "clock", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    out = await client.chat.completions.create(model=client.served, messages=history, tools=TOOLS, max_tokens=4)
    assert out.choices[0].message.role == "assistant"  # auto, hermes: free text without calls is content


@pytest.mark.parametrize("tool_choice, message", [
    ({"type": "function", "function": {"name": "nope"}}, "not among the tools"),
    ("sometimes", "tool_choice must be"),
])
async def test_bad_tool_choices_are_400s(client, tool_choice, message):
    with pytest.raises(openai.BadRequestError, match=message):
        await client.chat.completions.create(model=client.served, messages=ask(), tools=TOOLS,
                                             tool_choice=tool_choice, max_tokens=4)


async def test_auto_needs_the_flags(tiny_model_dir):
    async with running_server(engine_config(tiny_model_dir)) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        async with client:
            with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
                await client.chat.completions.create(model=server.state.model_name, messages=ask(), tools=TOOLS,
                                                     max_tokens=4)


def test_hermes_and_llama3_json_parsers():
    content, calls = parse_calls("hermes", 'Let me check.\n<tool_call>\n{"name": "clock", "arguments": '
                                           '{"zone": "UTC"}}\n</tool_call>\n<tool_call>{"name": "weather", '
                                           '"arguments": {"city": "Oslo", "days": 2}}</tool_call>')
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("clock", {"zone": "UTC"}), ("weather", {"city": "Oslo", "days": 2})]
    assert parse_calls("hermes", "no calls here") == ("no calls here", [])
    content, calls = parse_calls("llama3_json", '<|python_tag|>{"name": "clock", "parameters": {"zone": "CET"}}; '
                                                '{"name": "weather", "parameters": {"city": "Rome", "days": 1}}')
    assert content is None and [c["function"]["name"] for c in calls] == ["clock", "weather"]
    assert parse_calls("llama3_json", "{not json") == ("{not json", [])
    assert ToolPlan("none", []).makes_calls is False


async def test_continue_final_message_and_invocations(client):
    from bench.http import request

    messages = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one two"}]
    out = await client.chat.completions.create(model=client.served, messages=messages, max_tokens=3,
                                               extra_body={"continue_final_message": True,
                                                           "add_generation_prompt": False})
    plain = await client.chat.completions.create(model=client.served, messages=messages, max_tokens=3)
    assert out.usage.prompt_tokens < plain.usage.prompt_tokens  # ends inside the assistant turn
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        await client.chat.completions.create(model=client.served, messages=messages, max_tokens=3,
                                             extra_body={"continue_final_message": True})
    url = str(client.base_url).removesuffix("/v1/")
    for body, kind in (({"messages": messages, "max_tokens": 2}, "chat.completion"),
                       ({"prompt": "hi", "max_tokens": 2}, "text_completion")):
        response = await request(url, "POST", "/invocations", body)
        assert response.status == 200 and json.loads(response.body)["object"] == kind
    response = await request(url, "POST", "/invocations", {"neither": 1})
    assert response.status == 400


async def test_auto_calls_parsed_whole_and_streamed(client):
    import re

    written = 'Sure.<tool_call>{"name": "clock", "arguments": {"zone": "UTC"}}</tool_call>'
    forced = {"structured_outputs": {"regex": re.escape(written)}}
    out = await client.chat.completions.create(model=client.served, messages=ask(), tools=TOOLS, max_tokens=60,
                                               extra_body=forced)
    message = out.choices[0].message
    assert message.content == "Sure." and out.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("clock", {"zone": "UTC"})]
    stream = await client.chat.completions.create(model=client.served, messages=ask(), tools=TOOLS, max_tokens=60,
                                                  stream=True, extra_body=forced)
    content, name, arguments, finish = "", "", "", None
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                name += delta.function.name or ""
                arguments += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert (content, name, json.loads(arguments), finish) == ("Sure.", "clock", {"zone": "UTC"}, "tool_calls")


def test_a_calls_arguments_are_whole_before_the_next_call_opens():
    """Required calls stream as a JSON array. When one piece of text ends a call and starts the
    next, the first call's arguments are sent whole before the second call's header, so that an
    API whose blocks close in order (Anthropic's, the Responses API) never puts one call's rest in
    the next call's block."""
    from web.chat.tools import ToolCallStream

    stream = ToolCallStream(ToolPlan("required", []))
    pieces = ['[{"name": "weather", "parameters": {"city": "ab', 'c\u057c"}}, {"name": "weather", "parameters": {"ci',
              'ty": "x"}}]']
    order = []
    for i, piece in enumerate(pieces):
        _, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        order += [(d["index"], "header" if "id" in d else d["function"]["arguments"]) for d in deltas]
    first = "".join(text for index, text in order if index == 0 and text != "header")
    assert json.loads(first) == {"city": "abc\u057c"}
    assert order.index((1, "header")) > max(i for i, (index, _) in enumerate(order) if index == 0)
    second = "".join(text for index, text in order if index == 1 and text != "header")
    assert json.loads(second) == {"city": "x"}
