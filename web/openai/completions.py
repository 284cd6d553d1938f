"""POST /v1/completions, /v1/chat/completions and /v1/chat/completions/batch.

Each request: parse (off the loop when large) -> validate -> one engine request per prompt ->
stream one SSE event per engine step per request, or collect the final outputs and build the
body (off the loop when large).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from quart import Response
from quart_trio import QuartTrio

from engine.api import AsyncEngine, RequestOutput, SamplingParams
from engine.ids import random_id
from web.chat.outputs import CompletionStream, chat_response, completion_response, usage
from web.chat.protocol import BatchChatCompletionRequest, ChatCompletionRequest, echoed_text
from web.chat.run import (
    chat_prompt_for,
    chat_sampling_params,
    chat_top_logprobs,
    generation_engine,
    output_kind,
    start_chat,
)
from web.http import sse
from web.http.errors import bad_request
from web.http.requests import final_outputs, first_item, json_response, prepend, read_request
from web.http.state import ServerState
from web.openai.beam_search import beam_chat, beam_completion
from web.openai.protocol import CompletionRequest


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


def completion_sampling_params(engine: AsyncEngine, req: CompletionRequest) -> SamplingParams:
    """The sampling parameters of a completions body (`echo` with `logprobs` asks for the prompt's)."""
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    return req.sampling_params(req.max_tokens, req.logprobs, output_kind(req.stream), prompt_logprobs,
                               engine.sampling_defaults)


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
