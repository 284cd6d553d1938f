"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it) and GET /v1/responses/{id}, on
the chat path.

A request becomes a chat request (web.openai.responses_protocol): `instructions` as the system message,
the stored conversation of `previous_response_id`, then this request's input items. It runs as
chat runs (template, sampling, tools, structured output, reasoning parser); the answer comes back
as output items: `reasoning`, `message` (`output_text`), and a `function_call` per tool call.
Streamed, as the Responses API's events (`response.created`, `response.output_item.added`,
`response.output_text.delta`, ..., `response.completed`), each with its `sequence_number`.

With `store` (the default), the response and its conversation are kept in memory, the most
recent `STORED_RESPONSES` of them, for `previous_response_id` and GET; a server restart forgets
them, as vLLM's in-memory store does.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from quart import Response
from quart_trio import QuartTrio

from engine.api import RequestOutput
from engine.ids import random_id
from web.chat.outputs import DeltaPiece, chat_message, delta_pieces
from web.chat.protocol import ChatCompletionRequest
from web.chat.run import ChatRun, start_chat
from web.http import sse
from web.http.errors import APIError
from web.http.requests import final_outputs, json_response, read_request
from web.http.state import ServerState
from web.openai.responses_protocol import ResponsesRequest

STORED_RESPONSES = 1024


@dataclass
class StoredResponse:
    body: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages up to and including this answer (no instructions)


@dataclass
class ResponseStore:
    """The most recent responses created with `store`, by id (oldest forgotten first)."""

    capacity: int = STORED_RESPONSES
    responses: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self.responses[response_id] = stored
        while len(self.responses) > self.capacity:
            self.responses.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        stored = self.responses.get(response_id)
        if stored is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", param=param)
        self.responses.move_to_end(response_id)
        return stored


def register(app: QuartTrio, state: ServerState) -> None:
    store = ResponseStore()

    @app.post("/v1/responses")
    async def responses() -> Response:
        return await create_response(state, store)

    @app.get("/v1/responses/<response_id>")
    async def retrieve(response_id: str) -> Response:
        return await json_response(state, lambda: store.get(response_id).body, 0)


async def create_response(state: ServerState, store: ResponseStore) -> Response:
    """Handles `POST /v1/responses`. The client going away cancels the handler, which aborts the
    engine request (a response cut off so is not stored)."""
    req: ResponsesRequest = await read_request(state, ResponsesRequest)
    history = store.get(req.previous_response_id, "previous_response_id").conversation \
        if req.previous_response_id is not None else []
    turn = req.input_messages()
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    chat = ChatCompletionRequest.model_validate({**req.chat_fields(), "messages": system + history + turn})
    run = await start_chat(state, chat, id_prefix="resp_")
    answer = ResponseBuilder(run, req, history + turn, store)
    if req.stream:
        body = sse.stream_events(run.first, run.outputs, answer.events, answer.closing, state.streams,
                                 framing=RESPONSES_FRAMING)
        return Response(body, content_type="text/event-stream", headers=sse.HEADERS)
    (final,) = await final_outputs(run.first, run.outputs, 1)
    answer.whole(final)
    return await json_response(state, answer.body, sum(len(c.token_ids) for c in final.outputs))


