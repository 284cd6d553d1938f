"""Tool calling in chat: what a request's `tools` and `tool_choice` ask for, and the tool calls in
what the model wrote.

- `none`: the template sees the tools; the answer is text.
- `required`: the output is constrained to a JSON array of calls (`[{"name": ..., "parameters":
  {...}}]`, each name one of the tools and its parameters valid against that tool's schema),
  so even a random-weight model answers with well-formed calls. No parser flag is needed.
- a named function: constrained to that function's parameters; one call.
- `auto`: free text, parsed afterwards by the parser `--tool-call-parser` names (`hermes`:
  `<tool_call>{...}</tool_call>` blocks; `llama3_json`: `{"name": ..., "parameters": ...}`
  objects separated by `;`). Without `--enable-auto-tool-choice` it is refused, as vLLM does.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any

import partial_json_parser

from engine.ids import random_id
from engine.structured_outputs import StructuredOutputs
from web.chat.parser_names import TOOL_PARSERS
from web.chat.reasoning import harmony_messages, held_back, split_harmony
from web.http.errors import bad_request

PARSERS = TOOL_PARSERS


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # none, auto, required, named
    tools: list[dict[str, Any]]  # as the template receives them
    structured: StructuredOutputs | None = None
    named: str | None = None
    parser: str | None = None

    @property
    def makes_calls(self) -> bool:
        return self.mode != "none"


def template_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """`tools` checked, as the chat template receives them (None: no tools)."""
    if not tools:
        return None
    _functions(tools)
    return tools


def _functions(tools: list[Any]) -> dict[str, dict[str, Any]]:
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                              "tools")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        functions[function["name"]] = parameters
    return functions


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool, auto_enabled: bool,
               parser: str | None) -> ToolPlan | None:
    """What the request's tool fields ask for (None: no tools); 400s for what cannot be honoured."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    functions = _functions(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if not auto_enabled or parser is None:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                              'set', "tool_choice")
        return ToolPlan("auto", tools, parser=parser)
    if choice == "required":
        parameters, definitions = _definitions_at_root(functions)
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"const": name}, "parameters": schema}}
                 for name, schema in parameters.items()]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if definitions:
            array["$defs"] = definitions
        if not parallel:
            array["maxItems"] = 1
        return ToolPlan("required", tools, StructuredOutputs(json=array))
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                          '{"name": ...}}', "tool_choice")
    if name not in functions:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return ToolPlan("named", tools, StructuredOutputs(json=functions[name]), named=name)


_LOCAL_DEFINITIONS = ("#/$defs/", "#/definitions/")


