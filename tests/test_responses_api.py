"""POST /v1/responses with the openai client: text, instructions, stored conversations chained by
previous_response_id, function calls and their outputs, text.format, streaming events, errors."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.conftest import engine_config
from tests.server_fixtures import CONVERSATION_TEMPLATE, WEATHER, record_chat_prompts, running_server
from web.http.settings import ServerSettings
from web.openai.responses import ResponseStore, StoredResponse

TEMPLATE = CONVERSATION_TEMPLATE
TOOLS = [{"type": "function", "name": "weather", "description": "forecast", "parameters": WEATHER}]


@pytest.fixture
async def server(tiny_model_dir):
    async with running_server(engine_config(tiny_model_dir, chat_template=TEMPLATE), ServerSettings()) as server:
        yield server


@pytest.fixture
async def client(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    async with client:
        client.served = server.state.model_name
        yield client


@pytest.fixture
def rendered(server):
    """The chat messages each request rendered, in order."""
    return record_chat_prompts(server)


async def test_a_response_is_the_chat_answer_and_carries_usage(client):
    out = await client.responses.create(model=client.served, input="hello", instructions="be brief",
                                        max_output_tokens=9, temperature=0)
    chat = await client.chat.completions.create(model=client.served, max_tokens=9, temperature=0, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.output_text == chat.choices[0].message.content
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat.usage.prompt_tokens, 9)
    assert out.instructions == "be brief"
    fetched = await client.responses.retrieve(out.id)
    assert fetched.output_text == out.output_text


async def test_previous_response_id_continues_the_stored_conversation(client, rendered):
    first = await client.responses.create(model=client.served, input="one", instructions="sys", max_output_tokens=4)
    await client.responses.create(model=client.served, input=[{"role": "user", "content": "two"}],
                                  previous_response_id=first.id, max_output_tokens=4)
    assert rendered[-1] == [{"role": "user", "content": "one"}, {"role": "assistant", "content": first.output_text},
                            {"role": "user", "content": "two"}]  # instructions are not carried over
    unstored = await client.responses.create(model=client.served, input="x", store=False, max_output_tokens=2)
    for missing in (unstored.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model=client.served, input="y", previous_response_id=missing)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(missing)


async def test_forced_function_calls_and_their_outputs_round_trip(client, rendered):
    out = await client.responses.create(model=client.served, input="weather?", tools=TOOLS, tool_choice="required",
                                        max_output_tokens=60)
    calls = [item for item in out.output if item.type == "function_call"]
    # a random model's array of calls may run past the limit: its whole calls are kept either way
    assert calls and calls[0].name == "weather" and out.status in ("completed", "incomplete")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    await client.responses.create(model=client.served, previous_response_id=out.id, tools=TOOLS, max_output_tokens=3,
                                  tool_choice="none", input=[{"type": "function_call_output",
                                                              "call_id": calls[0].call_id, "output": "sunny"}])
    history = rendered[-1]
    assert history[1]["role"] == "assistant" and history[1]["tool_calls"][0]["id"] == calls[0].call_id
    assert history[2] == {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"}


async def test_text_format_constrains_the_output_to_the_schema(client):
    out = await client.responses.create(model=client.served, input="json", max_output_tokens=80, text={
        "format": {"type": "json_schema", "name": "w", "schema": WEATHER}})
    jsonschema.validate(json.loads(out.output_text), WEATHER)


async def test_streamed_events_build_the_same_response(client):
    ask = {"model": client.served, "input": "hi", "max_output_tokens": 8, "temperature": 0}
    whole = await client.responses.create(**ask)
    stream = await client.responses.create(**ask, stream=True)
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 1
    tools = await client.responses.create(model=client.served, input="w", tools=TOOLS, tool_choice="required",
                                          max_output_tokens=60, stream=True, parallel_tool_calls=False)
    events = [event async for event in tools]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == done.arguments and events[-1].type == "response.completed"
    jsonschema.validate(json.loads(arguments), WEATHER)


async def test_bad_requests_are_400s_naming_the_problem_and_the_server_serves_on(client):
    bad = [({"input": [{"role": "robot", "content": "x"}]}, "role"),
           ({"input": [{"type": "web_search_call"}]}, "unsupported input item"),
           ({"input": "x", "tools": [{"type": "web_search"}]}, "function tools only"),
           ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
           ({"input": "x", "text": {"verbosity": "low"}}, "verbosity"),
           ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
           ({"input": "x", "max_output_tokens": 0}, "max_output_tokens")]
    for body, words in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model=client.served, **body)
        assert words in caught.value.message
    ok = await client.responses.create(model=client.served, input="x", max_output_tokens=2)
    assert ok.usage.output_tokens == 2


def test_the_store_forgets_the_oldest_response_first():
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({}, []))
    store.get("a")  # read: now the most recent
    store.put("c", StoredResponse({}, []))
    assert list(store.responses) == ["a", "c"]


async def test_the_sdk_stream_helper_accumulates_text_and_function_calls(client):
    """`client.responses.stream()` checks OpenAI's event sequence as it goes (an item announced
    twice, or present in `response.created`, raises): text and a function call both pass through it."""
    ask = {"model": client.served, "input": "hi", "max_output_tokens": 8, "temperature": 0}
    whole = await client.responses.create(**ask)
    async with client.responses.stream(**ask) as stream:
        events = [event async for event in stream]
    assert events[0].type == "response.created" and events[0].response.output == []
    # cut by max_output_tokens: OpenAI ends with `response.incomplete` (the helper's final response
    # is for `response.completed` only)
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == whole.output_text
    async with client.responses.stream(model=client.served, input="w", tools=TOOLS, tool_choice="required",
                                       max_output_tokens=60, parallel_tool_calls=False) as stream:
        final = await stream.get_final_response()
    (call,) = [item for item in final.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER)
