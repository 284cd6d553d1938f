"""POST /v1/completions and /v1/chat/completions.

Each request: parse (off the loop when large) -> validate -> one engine
request per prompt -> stream one SSE event per engine step per request, or
collect the final outputs and build the body (off the loop when large).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from pydantic_core import to_json
from quart import Response, current_app, g, request
from quart_trio import QuartTrio

from engine.api import AsyncEngine, EngineDeadError, RequestOutput, RequestOutputKind, SamplingParams
from engine.concurrency.offload import run_sized
from engine.ids import random_id
from web import sse
from web.beam_search_api import beam_chat, beam_completion
from web.errors import APIError, bad_request
from web.fields import check_fields
from web.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    check_model,
    checked_messages,
    echoed_text,
    message_texts,
    parse_body,
)
from web.responses import ChatStream, CompletionStream, chat_response, completion_response, usage
from web.state import ServerState
from web.tools import ToolPlan, history_for_template, plan_tools

# Bodies and responses above these sizes are parsed / built in a worker thread.
OFFLOAD_BODY_BYTES = 64 << 10
OFFLOAD_RESPONSE_TOKENS = 4096


def register(app: QuartTrio, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions() -> Response:
        return await create_completion(state)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await create_chat_completion(state)

    @app.post("/v1/chat/completions/batch")
    async def batch_chat_completions() -> Response:
        return await create_batch_chat_completion(state)

    @app.post("/invocations")
    async def invocations() -> Response:
        """SageMaker's entry point, as vLLM serves it: the body's shape picks the endpoint
        (`messages`: chat, `prompt`: completions, `input`: embeddings)."""
        body = await read_body()
        g.trio_llm_body = body
        keys = await run_sized(_top_level_keys, body, size=len(body), inline_below=OFFLOAD_BODY_BYTES,
                               limiter=state.limiter)
        if "messages" in keys:
            return await create_chat_completion(state)
        if "prompt" in keys or "prompt_embeds" in keys:
            return await create_completion(state)
        if "input" in keys:
            from web.pooling_api import create_embeddings  # here: web.pooling_api imports this module
            return await create_embeddings(state, await read_request(state, EmbeddingRequest))
        raise bad_request("/invocations takes a chat (messages), completions (prompt) or embeddings (input) body")


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


def _top_level_keys(body: bytes | bytearray) -> set[str]:
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


# ---- completions ---------------------------------------------------------------------------------
def generation_engine(state: ServerState) -> AsyncEngine:
    """The engine, if its model can generate; a pooling model (BERT) answers 400 here."""
    engine = state.engine_for_request()
    engine.processor.check_can_generate()  # the engine's own check and wording (a 400 naming `model`)
    return engine


def _prompt_texts(engine: AsyncEngine) -> Callable[[int, RequestOutput], RequestOutput]:
    """For echo: each output of a token-id prompt with the prompt's text, special tokens kept (as
    vLLM echoes it), decoded once per prompt."""
    texts: dict[int, str] = {}

    def with_text(index: int, output: RequestOutput) -> RequestOutput:
        if output.prompt is not None:
            return output
        if index not in texts:
            texts[index] = engine.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)
        return replace(output, prompt=texts[index])

    return with_text


def _as_it_is(index: int, output: RequestOutput) -> RequestOutput:
    return output


async def create_completion(state: ServerState) -> Response:
    """Handles `POST /v1/completions`. The client going away cancels the handler, which aborts its
    engine requests.
    """
    req: CompletionRequest = await read_request(state, CompletionRequest)
    force_usage = state.settings.enable_force_include_usage  # vLLM's: usage on every chunk, and a last one
    engine = generation_engine(state)
    prompts = req.prompts()
    if not prompts:
        raise bad_request("prompt must not be empty", "prompt")
    if req.use_beam_search:
        beams = await beam_completion(state, engine, req, prompts)
        return await json_response(state, lambda: beams, beams["usage"]["completion_tokens"])
    params = completion_sampling_params(engine, req)
    model_name = state.response_model(req.model)
    response_id, created = f"cmpl-{random_id()}", int(time.time())
    outputs = engine.generate_batch([req.salted(p) for p in prompts], params, request_id=response_id,
                                    priority=req.priority, lora_request=state.lora_request(req.model))
    first = await first_item(outputs)
    with_text = _prompt_texts(engine) if req.echo else _as_it_is
    if req.stream:
        stream = CompletionStream(response_id, created, model_name, req.n, req.echo, params.wants_logprobs,
                                  token_ids=req.return_token_ids, as_ids=req.return_tokens_as_token_ids)
        body = sse.stream_events(first, outputs, lambda item: stream.chunk(item[0], with_text(*item),
                                                                           req.continuous_usage or force_usage),
                                 lambda: [stream.usage_chunk()] if req.include_usage or force_usage else [],
                                 state.streams)
        return Response(body, content_type="text/event-stream", headers=sse.HEADERS)
    finals = [with_text(i, output) for i, output in enumerate(await final_outputs(first, outputs, len(prompts)))]
    tokens = sum(len(c.token_ids) for out in finals for c in out.outputs)
    return await json_response(state, lambda: completion_response(
        response_id, created, model_name, req.n, req.echo, params.wants_logprobs, finals,
        req.prompt_logprobs is not None, req.return_token_ids, req.return_tokens_as_token_ids), tokens)


def output_kind(stream: bool) -> RequestOutputKind:
    return RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY


def completion_sampling_params(engine: AsyncEngine, req: CompletionRequest) -> SamplingParams:
    """The sampling parameters of a completions body (`echo` with `logprobs` asks for the prompt's)."""
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    return req.sampling_params(req.max_tokens, req.logprobs, output_kind(req.stream), prompt_logprobs,
                               engine.sampling_defaults)


# ---- chat ----------------------------------------------------------------------------------------
async def chat_prompt_for(state: ServerState, engine: AsyncEngine, req: Any, messages: list[dict[str, Any]],
                          tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """`messages` rendered with the request's template fields (`req`: a chat, batch or tokenize
    body), the tools given to the template. Cancellation drops the rendering thread's result."""
    template_kwargs: dict[str, Any] = {**req.template_kwargs(), "add_generation_prompt": req.add_generation_prompt}
    if req.chat_template is not None:
        if not state.settings.trust_request_chat_template:
            raise bad_request("chat_template in a request needs the server's --trust-request-chat-template",
                              "chat_template")
        template_kwargs["chat_template"] = req.chat_template
    if tools is not None:
        template_kwargs["tools"] = tools
    return await engine.chat_prompt(history_for_template(checked_messages(messages)),
                                    continue_final_message=req.continue_final_message, **template_kwargs)


def chat_top_logprobs(req: Any, params: SamplingParams) -> int | tuple[int, ...] | None:
    """Which logprobs each chat token lists: the top N (`logprobs` with `top_logprobs`), the tokens
    `logprob_token_ids` names (it implies `logprobs`), or none."""
    if params.logprob_token_ids is not None:
        return params.logprob_token_ids
    return params.logprobs if req.logprobs else None


async def chat_sampling_params(state: ServerState, engine: AsyncEngine, req: Any,
                               tools: ToolPlan | None) -> SamplingParams:
    """The sampling parameters of a chat body, with the constraint a tool choice implies.
    Cancellation drops the tokenizer thread's result."""
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params: SamplingParams = req.sampling_params(req.max_completion_tokens or req.max_tokens, logprobs,
                                                 output_kind(req.stream),
                                                 defaults=engine.sampling_defaults)
    if tools is not None and tools.structured is not None:
        if params.structured_outputs is not None:
            raise bad_request("tool_choice required or a named function constrains the output already; drop "
                              "response_format / structured_outputs", "tool_choice")
        params = replace(params, structured_outputs=tools.structured)
    if params.structured_outputs is not None and state.settings.reasoning_parser is not None:
        # The constraint applies to the answer, after the model's reasoning.
        end = tuple(await engine.tokenize("</think>", add_special_tokens=False))
        params = replace(params, structured_outputs=replace(params.structured_outputs, reasoning_end=end))
    return params


def chat_tools(state: ServerState, req: Any) -> ToolPlan | None:
    return plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, state.settings.enable_auto_tool_choice,
                      state.settings.tool_call_parser)


@dataclass
class ChatRun:
    """A chat request under way: its engine stream (its first output already taken) and what
    answering it needs. The Messages and Responses APIs answer from the same run."""

    first: Any  # (0, the first RequestOutput)
    outputs: AsyncGenerator[Any]
    response_id: str
    created: int
    model_name: str
    tool_plan: ToolPlan | None
    reasoning_parser: str | None
    top_logprobs: int | tuple[int, ...] | None  # see chat_top_logprobs
    request: ChatCompletionRequest

    def chat_stream(self) -> ChatStream:
        req = self.request
        return ChatStream(self.response_id, self.created, self.model_name, self.top_logprobs,
                          tool_plan=self.tool_plan, reasoning_parser=self.reasoning_parser, echo=req.echoed_text(),
                          token_ids=req.return_token_ids, as_ids=req.return_tokens_as_token_ids)


async def start_chat(state: ServerState, req: ChatCompletionRequest, id_prefix: str = "chatcmpl-") -> ChatRun:
    """Render, validate and submit a chat request, and run it up to its first output (so bad input
    is a 400 before any answer starts). Cancellation aborts the engine request."""
    engine = generation_engine(state)
    tools = chat_tools(state, req)
    if req.truncate_prompt_tokens is None:  # the messages' text alone cannot fit: refused before rendering
        await engine.refuse_texts_too_long(["\n".join(message_texts(req.messages))])
    prompt_input = await chat_prompt_for(state, engine, req, req.messages, tools.tools if tools else None)
    params = await chat_sampling_params(state, engine, req, tools)
    response_id, created = f"{id_prefix}{random_id()}", int(time.time())
    outputs = engine.generate_batch([req.salted(prompt_input)], params, priority=req.priority,
                                    request_id=response_id, lora_request=state.lora_request(req.model))
    first = await first_item(outputs)
    return ChatRun(first, outputs, response_id, created, state.response_model(req.model),
                   tools if tools is not None and tools.makes_calls else None, state.settings.reasoning_parser,
                   chat_top_logprobs(req, params), req)


async def create_chat_completion(state: ServerState) -> Response:
    """Handles `POST /v1/chat/completions`. The client going away cancels the handler, which aborts
    its engine requests.
    """
    req: ChatCompletionRequest = await read_request(state, ChatCompletionRequest)
    force_usage = state.settings.enable_force_include_usage  # vLLM's: usage on every chunk, and a last one
    if req.use_beam_search:
        engine = generation_engine(state)
        prompt = await chat_prompt_for(state, engine, req, req.messages, None)
        beams = await beam_chat(state, engine, req, prompt)
        return await json_response(state, lambda: beams, beams["usage"]["completion_tokens"])
    run = await start_chat(state, req)
    if req.stream:
        stream = run.chat_stream()
        continuous = req.continuous_usage or force_usage
        body = sse.stream_events(run.first, run.outputs, lambda item: stream.chunk(item[1], continuous),
                                 lambda: [stream.usage_chunk()] if req.include_usage or force_usage else [],
                                 state.streams)
        role = stream.role_chunk(req.n, run.first[1].num_prompt_tokens if continuous else None)
        return Response(prepend(sse.event(role), body), content_type="text/event-stream", headers=sse.HEADERS)
    (final,) = await final_outputs(run.first, run.outputs, 1)
    tokens = sum(len(c.token_ids) for c in final.outputs)
    return await json_response(state, lambda: chat_response(run.response_id, run.created, run.model_name, final,
                                                            run.top_logprobs, run.tool_plan, run.reasoning_parser,
                                                            req.echoed_text(), req.prompt_logprobs is not None,
                                                            req.return_token_ids, req.return_tokens_as_token_ids),
                               tokens)


async def create_batch_chat_completion(state: ServerState) -> Response:
    """Handles `POST /v1/chat/completions/batch` (vLLM's): one conversation per item of `messages`,
    run together, answered as one chat completion whose choice `i` is conversation `i`. Streaming,
    tools and n > 1 are refused, as vLLM refuses them. The client going away cancels the handler,
    which aborts every conversation's request."""
    req: BatchChatCompletionRequest = await read_request(state, BatchChatCompletionRequest)
    for name, asked in (("stream", req.stream), ("tools", req.tools), ("n", req.n != 1),
                        ("use_beam_search", req.use_beam_search)):
        if asked:
            raise bad_request(f"{name} is not supported by /v1/chat/completions/batch", name)
    if not req.messages:
        raise bad_request("messages must hold at least one conversation", "messages")
    engine = generation_engine(state)
    prompts = [req.salted(await chat_prompt_for(state, engine, req, conversation, None))
               for conversation in req.messages]
    params = await chat_sampling_params(state, engine, req, None)  # stream is refused: FINAL_ONLY
    response_id, created = f"chatcmpl-{random_id()}", int(time.time())
    model_name = state.response_model(req.model)
    outputs = engine.generate_batch(prompts, params, priority=req.priority, request_id=response_id,
                                    lora_request=state.lora_request(req.model))
    finals = await final_outputs(await first_item(outputs), outputs, len(prompts))
    top = chat_top_logprobs(req, params)

    def build() -> dict[str, Any]:
        bodies = [chat_response(response_id, created, model_name, final, top, None,
                                state.settings.reasoning_parser, echoed_text(conversation, req.echo),
                                token_ids=req.return_token_ids, as_ids=req.return_tokens_as_token_ids)
                  for final, conversation in zip(finals, req.messages, strict=True)]
        choices = [{**body["choices"][0], "index": i} for i, body in enumerate(bodies)]
        prompt_tokens = sum(body["usage"]["prompt_tokens"] for body in bodies)
        completion_tokens = sum(body["usage"]["completion_tokens"] for body in bodies)
        return {**bodies[0], "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    return await json_response(state, build, sum(len(c.token_ids) for f in finals for c in f.outputs))


async def prepend(head: bytes, body: AsyncGenerator[bytes]) -> AsyncGenerator[bytes]:
    """`head`, then `body`. Closing this (the client went away: cancellation) closes `body`, whose
    finally aborts its requests."""
    async with aclosing(body):  # closing this closes the body at once (its finally aborts the request)
        yield head
        async for chunk in body:
            yield chunk