def _definitions_at_root(functions: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Each tool's parameters schema with its `$defs` (or `definitions`) moved to the root of the
    array of calls, each under a name of its tool's (`tool0_Address`), and its `$ref`s rewritten to
    match: pydantic's schemas refer to `#/$defs/...`, which inside the array would point at the
    array's root, where nothing is defined. A `$ref` to a tool's own root (`#`) points at a copy."""
    definitions: dict[str, Any] = {}
    parameters: dict[str, dict[str, Any]] = {}
    for i, (name, schema) in enumerate(functions.items()):
        prefix = f"tool{i}_"
        own: dict[str, Any] = {}
        for section in ("definitions", "$defs"):
            if isinstance(schema.get(section), dict):
                own.update(schema[section])
        body = _rewritten_refs({k: v for k, v in schema.items() if k not in ("$defs", "definitions")}, prefix)
        definitions.update({prefix + key: _rewritten_refs(value, prefix) for key, value in own.items()})
        if f'"#/$defs/{prefix}root"' in json.dumps(body):
            definitions[prefix + "root"] = body
        parameters[name] = body
    return parameters, definitions


def _rewritten_refs(value: Any, prefix: str) -> Any:
    if isinstance(value, list):
        return [_rewritten_refs(item, prefix) for item in value]
    if not isinstance(value, dict):
        return value
    rewritten = {key: _rewritten_refs(item, prefix) for key, item in value.items()}
    ref = rewritten.get("$ref")
    if ref == "#":
        rewritten["$ref"] = f"#/$defs/{prefix}root"
    elif isinstance(ref, str):
        for local in _LOCAL_DEFINITIONS:
            if ref.startswith(local):
                rewritten["$ref"] = f"#/$defs/{prefix}{ref[len(local):]}"
    return rewritten


def _arguments(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else _arguments(arguments)
    return {"id": f"chatcmpl-tool-{random_id()}", "type": "function", "function": {"name": name, "arguments": text}}


def extract_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of what the model wrote under `plan`."""
    if plan.mode == "named":
        return None, [_call(plan.named or "", text)] if is_json(text) else []
    if plan.mode == "required":
        calls = [c for c in _whole_items(text) if isinstance(c, dict) and {"name", "parameters"} <= c.keys()]
        if not calls:
            return text, []  # cut short (max_tokens) before one call was whole: the text is all there is
        return None, [_call(c["name"], c["parameters"]) for c in calls]
    if plan.mode == "auto":
        return parse_calls(plan.parser or "", text)
    return text, []


_BETWEEN_ITEMS = re.compile(r"[\s,]*")


def _past_separators(text: str, at: int) -> int:
    found = _BETWEEN_ITEMS.match(text, at)
    return at if found is None else found.end()  # it matches everywhere (possibly nothing)


def _whole_items(text: str) -> list[Any]:
    """The items of the JSON array `text` that are whole: all of them, or, where `text` was cut
    short (max_tokens), those before the cut, as a stream has already sent them."""
    decoder, items, at = json.JSONDecoder(), list[Any](), _past_separators(text, 0)
    if not text.startswith("[", at):
        return []
    at += 1
    while True:
        at = _past_separators(text, at)
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return items
        items.append(item)


def is_json(text: str) -> bool:
    """Whether `text` is one whole JSON value."""
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_calls(parser: str, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Tool calls written as the model's format has them; text that is not a call stays content.
    `openai`: gpt-oss's harmony messages to `functions.NAME` (its text, special tokens kept: it runs
    beside `--reasoning-parser openai_gptoss`), the content its messages to the user."""
    if parser == "openai":
        messages = harmony_messages(text)
        if messages is None:
            return text, []
        calls = [_call(m.recipient.removeprefix("functions."), m.body.strip()) for m in messages
                 if m.recipient is not None and m.recipient.startswith("functions.")]
        return split_harmony(text)[1] or None, calls
    if parser == "hermes":
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = []
        for block in _HERMES.findall(text[start:]):
            try:
                call = json.loads(block)
                calls.append(_call(call["name"], call.get("arguments", {})))
            except (json.JSONDecodeError, KeyError, TypeError):
                return text, []
        return text[:start].strip() or None, calls
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls, decoder, position = [], json.JSONDecoder(), 0
    try:
        while position < len(body):
            call, end = decoder.raw_decode(body, position)
            calls.append(_call(call["name"], call.get("parameters", call.get("arguments", {}))))
            position = end
            while position < len(body) and body[position] in " \n;":
                position += 1
    except (json.JSONDecodeError, KeyError, TypeError):
        return text, []
    return None, calls


class ToolCallStream:
    """An answer's tool calls streamed as they form, as vLLM streams them: a call's id, type and
    name once its name is complete, then its `arguments` in pieces; with `auto`, the text before
    the first call streams as content (a possible start of the call tag held back).

    The open JSON is read with partial-json-parser; of a call's arguments only the part no later
    text can change is sent (not the closing quotes and brackets the parser supplied), the rest
    when the answer finishes."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.content_sent = 0  # characters of content sent
        self.sent: list[str] = []  # arguments sent so far, per call

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, `tool_calls` deltas) for the answer's next piece."""
        self.text += text
        content = self._content(final)
        deltas: list[dict[str, Any]] = []
        calls = self._calls()
        for index, (name, arguments) in enumerate(calls):
            if index == len(self.sent):
                self.sent.append("")
                deltas.append({"index": index, "id": f"chatcmpl-tool-{random_id()}", "type": "function",
                               "function": {"name": name, "arguments": ""}})
            serial = _arguments(arguments)
            # A call followed by another is complete: its arguments' rest goes out before the next
            # call opens (Anthropic's and the Responses API's blocks close in order).
            complete = final or index < len(calls) - 1
            ready = serial if complete else serial.rstrip('"]}')
            if ready.startswith(self.sent[index]) and len(ready) > len(self.sent[index]):
                deltas.append({"index": index, "function": {"arguments": ready[len(self.sent[index]):]}})
                self.sent[index] = ready
        return content, deltas

    def _content(self, final: bool) -> str:
        """Free text before the first call (auto only)."""
        if self.plan.mode != "auto":
            return ""
        if self.plan.parser == "hermes":
            end = self.text.find(_HERMES_TAG)
            if end < 0:
                end = len(self.text) if final else len(self.text) - held_back(self.text, _HERMES_TAG)
        else:  # llama3_json: an answer that opens with a call is all calls
            head = self.text.lstrip()
            if not head or _LLAMA_TAG.startswith(head) or head.startswith(("{", _LLAMA_TAG)):
                end = 0 if not final or head.startswith(("{", _LLAMA_TAG)) else len(self.text)
            else:
                end = len(self.text)
        piece = self.text[self.content_sent:max(end, self.content_sent)]
        self.content_sent += len(piece)
        return piece

    def _calls(self) -> list[tuple[str, Any]]:
        if self.plan.mode == "named":
            value = _partial(self.text)
            return [(self.plan.named or "", value)] if isinstance(value, dict) else []
        if self.plan.mode == "required":
            items = _partial(self.text)
            return [(c["name"], c["parameters"]) for c in (items if isinstance(items, list) else [])
                    if isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c]
        if self.plan.parser == "hermes":
            blocks = [b.split("</tool_call>")[0] for b in self.text.split(_HERMES_TAG)[1:]]
            return _named_calls([_partial(b.strip()) for b in blocks], "arguments")
        head = self.text.strip().removeprefix(_LLAMA_TAG).strip()
        if not head.startswith("{"):
            return []
        return _named_calls([_partial(part.strip()) for part in head.split(";")], "parameters")


_HERMES_TAG, _LLAMA_TAG = "<tool_call>", "<|python_tag|>"


def _partial(text: str) -> Any:
    try:
        return partial_json_parser.loads(text, partial_json_parser.Allow.ALL) if text else None
    except Exception:  # not JSON (yet): nothing to say
        return None


def _named_calls(values: list[Any], arguments_key: str) -> list[tuple[str, Any]]:
    calls = []
    for value in values:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            break
        if arguments_key not in value and "arguments" not in value and "parameters" not in value:
            break  # the name may still be growing
        calls.append((value["name"], value.get(arguments_key, value.get("arguments", value.get("parameters")))))
    return calls


def history_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls as templates expect them: `arguments` as an object, not JSON text."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for call in calls:
                function = dict(call.get("function") or {}) if isinstance(call, dict) else {}
                if isinstance(function.get("arguments"), str):
                    with contextlib.suppress(json.JSONDecodeError):
                        function["arguments"] = json.loads(function["arguments"])
                fixed.append({**call, "function": function} if isinstance(call, dict) else call)
            message = {**message, "tool_calls": fixed}
        out.append(message)
    return out