class ResponseBuilder:
    """One answer's output items, built whole or from the stream's deltas, its body, its events,
    and its place in the store once finished."""

    def __init__(self, run: ChatRun, req: ResponsesRequest, conversation: list[dict[str, Any]],
                 store: ResponseStore) -> None:
        self.run, self.req, self.conversation, self.store = run, req, conversation, store
        self.items: list[dict[str, Any]] = []
        self.open: tuple[str, int] | None = None  # (kind, tool call index) of the item being streamed
        self.chat = run.chat_stream()
        self.sequence = 0
        self.input_tokens = self.output_tokens = 0
        self.finish_reason: str | None = None

    # ---- whole ------------------------------------------------------------------------------------
    def whole(self, final: RequestOutput) -> None:
        completion = final.outputs[0]
        message, self.finish_reason = chat_message(completion.text, completion.finish_reason, self.run.tool_plan,
                                                   self.run.reasoning_parser)
        self.input_tokens, self.output_tokens = final.num_prompt_tokens, len(completion.token_ids)
        if message.get("reasoning"):
            self.items.append(_reasoning_item(message["reasoning"], "completed"))
        if message.get("content"):
            self.items.append(_message_item(message["content"], "completed"))
        for call in message.get("tool_calls") or []:
            self.items.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"],
                                         "completed"))
        self._store()

    def body(self, status: str | None = None) -> dict[str, Any]:
        """The response object (status: completed, incomplete when max_output_tokens cut it)."""
        req, cut = self.req, self.finish_reason == "length"
        text_format = req.text.format.model_dump(by_alias=True, exclude_none=True) \
            if req.text is not None and req.text.format is not None else {"type": "text"}
        return {
            "id": self.run.response_id, "object": "response", "created_at": self.run.created,
            "status": status or ("incomplete" if cut else "completed"), "model": self.run.model_name,
            # a snapshot: an event holding the live list would show items added after it was made
            "output": copy.deepcopy(self.items), "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut and status is None else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id, "parallel_tool_calls": req.parallel_tool_calls,
            "temperature": req.temperature, "top_p": req.top_p, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "text": {"format": text_format}, "truncation": "disabled",
            "metadata": req.metadata or {}, "store": req.store, "user": req.user,
            "usage": {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": self.input_tokens + self.output_tokens},
        }

    def _store(self) -> None:
        if self.req.store:
            self.store.put(self.run.response_id, StoredResponse(self.body(), self.conversation +
                                                                _as_messages(self.items)))

    # ---- streamed ---------------------------------------------------------------------------------
    def events(self, item: tuple[int, RequestOutput]) -> list[dict[str, Any]]:
        output = item[1]
        events: list[dict[str, Any]] = []
        if self.sequence == 0:
            started = self.body("in_progress")  # before any item: `output: []`, as OpenAI sends it
            events += [self._event("response.created", response=started),
                       self._event("response.in_progress", response=started)]
        (choice,) = self.chat.chunk(output)["choices"]
        self.input_tokens = output.num_prompt_tokens
        self.output_tokens += len(output.outputs[0].token_ids)
        for piece in delta_pieces(choice["delta"]):
            events += self._piece(piece)
        if choice["finish_reason"] is not None:
            self.finish_reason = choice["finish_reason"]
            events += self._close()
        return events

    def closing(self) -> list[dict[str, Any]]:
        """After the last output: the finished response (not after an error or a shutdown)."""
        self._store()
        kind = "response.incomplete" if self.finish_reason == "length" else "response.completed"
        return [self._event(kind, response=self.body())]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _piece(self, piece: DeltaPiece) -> list[dict[str, Any]]:
        kind = "function_call" if piece.kind == "tool_call" else piece.kind
        events: list[dict[str, Any]] = []
        if self.open != (kind, piece.key):
            events += self._close() + self._start(kind, piece)
            self.open = (kind, piece.key)
        where = {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}
        item = self.items[-1]
        if kind == "reasoning":
            item["content"][0]["text"] += piece.text
            events.append(self._event("response.reasoning_text.delta", **where, content_index=0, delta=piece.text))
        elif kind == "text":
            item["content"][0]["text"] += piece.text
            events.append(self._event("response.output_text.delta", **where, content_index=0, delta=piece.text,
                                      logprobs=[]))
        elif piece.text:
            item["arguments"] += piece.text
            events.append(self._event("response.function_call_arguments.delta", **where, delta=piece.text))
        return events

    def _start(self, kind: str, piece: DeltaPiece) -> list[dict[str, Any]]:
        if kind == "reasoning":
            self.items.append(_reasoning_item("", "in_progress"))
        elif kind == "text":
            self.items.append(_message_item("", "in_progress"))
        else:
            self.items.append(_call_item(piece.call_id or "", piece.name or "", "", "in_progress"))
        where = {"output_index": len(self.items) - 1}
        events = [self._event("response.output_item.added", **where, item=_copy(self.items[-1], content=[]))]
        if kind == "text":
            events.append(self._event("response.content_part.added", item_id=self.items[-1]["id"], **where,
                                      content_index=0, part={**self.items[-1]["content"][0]}))
        return events

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        kind, self.open = self.open[0], None
        item = self.items[-1]
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if kind == "reasoning":
            events = [self._event("response.reasoning_text.done", **where, content_index=0,
                                  text=item["content"][0]["text"])]
        elif kind == "text":
            part = item["content"][0]
            events = [self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                                  logprobs=[]),
                      self._event("response.content_part.done", **where, content_index=0, part=part)]
        else:
            events = [self._event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=item["arguments"])]
        return events + [self._event("response.output_item.done", output_index=len(self.items) - 1, item=item)]


RESPONSES_FRAMING = sse.Framing(encode=sse.named_event, done=b"", split=lambda events: events,
                                error=lambda error: {"type": "error", "code": error.code or str(error.status),
                                                     "message": error.message, "param": error.param})


def _reasoning_item(text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{random_id()}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _message_item(text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{random_id()}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{random_id()}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _copy(item: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """An item as `output_item.added` announces it (a copy: the item grows before the event is
    written): a message with no parts yet."""
    return {**item, **changes} if item["type"] == "message" else copy.deepcopy(item)


def _as_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An answer's output items as the assistant turn of a chat conversation (reasoning dropped,
    as chat templates drop it from earlier turns)."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]
