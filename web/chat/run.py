"""A chat request under way, as every family runs one: OpenAI's chat completions, the Responses
API and Anthropic's Messages render the conversation with the chat template, turn the body into
sampling parameters (with the constraint a tool choice implies) and submit it (`start_chat`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace
from typing import Any

from engine.api import AsyncEngine, RequestOutputKind, SamplingParams
from engine.ids import random_id
from web.chat.outputs import ChatStream
from web.chat.protocol import ChatCompletionRequest, checked_messages, message_texts
from web.chat.reasoning import reasoning_end
from web.chat.tools import ToolPlan, history_for_template, plan_tools
from web.http.errors import bad_request
from web.http.requests import first_item
from web.http.state import ServerState


def generation_engine(state: ServerState) -> AsyncEngine:
    """The engine, if its model can generate; a pooling model (BERT) answers 400 here."""
    engine = state.engine_for_request()
    engine.check_can_generate()  # the engine's own check and wording (a 400 naming `model`)
    return engine


def output_kind(stream: bool) -> RequestOutputKind:
    return RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY


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
    parser = state.settings.reasoning_parser
    if params.structured_outputs is not None and parser is not None:
        # The constraint applies to the answer, after the model's reasoning.
        end = tuple(await engine.tokenize(reasoning_end(parser), add_special_tokens=False))
        params = replace(params, structured_outputs=replace(params.structured_outputs, reasoning_end=end))
    if parser == "openai_gptoss":  # harmony's tags are special tokens: the parser reads them, then drops them
        params = replace(params, skip_special_tokens=False)
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
