"""Reading a request and writing its answer, for every family's handlers: the body read as it
arrives (413 past the limit), parsed and validated off the loop when large, its model and fields
checked; JSON answers built off the loop when large; an engine stream's first and final outputs;
small work inline and large work in a thread.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from functools import partial
from typing import Any

from pydantic_core import to_json
from quart import Response, current_app, g, request

from engine.api import EngineDeadError, RequestOutput
from engine.concurrency.offload import run_sized
from web.http.bodies import check_model, parse_body
from web.http.errors import APIError, bad_request
from web.http.fields import check_fields
from web.http.state import ServerState

# Bodies and responses above these sizes are parsed / built in a worker thread.
OFFLOAD_BODY_BYTES = 64 << 10
OFFLOAD_RESPONSE_TOKENS = 4096


async def read_request(state: ServerState, model: type) -> Any:
    """Cancellation (a client that goes away) stops reading; a body parse running in a thread
    finishes first.
    """
    body = await read_body()
    parse = partial(parse_body, model, split_embeds_bytes=state.settings.split_embeds_bytes)
    parsed = await run_sized(parse, body, size=len(body), inline_below=OFFLOAD_BODY_BYTES, limiter=state.limiter)
    check_model(getattr(parsed, "model", None), state.accepted_model_names)  # LoRA loads name none
    check_fields(parsed, state.settings.allow_unknown_fields)
    return parsed


async def read_body() -> bytearray:
    """The body, collected as it arrives. Quart's `get_data` would copy all of it once more at
    the end, with the GIL held (~3 ms for a 22 MB prompt_embeds body).

    The limit (`MAX_CONTENT_LENGTH`) is counted here as the bytes arrive: Quart checks a
    declared Content-Length, but a chunked body declares none, and this loop drains Quart's
    buffer before its own check could see the total. Past the limit: 413 at once.

    Cancellation (the client went away) stops reading.
    """
    if "trio_llm_body" in g:  # read already (/invocations looked at it to choose the endpoint)
        read: bytearray = g.trio_llm_body
        return read
    limit = current_app.config["MAX_CONTENT_LENGTH"]
    body = bytearray()
    async for chunk in request.body:
        body += chunk
        if limit is not None and len(body) > limit:
            raise APIError(413, f"the request body exceeds the limit of {limit} bytes")
    return body


def top_level_keys(body: bytes | bytearray) -> set[str]:
    """The top-level keys of a JSON object body (a 400 for anything else)."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(value, dict):
        raise bad_request("the request body must be a JSON object")
    return set(value)


async def json_response(state: ServerState, build: Callable[[], Any], num_tokens: int) -> Response:
    """Cancellation drops a thread's result once the thread returns."""
    body = await run_sized(lambda: to_json(build()), size=num_tokens, inline_below=OFFLOAD_RESPONSE_TOKENS,
                           limiter=state.limiter)
    return Response(body, content_type="application/json")


async def first_item(outputs: AsyncIterator[Any]) -> Any:
    """Run the stream up to its first output, so that invalid input is a 400, not a stream error.

    Cancellation closes the stream, which aborts its engine requests.
    """
    first = await anext(outputs, None)
    if first is None:
        raise EngineDeadError("the engine stopped before the request produced any output")
    return first


async def final_outputs(first: Any, outputs: AsyncIterator[Any], num_prompts: int) -> list[RequestOutput]:
    """Drain a FINAL_ONLY batch stream into one finished output per prompt, in prompt order.

    Cancellation closes the stream, which aborts its engine requests.
    """
    finals: list[RequestOutput | None] = [None] * num_prompts
    item = first
    while item is not None:
        finals[item[0]] = item[1]
        item = await anext(outputs, None)
    if any(out is None for out in finals):
        raise EngineDeadError("the engine stopped before every prompt finished")
    return finals  # type: ignore[return-value]


async def prepend(head: bytes, body: AsyncGenerator[bytes]) -> AsyncGenerator[bytes]:
    """`head`, then `body`. Closing this (the client went away: cancellation) closes `body`, whose
    finally aborts its requests."""
    async with aclosing(body):  # closing this closes the body at once (its finally aborts the request)
        yield head
        async for chunk in body:
            yield chunk


# Work smaller than this (characters to tokenize, floats to format) costs less on the loop than the
# ~100-200 us thread hop (measured: `trio-llm bench embed`); larger work always goes to a thread.
INLINE_WORK = 4096


async def offload(state: ServerState, fn: Callable[..., Any], *args: Any, size: int = INLINE_WORK) -> Any:
    """Run `fn` in a worker thread under the server's shared limiter, or inline when `size` is small.

    Cancellation drops a thread's result once the thread returns.
    """
    return await run_sized(fn, *args, size=size, inline_below=INLINE_WORK, limiter=state.limiter)
