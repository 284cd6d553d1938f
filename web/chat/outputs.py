"""Turning engine `RequestOutput`s into OpenAI response bodies (plain dicts).

Choice index for completions with several prompts follows OpenAI/vLLM:
`prompt_index * n + sample_index`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.api import CompletionOutput, PositionLogprobs, RequestOutput
from web.chat.reasoning import HarmonyStream, ReasoningStream, reasoning_stream, split_reasoning
from web.chat.tools import ToolCallStream, ToolPlan, extract_calls


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# ---- logprobs ------------------------------------------------------------------------------------
def _token(token_id: int, text: str | None, as_ids: bool) -> str:
    """How a logprob entry names its token: its text, or `token_id:<id>` (return_tokens_as_token_ids)."""
    return f"token_id:{token_id}" if as_ids else text or ""


def completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None],
                        text_offset: int, as_ids: bool = False) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens: list[str | None] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    for token_id, position in zip(token_ids, positions, strict=True):
        if position is None:  # the first prompt token has no logprob
            tokens.append(None)
            token_logprobs.append(None)
            tops.append(None)
            offsets.append(offset)
            continue
        chosen = position[token_id]
        text = chosen.decoded_token or ""
        tokens.append(_token(token_id, text, as_ids))
        token_logprobs.append(chosen.logprob)
        tops.append({_token(t, lp.decoded_token, as_ids): lp.logprob for t, lp in position.items()})  # chosen + top-N
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], top: int | tuple[int, ...],
                  as_ids: bool = False) -> dict[str, Any]:
    """The chat shape. `top`: how many of the most likely tokens each position lists, or which
    token ids it lists, in that order (`logprob_token_ids`)."""
    content = []
    for token_id, position in zip(token_ids, positions, strict=True):
        chosen = position[token_id]
        ranked = ([(t, position[t]) for t in top] if isinstance(top, tuple)
                  else sorted(position.items(), key=lambda item: item[1].rank)[:top])
        content.append({**_chat_token(_token(token_id, chosen.decoded_token, as_ids), chosen.logprob),
                        "top_logprobs": [_chat_token(_token(t, lp.decoded_token, as_ids), lp.logprob)
                                         for t, lp in ranked]})
    return {"content": content}


def _chat_token(text: str | None, logprob: float) -> dict[str, Any]:
    text = text or ""
    return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode())}


# ---- completions ---------------------------------------------------------------------------------
@dataclass
class CompletionStream:
    """State of one streamed completions response across its chunks."""

    response_id: str
    created: int
    model: str
    n: int
    echo: bool
    logprobs: bool
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: dict[int, int] = field(default_factory=dict)
    _echoed: set[int] = field(default_factory=set)
    _text_offsets: dict[int, int] = field(default_factory=dict)
    token_ids: bool = False  # return_token_ids
    as_ids: bool = False  # return_tokens_as_token_ids
    _ids_sent: set[int] = field(default_factory=set)

    def chunk(self, prompt_index: int, output: RequestOutput, continuous_usage: bool = False) -> dict[str, Any]:
        """One chunk; with `continuous_usage` (stream_options.continuous_usage_stats) it carries the
        usage so far."""
        self.prompt_tokens[prompt_index] = output.num_prompt_tokens
        choices = []
        for completion in output.outputs:
            index = prompt_index * self.n + completion.index
            text = completion.text
            if self.echo and index not in self._echoed:
                self._echoed.add(index)
                text = (output.prompt or "") + text
            self.completion_tokens[index] = self.completion_tokens.get(index, 0) + len(completion.token_ids)
            choice = {"index": index, "text": text, "logprobs": None,
                      "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
            if self.token_ids:
                if index not in self._ids_sent:
                    self._ids_sent.add(index)
                    choice["prompt_token_ids"] = output.prompt_token_ids
                choice["token_ids"] = completion.token_ids
            if self.logprobs and completion.logprobs is not None:
                offset = self._text_offsets.get(index, 0)
                choice["logprobs"] = completion_logprobs(completion.token_ids, list(completion.logprobs), offset,
                                                         self.as_ids)
                self._text_offsets[index] = offset + len(completion.text)
            choices.append(choice)
        body = {"id": self.response_id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices}
        if continuous_usage:
            body["usage"] = usage(sum(self.prompt_tokens.values()), sum(self.completion_tokens.values()))
        return body

    def usage_chunk(self) -> dict[str, Any]:
        return {"id": self.response_id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [], "usage": usage(sum(self.prompt_tokens.values()), sum(self.completion_tokens.values()))}


def prompt_logprobs_body(positions: list[PositionLogprobs | None] | None) -> list[Any] | None:
    """vLLM's `prompt_logprobs`: per prompt position (None for the first), token id -> logprob, rank
    and text."""
    if positions is None:
        return None
    return [None if p is None else {str(token): {"logprob": lp.logprob, "rank": lp.rank,
                                                 "decoded_token": lp.decoded_token} for token, lp in p.items()}
            for p in positions]


def completion_response(response_id: str, created: int, model: str, n: int, echo: bool, logprobs: bool,
                        outputs: list[RequestOutput], prompt_logprobs: bool = False, token_ids: bool = False,
                        as_ids: bool = False) -> dict[str, Any]:
    choices = []
    prompt_tokens = completion_tokens = 0
    for prompt_index, output in enumerate(outputs):
        prompt_tokens += output.num_prompt_tokens
        for completion in output.outputs:
            completion_tokens += len(completion.token_ids)
            choice = _completion_choice(prompt_index * n + completion.index, output, completion, echo, logprobs,
                                        as_ids)
            if token_ids:
                choice["prompt_token_ids"] = output.prompt_token_ids
                choice["token_ids"] = completion.token_ids
            if prompt_logprobs:
                choice["prompt_logprobs"] = prompt_logprobs_body(output.prompt_logprobs)
            choices.append(choice)
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def _completion_choice(index: int, output: RequestOutput, completion: CompletionOutput, echo: bool,
                       logprobs: bool, as_ids: bool = False) -> dict[str, Any]:
    prefix = (output.prompt or "") if echo else ""
    choice = {"index": index, "text": prefix + completion.text, "logprobs": None,
              "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
    if logprobs and completion.logprobs is not None:
        tokens = completion.token_ids
        positions: list[PositionLogprobs | None] = list(completion.logprobs)
        if echo and output.prompt_logprobs is not None:
            tokens = output.prompt_token_ids + tokens
            positions = list(output.prompt_logprobs) + positions
        choice["logprobs"] = completion_logprobs(tokens, positions, 0, as_ids)
    return choice


# ---- chat ----------------------------------------------------------------------------------------
def chat_message(text: str, finish_reason: str | None, tools: ToolPlan | None,
             reasoning_parser: str | None = None) -> tuple[dict[str, Any], str | None]:
    """The assistant message for `text` (its reasoning split off with a reasoning parser, its tool
    calls found under `tools`), and the finish reason."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "tool_calls": None}  # vLLM's null, not []
    written = text
    if reasoning_parser is not None:  # vLLM 0.32's `reasoning`, and `reasoning_content` as before it
        message["reasoning"], text = split_reasoning(reasoning_parser, text)
        message["reasoning_content"] = message["reasoning"]
        message["content"] = text
    if tools is None:
        return message, finish_reason
    # gpt-oss's calls are messages of their own, beside the reasoning: read from all it wrote
    content, calls = extract_calls(tools, written if tools.parser == "openai" else text)
    message.update(content=content, tool_calls=calls or None)
    if calls and finish_reason == "stop" and tools.mode != "named":
        finish_reason = "tool_calls"  # OpenAI's: a named function's call ends with "stop"
    return message, finish_reason


