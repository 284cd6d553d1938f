"""POST /v1/completions/render and /v1/chat/completions/render (vLLM's render endpoints).

Each answers what its generation endpoint would run, without running it: the prompt's token
ids after the chat template, truncation and image expansion, and the sampling parameters the
request resolves to (server defaults applied, `max_tokens` filled in from the context), in
vLLM's `GenerateRequest` shape. The same checks as generation run first, so a body this
answers 200 for is one the generation endpoint accepts.
"""

from __future__ import annotations

from typing import Any

from quart import Response
from quart_trio import QuartTrio

from engine.api import AsyncEngine, EngineInput, SamplingParams
from engine.ids import random_id
from web.chat.protocol import ChatCompletionRequest
from web.chat.run import chat_prompt_for, chat_sampling_params, chat_tools, generation_engine
from web.http.requests import json_response, read_request
from web.http.state import ServerState
from web.openai.completions import completion_sampling_params
from web.openai.protocol import CompletionRequest


def register(app: QuartTrio, state: ServerState) -> None:
    @app.post("/v1/completions/render")
    async def render_completion() -> Response:
        return await create_completion_render(state)

    @app.post("/v1/chat/completions/render")
    async def render_chat_completion() -> Response:
        return await create_chat_render(state)


async def create_completion_render(state: ServerState) -> Response:
    """Handles `POST /v1/completions/render`: one `GenerateRequest` per prompt, in prompt order.
    The client going away cancels the handler; nothing was queued to abort."""
    req: CompletionRequest = await read_request(state, CompletionRequest)
    engine = generation_engine(state)
    params = completion_sampling_params(engine, req)
    rendered = await engine.render([req.salted(p) for p in req.prompts()], params)
    bodies = [generate_request("cmpl", engine, item, params, req) for item in rendered]
    return await json_response(state, lambda: bodies, sum(len(b["token_ids"]) for b in bodies))


async def create_chat_render(state: ServerState) -> Response:
    """Handles `POST /v1/chat/completions/render`: the one `GenerateRequest` the chat body makes.
    The client going away cancels the handler; nothing was queued to abort."""
    req: ChatCompletionRequest = await read_request(state, ChatCompletionRequest)
    engine = generation_engine(state)
    tools = chat_tools(state, req)
    prompt_input = await chat_prompt_for(state, engine, req, req.messages, tools.tools if tools else None)
    params = await chat_sampling_params(state, engine, req, tools)
    (rendered,) = await engine.render([req.salted(prompt_input)], params)
    body = generate_request("chatcmpl", engine, rendered, params, req)
    return await json_response(state, lambda: body, len(body["token_ids"]))


def generate_request(prefix: str, engine: AsyncEngine, rendered: EngineInput, params: SamplingParams,
                     req: Any) -> dict[str, Any]:
    """vLLM's `GenerateRequest` for one rendered prompt."""
    max_tokens = engine.info.max_model_len - len(rendered.token_ids)
    if params.max_tokens is not None:
        max_tokens = min(max_tokens, params.max_tokens)
    features = None
    if rendered.mm_features:  # the images' hashes and placeholder runs; pixel tensors are not sent
        features = {"mm_hashes": {"image": [f.mm_hash for f in rendered.mm_features]},
                    "mm_placeholders": {"image": [{"offset": f.offset, "length": f.length}
                                                  for f in rendered.mm_features]},
                    "kwargs_data": None}
    return {"request_id": f"{prefix}-{random_id()}", "token_ids": rendered.token_ids, "features": features,
            "sampling_params": sampling_params_body(params, max_tokens), "model": req.model,
            "stream": req.stream, "stream_options": req.stream_options.model_dump() if req.stream and
            req.stream_options else None, "cache_salt": req.cache_salt, "priority": req.priority,
            "kv_transfer_params": None}


def sampling_params_body(params: SamplingParams, max_tokens: int) -> dict[str, Any]:
    """`params` under vLLM's `SamplingParams` field names."""
    structured = params.structured_outputs
    return {
        "n": params.n, "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty, "temperature": params.temperature,
        "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p, "seed": params.seed,
        "stop": list(params.stop), "stop_token_ids": list(params.stop_token_ids), "ignore_eos": params.ignore_eos,
        "max_tokens": max_tokens, "min_tokens": params.min_tokens, "logprobs": params.logprobs,
        "prompt_logprobs": params.prompt_logprobs, "skip_special_tokens": params.skip_special_tokens,
        "include_stop_str_in_output": params.include_stop_str_in_output,
        "output_kind": params.output_kind.value, "truncate_prompt_tokens": params.truncate_prompt_tokens,
        "logit_bias": {str(t): b for t, b in params.logit_bias} or None,
        "allowed_token_ids": list(params.allowed_token_ids) if params.allowed_token_ids is not None else None,
        "bad_words": list(params.bad_words) or None,
        "structured_outputs": None if structured is None else {
            "json": structured.json, "regex": structured.regex,
            "choice": list(structured.choice) if structured.choice is not None else None,
            "grammar": structured.grammar, "json_object": structured.json_object or None},
    }
