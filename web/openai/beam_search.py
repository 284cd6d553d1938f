"""Beam search on /v1/completions and /v1/chat/completions (vLLM's `use_beam_search`, with `n`
beams, `length_penalty` and `early_stopping`): each prompt's best `n` beams become its `n`
choices. The search itself is the engine's (`AsyncEngine.beam_search`); this module maps the
request onto it and the beams onto OpenAI's answer body. It answers once the search has ended: a
streamed beam search, logprobs, stop strings, constrained output and tools are refused with a
400 naming the field."""

from __future__ import annotations

import time
from typing import Any

import anyio

from engine.api import AsyncEngine, BeamSearchOutput, BeamSearchParams
from engine.ids import random_id
from web.chat.outputs import usage
from web.chat.protocol import ChatCompletionRequest
from web.http.errors import bad_request
from web.http.state import ServerState
from web.openai.protocol import CompletionRequest

# What a beam search does not do, by field (each a 400 when asked for).
_REFUSED = {
    "stream": "a beam search answers once it has ended",
    "logprobs": "beams carry their cumulative logprob only",
    "top_logprobs": "beams carry their cumulative logprob only",
    "prompt_logprobs": "beams carry their cumulative logprob only",
    "logprob_token_ids": "beams carry their cumulative logprob only",
    "stop": "beams end at EOS or max_tokens",
    "echo": "the beams are the continuations only",
    "tools": "beams are not parsed for tool calls",
    "response_format": "beams are not constrained",
    "structured_outputs": "beams are not constrained",
    "guided_json": "beams are not constrained", "guided_regex": "beams are not constrained",
    "guided_choice": "beams are not constrained", "guided_grammar": "beams are not constrained",
}


def beam_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> BeamSearchParams:
    """The request's beam search, after refusing what a beam search does not do."""
    for name, why in _REFUSED.items():
        value = getattr(req, name, None)
        if value not in (None, False, [], {}, ""):
            raise bad_request(f"{name} is not supported with use_beam_search: {why}", name)
    return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                            temperature=req.temperature or 0.0, length_penalty=req.length_penalty,
                            include_stop_str_in_output=req.include_stop_str_in_output,
                            early_stopping=req.early_stopping)


async def search_all(state: ServerState, engine: AsyncEngine, prompts: list[Any], params: BeamSearchParams,
                     req: CompletionRequest | ChatCompletionRequest) -> list[BeamSearchOutput]:
    """Every prompt's search, concurrently (their steps batch together). Cancellation (the
    client went away) cancels every search, which aborts its step in flight."""
    results: list[BeamSearchOutput | None] = [None] * len(prompts)
    lora = state.lora_request(req.model)

    async def search(index: int) -> None:
        results[index] = await engine.beam_search(req.salted(prompts[index]), params, priority=req.priority,
                                                  lora_request=lora)

    async with anyio.create_task_group() as tg:
        for index in range(len(prompts)):
            tg.start_soon(search, index)
    return [r for r in results if r is not None]


async def beam_completion(state: ServerState, engine: AsyncEngine, req: CompletionRequest,
                          prompts: list[Any]) -> dict[str, Any]:
    """`use_beam_search` on /v1/completions: the body, choice `prompt index * n + beam` (best first).
    Cancellation (the client went away) cancels every prompt's search."""
    params = beam_params(req, req.max_tokens or 16)
    outputs = await search_all(state, engine, prompts, params, req)
    choices = [{"index": p * req.n + b, "text": seq.text, "logprobs": None, "finish_reason": seq.finish_reason,
                "stop_reason": seq.stop_reason}
               for p, output in enumerate(outputs) for b, seq in enumerate(output.sequences)]
    body = {"id": f"cmpl-{random_id()}", "object": "text_completion", "created": int(time.time()),
            "model": state.response_model(req.model), "choices": choices, "usage": _usage(outputs)}
    return body


async def beam_chat(state: ServerState, engine: AsyncEngine, req: ChatCompletionRequest,
                    prompt: dict[str, Any]) -> dict[str, Any]:
    """`use_beam_search` on /v1/chat/completions: the body, one choice per beam (best first).
    Cancellation (the client went away) cancels the search."""
    if prompt.get("multi_modal_data"):
        raise bad_request("use_beam_search takes text messages (not images)", "messages")
    length = len(prompt["prompt_token_ids"])
    max_tokens = req.max_completion_tokens or req.max_tokens or max(engine.info.max_model_len - length, 1)
    params = beam_params(req, max_tokens)
    (output,) = await search_all(state, engine, [prompt], params, req)
    choices = [{"index": b, "message": {"role": "assistant", "content": seq.text, "tool_calls": None},
                "logprobs": None, "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason}
               for b, seq in enumerate(output.sequences)]
    body = {"id": f"chatcmpl-{random_id()}", "object": "chat.completion", "created": int(time.time()),
            "model": state.response_model(req.model), "choices": choices, "usage": _usage([output])}
    return body


def _usage(outputs: list[BeamSearchOutput]) -> dict[str, int]:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return usage(prompt_tokens, sum(len(o.output_token_ids(s)) for o in outputs for s in o.sequences))