def chat_response(response_id: str, created: int, model: str, output: RequestOutput,
                  top_logprobs: int | tuple[int, ...] | None, tools: ToolPlan | None = None,
                  reasoning_parser: str | None = None, echo: str = "", prompt_logprobs: bool = False,
                  token_ids: bool = False, as_ids: bool = False) -> dict[str, Any]:
    choices = []
    for completion in output.outputs:
        message, finish_reason = chat_message(completion.text, completion.finish_reason, tools, reasoning_parser)
        if echo and isinstance(message.get("content"), str):
            message["content"] = echo + message["content"]
        choice = {"index": completion.index, "message": message,
                  "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": completion.stop_reason}
        if top_logprobs is not None and completion.logprobs is not None:
            choice["logprobs"] = chat_logprobs(completion.token_ids, completion.logprobs, top_logprobs, as_ids)
        if token_ids:
            choice["token_ids"] = completion.token_ids
        choices.append(choice)
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    body = {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(output.num_prompt_tokens, completion_tokens)}
    if prompt_logprobs:
        body["prompt_logprobs"] = prompt_logprobs_body(output.prompt_logprobs)
    if token_ids:
        body["prompt_token_ids"] = output.prompt_token_ids
    return body


@dataclass
class ChatStream:
    response_id: str
    created: int
    model: str
    top_logprobs: int | tuple[int, ...] | None  # see chat_logprobs
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # With tools, each choice's text is held until it finishes, then sent as content and/or whole
    # tool calls (a client accumulating deltas gets the same message as without streaming).
    tool_plan: ToolPlan | None = None
    held: dict[int, str] = field(default_factory=dict)
    reasoning_parser: str | None = None
    reasoning: dict[int, ReasoningStream | HarmonyStream] = field(default_factory=dict)
    echo: str = ""  # sent before each choice's first content (chat `echo`)
    echoed: set[int] = field(default_factory=set)
    call_streams: dict[int, ToolCallStream] = field(default_factory=dict)
    token_ids: bool = False  # return_token_ids
    as_ids: bool = False  # return_tokens_as_token_ids
    prompt_ids_sent: bool = False

    def _wrap(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.response_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def role_chunk(self, n: int, prompt_tokens: int | None = None) -> dict[str, Any]:
        """The first chunk: each choice's role. With `prompt_tokens` (continuous usage) it carries
        the usage so far, as vLLM's does: the prompt, no completion tokens."""
        extra = {} if prompt_tokens is None else {"usage": usage(prompt_tokens, 0)}
        return self._wrap([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(n)], **extra)

    def chunk(self, output: RequestOutput, continuous_usage: bool = False) -> dict[str, Any]:
        """One chunk; with `continuous_usage` it carries the usage so far."""
        self.prompt_tokens = output.num_prompt_tokens
        choices = []
        for completion in output.outputs:
            self.completion_tokens += len(completion.token_ids)
            delta: dict[str, Any] = {"content": completion.text} if completion.text or not completion.finish_reason \
                else {}
            finish_reason = completion.finish_reason
            if self.tool_plan is not None and self.reasoning_parser is None:
                delta, finish_reason = self._call_delta(completion.index, completion.text, finish_reason)
            elif self.tool_plan is not None:  # reasoning first, then calls: held until the choice ends
                delta, finish_reason = self._tool_delta(completion.index, completion.text, finish_reason)
            elif self.reasoning_parser is not None:
                delta = self._reasoning_delta(completion.index, completion.text, finish_reason is not None)
            if self.echo and completion.index not in self.echoed and "content" in delta:
                self.echoed.add(completion.index)
                delta["content"] = self.echo + delta["content"]
            choice = {"index": completion.index, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
            if self.top_logprobs is not None and completion.logprobs:
                choice["logprobs"] = chat_logprobs(completion.token_ids, completion.logprobs, self.top_logprobs,
                                                   self.as_ids)
            if self.token_ids:
                choice["token_ids"] = completion.token_ids
            choices.append(choice)
        extra: dict[str, Any] = {}
        if self.token_ids and not self.prompt_ids_sent:
            self.prompt_ids_sent = True
            extra["prompt_token_ids"] = output.prompt_token_ids
        if continuous_usage:
            extra["usage"] = usage(self.prompt_tokens, self.completion_tokens)
        return self._wrap(choices, **extra)

    def usage_chunk(self) -> dict[str, Any]:
        return self._wrap([], usage=usage(self.prompt_tokens, self.completion_tokens))

    def _reasoning_delta(self, index: int, text: str, final: bool) -> dict[str, Any]:
        assert self.reasoning_parser is not None
        splitter = self.reasoning.get(index)
        if splitter is None:
            splitter = self.reasoning[index] = reasoning_stream(self.reasoning_parser)
        reasoning, content = splitter.feed(text, final)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        return delta

    def _call_delta(self, index: int, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """Tool calls streamed as they form (and, with auto, the content before them)."""
        assert self.tool_plan is not None
        calls = self.call_streams.setdefault(index, ToolCallStream(self.tool_plan))
        content, deltas = calls.feed(text, final=finish_reason is not None)
        if finish_reason == "stop" and calls.sent and self.tool_plan.mode != "named":
            finish_reason = "tool_calls"
        delta: dict[str, Any] = {"content": content} if content else {}
        if deltas:
            delta["tool_calls"] = deltas
        return delta, finish_reason

    def _tool_delta(self, index: int, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        self.held[index] = self.held.get(index, "") + text
        if finish_reason is None:
            return {}, None
        assert self.tool_plan is not None
        message, finish_reason = chat_message(self.held.pop(index), finish_reason, self.tool_plan,
                                              self.reasoning_parser)
        delta: dict[str, Any] = {}
        if message.get("reasoning"):
            delta["reasoning"] = delta["reasoning_content"] = message["reasoning"]
        if message.get("content"):
            delta["content"] = message["content"]
        if message["tool_calls"]:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        return delta, finish_reason


@dataclass(frozen=True)
class DeltaPiece:
    """One piece of a streamed chat delta, for APIs that stream answers as separate items
    (Anthropic's content blocks, the Responses API's output items)."""

    kind: str  # "reasoning", "text" or "tool_call"
    key: int  # the tool call's index; 0 for reasoning and text
    text: str  # reasoning, text, or a piece of the call's arguments
    call_id: str | None = None  # on a tool call's first piece: its id and name
    name: str | None = None


def delta_pieces(delta: dict[str, Any]) -> list[DeltaPiece]:
    """A chat delta's pieces, in the order the answer has them (reasoning, text, then calls)."""
    pieces = []
    if delta.get("reasoning"):
        pieces.append(DeltaPiece("reasoning", 0, delta["reasoning"]))
    if delta.get("content"):
        pieces.append(DeltaPiece("text", 0, delta["content"]))
    for call in delta.get("tool_calls") or []:
        function = call["function"]
        if "id" in call:
            pieces.append(DeltaPiece("tool_call", call["index"], "", call["id"], function["name"]))
        if function.get("arguments"):
            pieces.append(DeltaPiece("tool_call", call["index"], function["arguments"]))
    return pieces
