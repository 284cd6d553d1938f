"""The Responses API's request body (OpenAI's `POST /v1/responses`, as vLLM serves it), and the
chat messages and fields that ask for the same answer.

`input` is a string or a list of items: messages (roles user, system, developer, assistant;
content a string or `input_text` / `input_image` / `output_text` parts), `function_call` items
(the model's earlier calls) and `function_call_output` items (their results). `instructions`
become the system message; `text.format` the structured output; function tools (flat, as the
Responses API writes them) become chat tools. Each wrong shape is a 400 naming where it is.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from web.http.bodies import Body, Nested
from web.http.errors import bad_request
from web.http.fields import declare_fields


class TextFormat(Nested):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Nested):
    format: TextFormat | None = None


class ResponsesRequest(Body):
    """The body of `POST /v1/responses`; the sampling fields vLLM takes besides OpenAI's."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    priority: int = 0
    cache_salt: str | None = Field(default=None, min_length=1)
    metadata: dict[str, str] | None = None  # kept with the response and returned with it
    user: str | None = None

    def input_messages(self) -> list[dict[str, Any]]:
        """This request's own items as chat messages (without the instructions or earlier turns)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            _append_item(messages, item, f"input[{i}]")
        return messages

    def chat_fields(self) -> dict[str, Any]:
        """The chat completions fields (all but `messages`) that ask for the same answer."""
        body: dict[str, Any] = {"model": self.model, "stream": self.stream, "priority": self.priority,
                                "parallel_tool_calls": self.parallel_tool_calls}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "stop", "cache_salt",
                     "user"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [_tool(i, tool) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _tool_choice(self.tool_choice)
        if self.text is not None and self.text.format is not None:
            body["response_format"] = _response_format(self.text.format)
        return body


def _append_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind == "message":
        messages.append(_message(item, where))
    elif kind == "function_call":
        call = _function_call(item, where)
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and not last.get("content"):
            last.setdefault("tool_calls", []).append(call)  # parallel calls: one assistant turn
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
            raise bad_request(f"{where}: a function_call_output item needs call_id and output strings", "input")
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    elif kind == "reasoning":
        return  # earlier reasoning is not shown to the model again, as chat templates drop it
    else:
        raise bad_request(f"{where}: unsupported input item {kind!r}; supported: message, function_call, "
                          "function_call_output, reasoning", "input")


_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role, content = item.get("role"), item.get("content")
    if role not in _ROLES:
        raise bad_request(f"{where}.role must be one of user, system, developer, assistant; got {role!r}", "input")
    if isinstance(content, str):
        return {"role": _ROLES[role], "content": content}
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", "input")
    parts = [_part(part, f"{where}.content[{j}]") for j, part in enumerate(content)]
    if all(part["type"] == "text" for part in parts):
        return {"role": _ROLES[role], "content": "".join(part["text"] for part in parts)}
    return {"role": _ROLES[role], "content": parts}


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    raise bad_request(f"{where}: unsupported content part {kind!r}; supported: input_text, output_text, "
                      "input_image (with an image_url)", "input")


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    if not all(isinstance(item.get(key), str) for key in ("call_id", "name", "arguments")):
        raise bad_request(f"{where}: a function_call item needs call_id, name and arguments strings", "input")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"name\": ..., \"parameters\": ...}} "
                          "(function tools only)", "tools")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                      "tool_choice")


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    if fmt.schema_ is None:
        raise bad_request("text.format.schema is required with type json_schema", "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_,
                                                   "strict": fmt.strict}}


declare_fields(ResponsesRequest, "responses", {
    "reasoning": "reasoning follows the chat template and --reasoning-parser; it is not configured per request",
    "include": "no extra output fields are produced",
    "background": "responses run while their request is open",
    "truncation": "prompts are not truncated to fit (an over-long one is a 400)",
    "top_logprobs": "logprobs are not returned by the Responses API yet",
    "prompt": "stored prompt templates are not kept",
    "conversation": "conversations are chained with previous_response_id",
    "max_tool_calls": "calls are not limited by count (parallel_tool_calls: false allows one)",
    "service_tier": "there is one service tier",
    "prompt_cache_key": "prefix caching needs no key",
    "safety_identifier": "no safety system is run",
    "stream_options": "obfuscation is not applied",
})
