"""Anthropic's Messages request body, and the chat completions body that asks for the same answer.

A Messages body becomes a chat body: the system prompt first, content blocks as chat parts,
`tool_use` blocks as assistant tool calls, `tool_result` blocks as tool messages (ahead of the
rest of their user message, as they answer the calls before it), tools and tool_choice as
OpenAI's. Each wrong shape is a 400 naming where it is.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field

from web.http.bodies import Body, Nested
from web.http.errors import bad_request
from web.http.fields import declare_fields


class OutputFormat(Nested):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Nested):
    """Anthropic's structured outputs (`format`); `effort` is refused (there is no effort knob)."""

    format: OutputFormat | None = None
    effort: str | None = None


class MessagesRequest(Body):
    """Anthropic's request body, with the sampling fields vLLM's Messages endpoint takes
    (`temperature`, `top_p`, `top_k`; Anthropic's own client sends them as extra body fields).
    Content blocks are checked as they are translated."""

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None  # user_id: who asked, as OpenAI's `user` (not used)
    output_config: OutputConfig | None = None

    def chat_body(self) -> dict[str, Any]:
        """The chat completions body that asks for the same answer."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens,
                                "messages": _system(self.system) + _chat_messages(self.messages),
                                "stream": self.stream}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        if self.tools:
            body["tools"] = [_tool(i, tool) for i, tool in enumerate(self.tools)]
        if self.output_config is not None:
            body.update(_output_config(self.output_config))
        if self.tool_choice is not None:
            body["tool_choice"], parallel = _tool_choice(self.tool_choice)
            body["parallel_tool_calls"] = parallel
        return body


def _system(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    return [{"role": "system", "content": "".join(_text(block, "system") for block in system)}]


def _text(block: dict[str, Any], where: str) -> str:
    if block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise bad_request(f"{where}: expected a text block ({{\"type\": \"text\", \"text\": ...}})", where)
    text: str = block["text"]
    return text


def _chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        where = f"messages[{i}]"
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be 'user' or 'assistant', got {role!r}", "messages")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out += _blocks(role, content, where)
        else:
            raise bad_request(f"{where}.content must be a string or a list of content blocks", "messages")
    return out


def _blocks(role: str, blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """One Anthropic message's blocks as chat messages: its parts, then (assistant) its tool
    calls, or (user) a tool message per tool result ahead of the rest."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        here = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, here)})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), here)}})
        elif kind == "thinking" and role == "assistant":
            continue  # earlier reasoning is not shown to the model again, as chat templates drop it
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, here))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, here))
        else:
            raise bad_request(f"{here}: unsupported content block {kind!r} in a {role} message; supported: text, "
                              "image, tool_use (assistant), tool_result (user), thinking (assistant)", "messages")
    message: dict[str, Any] = {"role": role, "content": _content(parts)}
    if calls:
        message["tool_calls"] = calls
    return results + ([message] if parts or calls else [])


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _image_url(source: Any, where: str) -> str:
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str) \
            and isinstance(source.get("media_type"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        url: str = source["url"]
        return url
    raise bad_request(f"{where}.source must be {{\"type\": \"base64\", \"media_type\", \"data\"}} or "
                      "{\"type\": \"url\", \"url\"}", "messages")


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
            or not isinstance(block.get("input"), dict):
        raise bad_request(f"{where}: a tool_use block needs id, name and an input object", "messages")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(_text(part, f"{where}.content") for part in content)
    if not isinstance(block.get("tool_use_id"), str) or not isinstance(content, str):
        raise bad_request(f"{where}: a tool_result block needs tool_use_id and text content", "messages")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
        raise bad_request(f"tools[{i}] needs a name and an input_schema object", "tools")
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> tuple[str | dict[str, Any], bool]:
    """OpenAI's tool_choice and parallel_tool_calls for Anthropic's tool_choice."""
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    mapping: dict[str, Callable[[], str | dict[str, Any]]] = {
        "auto": lambda: "auto", "any": lambda: "required", "none": lambda: "none",
        "tool": lambda: {"type": "function", "function": {"name": choice.get("name")}}}
    if kind not in mapping:
        raise bad_request(f"tool_choice.type must be one of auto, any, tool, none; got {kind!r}", "tool_choice")
    return mapping[kind](), parallel


def _output_config(config: OutputConfig) -> dict[str, Any]:
    if config.effort is not None:
        raise bad_request("output_config.effort is not supported: there is no effort setting", "output_config.effort")
    if config.format is None:
        return {}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output",
                                                                       "schema": config.format.schema_}}}


declare_fields(MessagesRequest, "messages", {  # Anthropic's
    "thinking": "reasoning follows the chat template and --reasoning-parser; it is not configured per request",
    "service_tier": "there is one service tier",
    "container": "code execution containers are not available",
    "mcp_servers": "MCP servers are not called",
    "context_management": "context is not edited by the server",
})
