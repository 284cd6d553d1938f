"""POST /v1/messages: Anthropic's Messages API, as vLLM serves it, on the chat path.

A Messages body is translated into a chat completions body (system prompt first, content blocks
as chat parts, `tool_use` blocks as assistant tool calls, `tool_result` blocks as tool messages,
tools and tool_choice as OpenAI's) and run exactly as chat runs it: same template, sampling,
structured tool calls and reasoning parser. The answer is translated back: content blocks
(`thinking`, `text`, `tool_use`), a `stop_reason`, `usage`; streamed, Anthropic's events
(`message_start`, `content_block_start` / `_delta` / `_stop`, `message_delta`, `message_stop`).
Errors carry Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`), which its
client reads.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic_core import to_json
from quart import Response
from quart_trio import QuartTrio

from engine.api import EngineDeadError, InvalidRequestError, RequestFailedError, RequestOutput
from web.anthropic.protocol import MessagesRequest
from web.chat.outputs import DeltaPiece, chat_message, delta_pieces
from web.chat.protocol import ChatCompletionRequest
from web.chat.run import ChatRun, start_chat
from web.http import sse
from web.http.errors import APIError
from web.http.requests import final_outputs, json_response, prepend, read_request
from web.http.state import ServerState

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def register(app: QuartTrio, state: ServerState) -> None:
    @app.post("/v1/messages")
    async def messages() -> Response:
        try:
            return await create_message(state)
        except APIError as error:
            return anthropic_error(error)
        except InvalidRequestError as error:
            return anthropic_error(APIError(400, str(error), param=error.param))
        except RequestFailedError as error:
            return anthropic_error(APIError(500, str(error)))
        except EngineDeadError as error:
            return anthropic_error(APIError(503, str(error)))


def anthropic_error(error: APIError) -> Response:
    return Response(to_json(_error_body(error)), status=error.status, headers=error.headers,
                    content_type="application/json")


def _error_body(error: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status, "api_error"),
                                       "message": error.message}}


async def create_message(state: ServerState) -> Response:
    """Handles `POST /v1/messages`. The client going away cancels the handler, which aborts the
    engine request."""
    req: MessagesRequest = await read_request(state, MessagesRequest)
    chat = ChatCompletionRequest.model_validate(req.chat_body())
    run = await start_chat(state, chat, id_prefix="msg_")
    if req.stream:
        stream = MessagesStream(run)
        body = sse.stream_events(run.first, run.outputs, stream.events, stream.closing, state.streams,
                                 framing=ANTHROPIC_FRAMING)
        return Response(prepend(sse.named_event(stream.start()), body), content_type="text/event-stream",
                        headers=sse.HEADERS)
    (final,) = await final_outputs(run.first, run.outputs, 1)
    return await json_response(state, lambda: message_body(run, final), sum(len(c.token_ids) for c in final.outputs))


def message_body(run: ChatRun, final: RequestOutput) -> dict[str, Any]:
    """The whole answer as Anthropic writes it."""
    completion = final.outputs[0]
    message, finish_reason = chat_message(completion.text, completion.finish_reason, run.tool_plan,
                                          run.reasoning_parser)
    content: list[dict[str, Any]] = []
    if message.get("reasoning"):
        content.append({"type": "thinking", "thinking": message["reasoning"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _input(call["function"]["arguments"])})
    stop_reason, stop_sequence = _stop(finish_reason, completion.stop_reason)
    return {"id": run.response_id, "type": "message", "role": "assistant", "model": run.model_name,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": final.num_prompt_tokens, "output_tokens": len(completion.token_ids)}}


class MessagesStream:
    """Anthropic's events for one streamed answer, from the chat stream's deltas: each kind of
    delta (thinking, text, one tool call) is a content block, opened on its first delta and
    closed when another kind starts or the answer ends."""

    def __init__(self, run: ChatRun) -> None:
        self.run = run
        self.chat = run.chat_stream()
        self.block: tuple[str, int] | None = None  # (kind, tool call index) of the open block
        self.index = -1  # the open block's index
        self.output_tokens = 0
        self.ended = False

    def start(self) -> dict[str, Any]:
        first: RequestOutput = self.run.first[1]
        return {"type": "message_start", "message": {
            "id": self.run.response_id, "type": "message", "role": "assistant", "model": self.run.model_name,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": first.num_prompt_tokens, "output_tokens": 0}}}

    def events(self, item: tuple[int, RequestOutput]) -> list[dict[str, Any]]:
        output = item[1]
        (choice,) = self.chat.chunk(output)["choices"]
        completion = output.outputs[0]
        self.output_tokens += len(completion.token_ids)
        events: list[dict[str, Any]] = []
        for piece in delta_pieces(choice["delta"]):
            events += self._piece(piece)
        if choice["finish_reason"] is not None:
            events += self._close()
            stop_reason, stop_sequence = _stop(choice["finish_reason"], completion.stop_reason)
            events.append({"type": "message_delta", "delta": {"stop_reason": stop_reason,
                                                               "stop_sequence": stop_sequence},
                           "usage": {"input_tokens": output.num_prompt_tokens,
                                     "output_tokens": self.output_tokens}})
            self.ended = True
        return events

    def _piece(self, piece: DeltaPiece) -> list[dict[str, Any]]:
        if piece.kind == "reasoning":
            return self._open(("thinking", 0), {"type": "thinking", "thinking": "", "signature": ""}) + \
                [self._delta({"type": "thinking_delta", "thinking": piece.text})]
        if piece.kind == "text":
            return self._open(("text", 0), {"type": "text", "text": ""}) + \
                [self._delta({"type": "text_delta", "text": piece.text})]
        if piece.call_id is not None:
            return self._open(("tool_use", piece.key), {"type": "tool_use", "id": piece.call_id, "name": piece.name,
                                                        "input": {}})
        return [self._delta({"type": "input_json_delta", "partial_json": piece.text})]

    def closing(self) -> list[dict[str, Any]]:
        return [{"type": "message_stop"}] if self.ended else []

    def _open(self, kind: tuple[str, int], block: dict[str, Any]) -> list[dict[str, Any]]:
        if self.block == kind:
            return []
        events = self._close()
        self.block, self.index = kind, self.index + 1
        return events + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if self.block is None:
            return []
        self.block = None
        return [{"type": "content_block_stop", "index": self.index}]


ANTHROPIC_FRAMING = sse.Framing(encode=sse.named_event, error=_error_body, done=b"",
                                split=lambda events: events)


def _stop(finish_reason: str | None, stop_reason: int | str | None) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a chat finish reason."""
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    reasons: dict[str | None, str | None] = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                                             "abort": "end_turn", None: None}
    return reasons.get(finish_reason, "end_turn"), None


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:  # cut short by max_tokens: the text there is
        return {}
